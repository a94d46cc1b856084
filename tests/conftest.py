"""pytest setup: quiet TensorFlow, and make examples/towers_model.py importable.

The model/graph builder lives in examples/towers_model.py (shared with
examples/demo.py); tests import it through tests/models.py.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXAMPLES = os.path.join(_ROOT, "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)


def _silence_tf_python_logs():
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")


_silence_tf_python_logs()


# ---------------------------------------------------------------------------
# The fast subset: python -m pytest -n 2 -m "not slow" tests
# ---------------------------------------------------------------------------

import pytest  # noqa: E402

#: Whole modules left out of the fast subset: subprocesses (the CLI, `check`, several workers),
#: and the oracle's long sweeps over layers, trainers, towers and backends.
SLOW_MODULES = frozenset({
    "test_bench_variants.py", "test_bounded_steps.py", "test_cli.py", "test_harness.py", "test_mirrored.py", "test_multi_worker.py",
    "test_nccl_on_cpu.py", "test_replicated.py", "test_residual.py", "test_selfcheck.py", "test_tower_shapes.py",
    "test_trainers.py", "test_unfused_and_cond.py",
})
#: Single tests (module::name prefix) left out of it: subprocesses, rendering, kernel sweeps.
SLOW_TESTS = (
    "test_fuzz.py::test_cli_",
    "test_fuzz.py::test_api_mutated_graphs[small_nhwc-350]",
    "test_fuzz.py::test_api_mutated_meta_graphs",
    "test_scaling.py::",
    "test_visualize.py::test_svg_without_system_dot",
    "test_visualize.py::test_png_without_system_dot",
    "test_kernels.py::test_kernel_path_trains_like_one_device",
    "test_forward_outputs.py::test_relu_stays_fused_with_the_batch_norm",
    "test_layer_nodes.py::",
    "test_newcomer.py::test_check_help",
    "test_oracle.py::",
    "test_run.py::test_unmodified_trainers",
    "test_run.py::test_run_reports_every_graph",
    "test_run.py::test_refused_graph",
    "test_run.py::test_verify_checks_the_training_step",
    "test_run.py::test_summary_threads_trainers",
    "test_run.py::test_ctrl_c",
    "test_one_device.py::test_run_leaves_one_device_programs",
    "test_partial_steps.py::test_a_step_training_one_tower_trains_as_python",
    "test_silent.py::test_run_synchronizes",
    "test_keras_towers.py::test_keras_tower_trainers_train_like_one_device",
    "test_keras_towers.py::test_soft_placed_towers_and_a_later_template_fit_train_like_one_device",
    "test_keras_towers.py::test_keras_workflows_after_the_first_fit",
    "test_keras_towers.py::test_keras_functions_made_before_fit",
    "test_applications.py::test_towers_applying_networks_twice_train_like_one_device",
    "test_applications.py::test_towers_keeping_one_applications_statistics",
    "test_ps_cluster.py::test_a_",
    "test_keras_towers.py::test_mobilenet_v2_per_tower_trains_like_one_device",
    "test_keras_towers.py::test_the_keras_example",
    *(f"test_stepcheck.py::test_every_form_verifies_in_process[{form}]" for form in (
        "fused op", "fused NCHW", "fused float16", "fused bfloat16", "renorm", "moments cond v1", "fused cond v1",
        "fused 4 towers")),
    "test_stepcheck.py::test_verify_on_a_file",
    "test_loaders.py::test_converted_output_loads_and_trains_like_one_device",
    "test_loaders.py::test_to_graph_imports_and_contexts_name_only_nodes_that_remain",
    "test_replica_rule.py::test_copies_combined_per_variable_train_like_one_device",
    "test_replica_rule.py::test_towers_averaging_in_pairs_are_two_models",
    "test_stepcheck.py::test_the_trainers_update_forms",
)
#: ... except these cases, which keep one fused and one legacy layer of the oracle, and the legacy
#: layer under a v1 cond loaded from every format, in the fast subset.
FAST_ORACLE = frozenset({
    "test_oracle.py::test_rewritten_towers_train_like_one_device[K2-legacy-NHWC-float32-local]",
    "test_oracle.py::test_rewritten_towers_train_like_one_device[K4-fused_op-NCHW-float32-collective]",
    *(f"test_loaders.py::test_converted_output_loads_and_trains_like_one_device[cond_v1-{fmt}]" for fmt in ("pb", "meta", "saved")),
    "test_loaders.py::test_to_graph_imports_and_contexts_name_only_nodes_that_remain[cond_v1]",
})


#: The costliest tests and files first, in this order (CPU-seconds: docs/performance.md):
#: xdist hands its work out in collection order, so the long ones start at once and the short
#: ones fill in. A SPREAD module's tests sharing a module fixture stay next to each other.
FIRST = (
    "test_keras_towers.py::test_keras_tower_trainers_train_like_one_device",
    "test_keras_towers.py::test_keras_workflows_after_the_first_fit",
    "test_keras_towers.py::test_mobilenet_v2_per_tower",
    "test_keras_towers.py::test_soft_placed_towers",
    "test_keras_towers.py::test_the_keras_example",
    "test_ps_cluster.py::test_a_ps_cluster_trains_like",
    "test_fuzz.py::", "test_run.py::", "test_multi_worker.py::", "test_replicated.py::", "test_applications.py::",
)
#: Modules whose tests share nothing costly but what they group themselves (pytest.mark.xdist_group):
#: xdist may give their other tests to either worker. Every other module's tests go to one worker
#: together (`--dist loadgroup`), so that its fixtures and caches are built once.
SPREAD = frozenset({"test_keras_towers.py", "test_ps_cluster.py"})


def _rank(name: str, module: str) -> int:
    """Where `name` (module::test) starts: its place in FIRST, else after all of them."""
    key = name if module in SPREAD else f"{module}::"
    return next((i for i, prefix in enumerate(FIRST) if key.startswith(prefix)), len(FIRST))


def _name(item: pytest.Item) -> str:
    """module::test[id] (ids may hold slashes: the path is cut at the first "::")."""
    return f"{item.path.name}::{item.nodeid.split('::', 1)[1]}"


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Mark the slow tests (registered in setup.cfg), so `-m "not slow"` runs the rest; group each
    module's tests but SPREAD's on one xdist worker; put the costliest first (a module's tests stay
    together: the sort is stable and ranks a grouped module as a whole)."""
    for item in items:
        name, module = _name(item), item.path.name
        if module not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(module))
        if name in FAST_ORACLE:
            continue
        if module in SLOW_MODULES or name.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: _rank(_name(item), item.path.name))


def pytest_unconfigure(config):
    """Stop the fork servers (tests/zygote.py) this process started: it reaps them, so their
    CPU time and their children's count in this process tree."""
    if "zygote" in sys.modules:
        sys.modules["zygote"].stop_all()
