"""pytest setup: quiet TensorFlow, and make examples/towers_model.py importable.

The model/graph builder lives in examples/towers_model.py (shared with
examples/demo.py); tests import it through tests/models.py.
"""

import gc
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
_EXAMPLES = os.path.join(_ROOT, "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)


def _silence_tf_python_logs() -> None:
    """TensorFlow's python logger (tf.get_logger() is logging's "tensorflow") at ERROR, without
    importing TensorFlow: the xdist controller never imports it (8-10 CPU-s before any worker
    starts), the workers do when they collect the tests."""
    import logging

    logging.getLogger("tensorflow").setLevel(logging.ERROR)


#: tf_keras behind tf.keras and tf.compat.v1.layers, as the tests and their scripts use (test_one_device
#: set it at collection already, before any test ran): TensorFlow's import then loads no Keras 3 (with
#: scikit-learn and matplotlib), 2-4 CPU-s less in every worker and in every child that inherits it.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
_silence_tf_python_logs()


# ---------------------------------------------------------------------------
# The fast subset: python -m pytest -n 2 -m "not slow" tests
# ---------------------------------------------------------------------------

import pytest  # noqa: E402

#: The fast subset is a smoke test for after every edit (about a minute on 2 cores): every layer and
#: key property once, cheaply (FAST says where). Everything else is marked slow: these modules whole
#: (subprocesses, clusters, long sweeps; the one-device oracle's sweeps over layers, backends, towers) ...
SLOW_MODULES = frozenset({
    "test_bench_variants.py", "test_bounded_steps.py", "test_harness.py", "test_mirrored.py", "test_multi_worker.py",
    "test_replicated.py", "test_residual.py", "test_selfcheck.py", "test_tower_shapes.py", "test_trainers.py",
    "test_unfused_and_cond.py", "test_scaling.py", "test_layer_nodes.py", "test_fuzz.py",
    "test_zygote.py",  # the fork server's own tests: its zygote imports TensorFlow (~13 CPU-s); no fast test forks
    # sampled: FAST keeps one case or a few of each
    "test_oracle.py", "test_nccl_on_cpu.py", "test_live.py", "test_silent.py", "test_applications.py",
    "test_keras_towers.py", "test_handles.py", "test_local_backend.py", "test_moments_axes.py", "test_fused_math.py",
    "test_loaders.py", "test_one_device.py", "test_ps_cluster.py", "test_replica_rule.py", "test_stepcheck.py",
    "test_structure.py", "test_variable_reads.py", "test_forward_outputs.py", "test_kernels.py", "test_newcomer.py",
})
#: ... and these tests (module::name prefixes) of modules otherwise fast: subprocesses (a TensorFlow
#: import each), trainings against one device, sweeps; FAST has each property's cheap case.
SLOW_TESTS = (
    # the command line: --help, usage errors, README's `run` in processes of their own; TF2 SavedModels
    "test_cli.py::test_help_has_examples", "test_cli.py::test_usage_errors_are_one_line", "test_cli.py::test_readme_",
    "test_cli.py::test_convert_to_nccl_", "test_cli.py::test_tf2_", "test_cli.py::test_inference_batch_norm_in_a_tf_",
    "test_cli.py::test_diff_names_the_layer_of_hand_written_updates",
    # NCCL structure, v2 branches, in place per layer form, a pairwise sweep, shapes and lineup trained or swept
    "test_api.py::test_nccl_structure_on_gpu_towers", "test_api.py::test_inference_batch_norm_in_v2_branches",
    "test_api.py::test_in_place_gives_the_same_graph_in_the_input_order",
    "test_graph.py::test_ancestors_among_answers_depends_on_for_every_pair",
    "test_shapes.py::test_graph_graph_def_and_meta_graph_def_give_the_same_graph", "test_shapes.py::test_bare_graph_def_",
    "test_shapes.py::test_towers_cut_from_one_placeholder_",
    "test_lineup.py::test_mirrored_strategy_replicas_are_towers", "test_lineup.py::test_parallel_twins_with_conventional",
    "test_lineup.py::test_uniquified_scopes_are_paired", "test_lineup.py::test_a_layer_missing_where_names_pair_nothing",
    "test_formats.py::test_rewritten_meta_restores_checkpoint", "test_formats.py::test_saved_model_loads_and_trains",
    "test_formats.py::test_text_saved_model_stays_text",
    # test_inputs: in-place interrupted at every bytecode, big graphs, processes
    "test_inputs.py::test_in_place_interrupted_anywhere", "test_inputs.py::test_in_place_exception_at_any_bytecode",
    "test_inputs.py::test_wide_fan_in_", "test_inputs.py::test_graph_of_near_empty_nodes", "test_inputs.py::test_memory_on_",
    "test_inputs.py::test_fifo_inside_a_saved_model", "test_inputs.py::test_fast_errors_end_to_end",
    "test_inputs.py::test_inspect_json_prints_json_on_failure", "test_inputs.py::test_long_identity_chain_",
    # test_outputs: commits killed at every step, real signals (processes)
    "test_outputs.py::test_every_fault_at_every_commit_step", "test_outputs.py::test_real_signals_while_writing",
    "test_outputs.py::test_second_run_after_a_commit_killed",
    # test_run: every `bnrewrite run` is a process of its own (its command-line mistakes stay)
    "test_run.py::test_unmodified_trainers", "test_run.py::test_run_reports_every_graph", "test_run.py::test_verify_checks_",
    "test_run.py::test_summary_threads_trainers", "test_run.py::test_refused_graph", "test_run.py::test_ctrl_c",
    "test_run.py::test_script_runs_as_python_would", "test_run.py::test_report_is_checked_before",
    "test_run.py::test_report_is_written_where",
    "test_partial_steps.py::test_a_step_training_one_tower_trains_as_python",
    "test_visualize.py::test_svg_without_system_dot", "test_visualize.py::test_png_without_system_dot",
    "test_visualize.py::test_bad_target_is_one_line_and_writes_nothing[layer-",
    "test_visualize.py::test_bad_target_is_one_line_and_writes_nothing[missing/",
    "test_visualize.py::test_bad_target_is_one_line_and_writes_nothing[a_file/",
    "test_visualize.py::test_bad_target_is_one_line_and_writes_nothing[layer.pdf",
)
#: The smoke test's cases from the modules and prefixes above, by layer and property (with the fast
#: modules: test_graph, test_shapes, test_layers, test_lineup, test_meaning, test_api, test_formats,
#: test_inputs, test_outputs, test_collection_names, test_cli, test_visualize, test_run, ...).
FAST = (
    # matching: applications of one network, moments sites, tape gradients, replica rule, ps workers
    "test_applications.py::test_each_application_is_a_layer_named_after_its_scope",
    "test_applications.py::test_applications_that_nothing_tells_apart_are_refused_named",
    "test_moments_axes.py::test_moments_sites_know_the_variables", "test_moments_axes.py::test_weighted_moments_",
    "test_moments_axes.py::test_a_gradient_tape_of_unknown_form_is_refused_named",
    "test_replica_rule.py::test_trainer_all_reduce_combines_the_copies",
    "test_replica_rule.py::test_towers_coupled_only_by_a_scalar_are_refused[loss_sum]",
    "test_keras_towers.py::test_without_gradients_every_training_batch_norm_counts",
    "test_keras_towers.py::test_a_layer_trained_in_one_tower_only_is_refused_naming_the_towers",
    "test_ps_cluster.py::test_backends_that_cannot_serve_a_ps_cluster_are_refused",
    "test_ps_cluster.py::test_backend_ps_needs_a_parameter_server",
    "test_ps_cluster.py::test_the_workers_graphs_meet_at_queues_on_the_ps",
    "test_newcomer.py::test_check_output_points_at_nothing", "test_newcomer.py::test_find_refuses_a_graph_to_graph",
    # the passes: structure (independent oracle), kernels or elementwise, forward outputs, reads before updates
    "test_structure.py::test_train_op_runs_each_moving_statistic_update_once",
    "test_structure.py::test_every_read_of_the_scale_comes_before_its_gradient",
    "test_structure.py::test_every_tower_launches_its_all_reduces_in_one_order[collective-cpu-3]",
    "test_structure.py::test_the_oracle_sees_a_cycle",
    "test_kernels.py::test_channels_last_takes_the_kernels_at_any_size[float32-",
    "test_kernels.py::test_otherwise_the_elementwise_passes[channels first-",
    "test_forward_outputs.py::test_outputs_read_directly_are_the_global_batchs[0.25-True-IdentityN]",
    "test_variable_reads.py::test_every_read_of_a_reference_variable_runs_before_its_update[fused]",
    "test_local_backend.py::test_auto_picks_local_on_cpu_towers_one_sum_per_all_reduce[legacy]",
    "test_local_backend.py::test_several_workers_need_keyed_all_reduces",
    "test_local_backend.py::test_gpu_towers_keep_nccl_and_may_ask_for_local",
    "test_local_backend.py::test_a_device_the_session_lacks_runs_on_its_cpu_0",
    "test_handles.py::test_find_names_what_the_rewrite_removed",
    # the statistics' numbers: dx, running statistics, uneven towers, every fused op
    "test_fused_math.py::test_dx_matches_reference_gradients[passes-2-NHWC]",
    "test_fused_math.py::test_dx_matches_reference_gradients[kernels-2-NHWC]",
    "test_fused_math.py::test_exponential_avg_factor_blends_running_statistics",
    "test_fused_math.py::test_static_uneven_towers[passes-batches0-4]",
    "test_fused_math.py::test_every_fused_op_version[passes-FusedBatchNorm]",
    # the oracle: K towers against one device fed the whole batch, and the un-rewritten graph not matching,
    # per backend (local, collective, NCCL turned into CPU collectives) and moments layer (unequal towers)
    "test_oracle.py::test_rewritten_towers_train_like_one_device[K2-legacy-NHWC-float32-local]",
    "test_oracle.py::test_rewritten_towers_train_like_one_device[K4-fused_op-NCHW-float32-collective]",
    "test_nccl_on_cpu.py::test_nccl_graph_trains_like_one_device[K2-legacy-NHWC]",
    "test_moments_axes.py::test_towers_of_unequal_static_sizes",
    # loaders: a v1 cond's contexts through a SavedModel, to_graph
    "test_loaders.py::test_converted_output_loads_and_trains_like_one_device[cond_v1-saved]",
    "test_loaders.py::test_to_graph_imports_and_contexts_name_only_nodes_that_remain[cond_v1]",
    "test_loaders.py::test_while_and_nested_contexts_keep_only_nodes_that_remain",
    "test_loaders.py::test_input_whose_collections_do_not_load_is_refused",
    # the session layer: enable() and the step check (verify) in process, a graph refused everywhere
    "test_live.py::test_enable_trains_like_one_device_and_disable_stops",
    "test_live.py::test_enable_checks_its_options_without_a_graph",
    "test_live.py::test_in_place_refuses_a_graph_with_a_session_open",
    "test_live.py::test_verify_checks_the_first_step_once[legacy K2]",
    "test_silent.py::test_a_layer_that_cannot_be_synchronized_refuses_the_graph_everywhere",
    "test_stepcheck.py::test_every_form_verifies_in_process[moments legacy]",
    "test_stepcheck.py::test_a_wrong_epsilon_fails_named", "test_stepcheck.py::test_a_layer_left_unsynchronized_fails",
    "test_stepcheck.py::test_verify_fails_with_12_on_a_broken_rewrite",
    # one-device programs: run exactly as python runs them under enable() and in place (bit for bit)
    "test_one_device.py::test_enable_and_in_place_leave_them_as_python_runs_them[enable-two_plain_layers]",
    "test_one_device.py::test_enable_and_in_place_leave_them_as_python_runs_them[in_place-named_layers]",
    "test_one_device.py::test_value_free_walk_ends_on_a_loop", "test_one_device.py::test_applications_chained_",
)
#: The SLOW_MODULES that FAST samples: collected under -m "not slow" (the others are not).
_SAMPLED = frozenset(prefix.split("::", 1)[0] for prefix in FAST)

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


def pytest_ignore_collect(collection_path: pathlib.Path, config: pytest.Config) -> bool | None:
    """With -m "not slow", the modules FAST keeps nothing of are not even imported: their imports
    and assertion rewriting cost every xdist worker about 1 CPU-s."""
    if config.getoption("markexpr") == "not slow" and collection_path.name in SLOW_MODULES - _SAMPLED:
        return True
    return None


def _check_names(items: list[pytest.Item]) -> None:
    """Every SLOW_TESTS and FAST prefix of a collected module starts some test function's name in it:
    a renamed test would otherwise leave the fast subset, or enter it, silently."""
    modules = {item.path.name: item.module for item in items if isinstance(item, pytest.Function)}
    for prefix in (*SLOW_TESTS, *FAST):
        module, test = prefix.split("::", 1)
        function = test.split("[", 1)[0]
        if module in modules and not any(name.startswith(function) for name in vars(modules[module])
                                         if name.startswith("test_") and (name == function or "[" not in test)):
            raise pytest.UsageError(f"tests/conftest.py names no test of {module}: {prefix}")


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Mark the slow tests (registered in setup.cfg), so `-m "not slow"` runs the rest; group each
    module's tests but SPREAD's on one xdist worker; put the costliest first (a module's tests stay
    together: the sort is stable and ranks a grouped module as a whole)."""
    _check_names(items)
    for item in items:
        name, module = _name(item), item.path.name
        if module not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(module))
        if name.startswith(FAST):
            continue
        if module in SLOW_MODULES or name.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: _rank(_name(item), item.path.name))


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection loaded (TensorFlow, tf_keras, the test modules) lives for the whole run:
    out of the collector's sight, no collection scans it again."""
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a module's last test (its fixtures torn down), drop what the modules of tests/ cached
    for the process (their `cache_clear`s: built graphs and trainings), but the next module's own
    and SPREAD's (their tests come back between others'); not tests/scripts' (a script's in-process
    cluster holds servers that cannot be stopped): a worker runs dozens
    of modules, and kept they held every graph it had built (the largest worker grew to 2.8 GB;
    a module shares its builds within itself)."""
    yield
    if nextitem is None or nextitem.module is item.module:
        return
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if module is nextitem.module or os.path.dirname(path) != _TESTS or os.path.basename(path) in SPREAD:
            continue
        for value in list(vars(module).values()):
            if getattr(value, "__module__", None) == name and callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
    gc.collect()  # the graphs' reference cycles, now rather than at some later allocation


def pytest_unconfigure(config):
    """Stop the fork servers (tests/zygote.py) this process started: it reaps them, so their
    CPU time and their children's count in this process tree."""
    if "zygote" in sys.modules:
        sys.modules["zygote"].stop_all()
