"""One-device programs that are not multi-tower run exactly as under python (issue 38).

tests/scripts/one_device_cases.py builds seventeen of them the usual ways (two plain tf.layers batch
norms, layers named bn1/bn2, two streams, a Siamese net, a GAN, an encoder/decoder, a mean
teacher, an ensemble, a tf_keras Sequential's fit, and one network applied to two batches inside
one summed loss in eight forms, issue 49) and trains each a few steps. Run under plain python and
under `bnrewrite run`, every variable must be bit-identical, with one line per graph saying why
it runs unchanged; in process the same through `enable()` and `rewrite_graph(g, in_place=True)`;
`convert` refuses them with the same reason (exit 6). With `--tower-by scope` the user overrides
the rule: the Siamese net is then synchronized, and trains differently, which shows the rule is
what keeps the programs as written.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.compat.v1.layers on TF >= 2.16, before its first use

import tensorflow as tf  # noqa: E402

import bnrewrite  # noqa: E402
from bnrewrite import rewrite_graph  # noqa: E402
from bnrewrite.cli import main  # noqa: E402
import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "one_device_cases.py")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}
#: Why each case is not towers, as the graph shows it (the line names it).
WHY = {
    "two_plain_layers": "batch_normalization/FusedBatchNormV3 feeds batch norm batch_normalization_1/",
    "named_layers": "bn1/FusedBatchNormV3 feeds batch norm bn2/",
    "two_streams": "towers flow and rgb take their batch-norm gradients from one gradient computation",
    "siamese": "towers net and net_1 take their batch-norm gradients from one gradient computation",
    "gan": "batch norm generator/a/batch_normalization/FusedBatchNormV3 feeds batch norm discriminator_1/",
    "encoder_decoder": "encoder/batch_normalization/FusedBatchNormV3 feeds batch norm decoder/",
    "mean_teacher": "tower teacher has no gradient of its own batch norms",
    "ensemble": "the towers (model_a, model_b) train independent models",
    "keras_fit": "batch_normalization/cond/_fn_then/FusedBatchNormV3 feeds batch norm batch_normalization_1/",
    **dict.fromkeys(("semi_supervised", "two_cross_entropies"), "towers net and net_1 take their batch-norm gradients "
                    "from one gradient computation (both from gradients/grad_ys_0)"),
    "gan_discriminator_step": "towers discriminator and discriminator_1 take their batch-norm gradients from one "
                              "gradient computation (both from gradients/grad_ys_0)",
    **dict.fromkeys(("per_domain", "weighted_add_n"), "towers net and net_1 take their batch-norm gradients from one "
                    "gradient computation (both from gradients/grad_ys_0)"),
    "mean_over_concat": "towers net and net_1 take their batch-norm gradients from one gradient computation",
    "tape_summed_loss": "towers net and net_1 take their batch-norm gradients from one gradient computation (both "
                        "from ones)",
    "keras_shared_encoder": "towers encoder and encoder_1 take their batch-norm gradients from one gradient "
                            "computation (both from training/SGD/gradients/gradients/grad_ys_0)",
}


def _cases():
    spec = importlib.util.spec_from_file_location("one_device_cases", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple[str, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The script under python and under `bnrewrite run`, side by side (each its own fresh process):
    run's stderr, python's variables, run's variables."""
    tmp = tmp_path_factory.mktemp("one_device")
    started = {name: zygote.spawn([sys.executable, *head, SCRIPT, str(tmp / f"{name}.npz")], cwd=str(tmp), env=ENV,
                                  text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
               for name, head in (("plain", []), ("run", ["-m", "bnrewrite", "run"]))}
    errors = {name: process.communicate(timeout=600)[1] for name, process in started.items()}
    for name, process in started.items():
        assert process.returncode == 0, (name, errors[name][-3000:])
    return errors["run"], dict(np.load(tmp / "plain.npz")), dict(np.load(tmp / "run.npz"))


def _assert_as_python(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_run_leaves_one_device_programs_as_python_runs_them(both):
    err, plain, run = both
    lines = [line for line in err.splitlines() if line.startswith("bnrewrite:")]
    assert len(lines) == len(WHY), lines
    for number, (line, why) in enumerate(zip(lines, WHY.values()), 1):
        assert line.startswith(f"bnrewrite: graph {number} runs unchanged: ") and why in line, line
    _assert_as_python(run, plain)


@pytest.mark.parametrize("how, name", [*(("enable", name) for name in ("two_plain_layers", "siamese", "mean_teacher")),
                                       *(("in_place", name) for name in ("named_layers", "two_streams", "encoder_decoder"))])
def test_enable_and_in_place_leave_them_as_python_runs_them(capsys, monkeypatch, how: str, name: str):
    """In process, against the same case trained in this process without bnrewrite (a process
    that ran other tests may round differently from a fresh python): under `enable()`, or with
    the script's `rewrite_graph(g, in_place=True)` just before its session."""
    cases = _cases()
    plain = _train(cases, [name])
    if how == "enable":
        with bnrewrite.enabled():
            got = _train(cases, [name])
        lines = capsys.readouterr().err.splitlines()
        assert lines and WHY[name] in lines[0], lines
    else:
        results = []
        real_session = tf.compat.v1.Session

        def in_place_then_session(*args, **kwargs):
            results.append(rewrite_graph(tf.compat.v1.get_default_graph(), in_place=True))
            return real_session(*args, **kwargs)

        monkeypatch.setattr(tf.compat.v1, "Session", in_place_then_session)
        got = _train(cases, [name])
        (result,) = results
        assert WHY[name] in result.report.unchanged and result.report.text().startswith("bnrewrite: runs unchanged: ")
    _assert_as_python(got, plain)


def _train(cases, names: list[str]) -> dict[str, np.ndarray]:
    values = {}
    for name in names:
        with tf.Graph().as_default():
            cases.keras.utils.set_random_seed(0)
            values.update({f"{name}/{k}": v for k, v in cases.CASES[name]().items()})
    return values


@pytest.mark.parametrize("name", ["siamese", "semi_supervised", "mean_over_concat", "tape_summed_loss"])
def test_convert_refuses_them_with_the_reason_and_tower_by_scope_overrides(tmp_path, capsys, name: str):
    """A difference of the two applications' outputs, a summed loss, a mean over their
    concatenation, a tape's summed loss: one gradient computation each, whatever its arithmetic
    (issue 49)."""
    cases = _cases()
    graph = tf.Graph()
    with graph.as_default():
        cases.keras.utils.set_random_seed(0)
        cases.CASES[name]()
    with pytest.raises(bnrewrite.NotReplicasError, match=re.escape(WHY[name])) as refused:
        rewrite_graph(graph)
    assert isinstance(refused.value, bnrewrite.NoTowersError) and "\n" not in str(refused.value)
    source = tmp_path / f"{name}.pb"
    source.write_bytes(graph.as_graph_def().SerializeToString())
    assert main(["convert", str(source), str(tmp_path / "out.pb")]) == 6
    error = capsys.readouterr().err.strip()
    assert WHY[name] in error and "\n" not in error and not (tmp_path / "out.pb").exists()
    # The user says they are towers: synchronized, and the program trains otherwise (so the rule,
    # not luck, keeps it as written).
    assert rewrite_graph(graph, tower_by="scope").report.towers == ["net", "net_1"]
    plain = _train(cases, [name])
    with bnrewrite.enabled(tower_by="scope", quiet=True):
        synced = _train(cases, [name])
    moved = max(float(np.abs(synced[k] - plain[k]).max()) for k in synced)
    assert moved > 1e-3


def test_value_free_walk_ends_on_a_loop():
    """A v1 while loop's Merge reads its own NextIteration: the walk that tells gradient seeds
    (values made of constants and shapes alone) from data ends there, counting the loop as data."""
    from tensorflow.python.ops import control_flow_util

    from bnrewrite.graph.index import Graph
    from bnrewrite.match.data_parallel import _value_free

    graph, v2 = tf.Graph(), control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
    try:
        with graph.as_default():
            counted = tf.compat.v1.while_loop(lambda i: i < 3, lambda i: i + 1, [tf.constant(0)])
            shape = tf.shape(tf.compat.v1.placeholder(tf.float32, [None, 3]))
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = v2
    model = Graph.from_graph_def(graph.as_graph_def())
    merge = next(n.name for n in model if n.op == "Merge")
    assert _value_free(model, merge, {}) is False and _value_free(model, counted.op.name, {}) is False
    assert _value_free(model, shape.op.name, {}) is True


def test_applications_chained_by_their_updates():
    """A network applied twice whose second application is built after the first's updates
    (tf.control_dependencies): not towers even when the user says so, as synchronizing would
    close a cycle ("a bnrewrite bug" before); and each application's batch norm keeps its own
    moving-average updates, not also those reached through the first's updated value."""
    from bnrewrite.graph.index import Graph
    from bnrewrite.match.updates import direct_updates, find_updates
    from bnrewrite.rewrite.api import take_census

    tf1, layers = tf.compat.v1, tf.compat.v1.layers
    graph = tf.Graph()
    with graph.as_default():
        outputs = []
        for _ in range(2):
            x = tf1.placeholder(tf.float32, [2, 4, 4, 3])
            with tf1.variable_scope("net", reuse=tf1.AUTO_REUSE), \
                    tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
                outputs.append(tf.reduce_mean(layers.batch_normalization(layers.conv2d(x, 4, 3), training=True)))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            tf1.train.GradientDescentOptimizer(0.1).minimize(tf.square(outputs[0] - outputs[1]), name="train_op")
    for tower_by in ("auto", "scope"):
        with pytest.raises(bnrewrite.NotReplicasError, match="net/batch_normalization/FusedBatchNormV3 feeds batch norm "
                                                             r"net_1/.*\(or its moving-average updates run before it\)"):
            rewrite_graph(graph, tower_by=tower_by)
    model = Graph.from_graph_def(graph.as_graph_def())
    first, second = take_census(model)[2].sites
    theirs = direct_updates(model, second.statistics)
    assert {u.node.split("/")[0] for u in find_updates(model, first.statistics)[0]} == {"net", "net_1"}
    assert {u.node.split("/")[0] for u in find_updates(model, first.statistics, theirs.__contains__)[0]} == {"net"}
