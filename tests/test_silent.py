"""Nothing left unsynchronized in silence (issue 38): what bnrewrite once let train unsynchronized
without a word is synchronized, or refused with the reason.

The oracle: tests/scripts/silent_cases.py under `bnrewrite run` (a cifar10-style trainer whose
summaries put a tf.nn.zero_fraction cond after every layer, an InteractiveSession made before
the model, the same trainer in a multiprocessing 'spawn' child, a float64 model) against the
same models on one device fed the whole batch, and K towers without bnrewrite missing them,
both trained in process. In process: a graph with a layer that cannot be synchronized is
refused by enable(), convert and inspect; a model added to a graph after its session was
synchronized, or one built after a session on its graph ran, moves the session to the new
synchronized graph with its variables' values (bit for bit as a session made after it), and an
iterator it only started is started again; one it read from is refused.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import bnrewrite
from bnrewrite import UnsyncedLayerError
from bnrewrite.cli import main
import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
import silent_cases  # noqa: E402

tf1 = tf.compat.v1
K, B = 2, 2


@pytest.fixture(autouse=True)
def _disabled_after():
    yield
    bnrewrite.disable()


def _error(got: dict, expected: dict) -> float:
    assert sorted(got) == sorted(expected)
    return max(float(np.linalg.norm((got[k] - expected[k]).ravel()) / max(np.linalg.norm(expected[k].ravel()), 1e-3))
               for k in expected)


def test_run_synchronizes_every_case_that_trained_unsynchronized_in_silence(tmp_path):
    process = zygote.spawn(
        [sys.executable, "-m", "bnrewrite", "run", os.path.join(ROOT, "tests", "scripts", "silent_cases.py"), "out.npz",
         "--towers", str(K), "--batch", str(B)], cwd=str(tmp_path), text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT})
    # meanwhile: the references, in this process
    expected = {case: silent_cases.train(case, 1, K * B) for case in silent_cases.CASES if case != "spawn"}
    unsynced = {case: silent_cases.train(case, K, B) for case in expected}
    _, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    with np.load(tmp_path / "out.npz") as saved:
        got = dict(saved)
    expected["spawn"], unsynced["spawn"] = expected["cifar10"], unsynced["cifar10"]  # the same trainer
    for case in silent_cases.CASES:
        values = {name.split("/", 1)[1]: value for name, value in got.items() if name.startswith(case + "/")}
        error, apart = _error(values, expected[case]), _error(unsynced[case], expected[case])
        print(f"{case}: {error:.1e} from one device, unsynchronized {apart:.2f}")
        assert error < (1e-12 if case == "float64" else 1e-5) and apart > 0.5, case
    lines = [line for line in err.splitlines() if line.startswith("bnrewrite:")]
    synced = [line for line in lines if "batch-norm layer(s) synchronized across 2 towers" in line]
    assert [line.split(": ", 2)[2][:2] for line in synced] == ["3 ", "3 ", "3 ", "2 "], lines  # cifar10 x3, float64
    assert any("its session was created before the model: it runs the synchronized graph" in line for line in lines)


def _two_models_graph(second: bool) -> tuple:
    """Two 2-tower cifar10-style trainers (variable scopes a, b) in one graph; the second one
    only when `second`. Returns (graph, [(inputs, loss, train op)])."""
    graph = tf.Graph()
    models = []
    with graph.as_default():
        for scope in ("a", "b")[:1 + second]:
            with tf1.variable_scope(scope):
                inputs, loss, _, train, _ = silent_cases.build(K, B, tf.float32, silent_cases._cifar10_tower)
            models.append((inputs, loss, train))
    return graph, models


def _step(sess, model) -> float:
    inputs, loss, train = model
    images, labels = silent_cases._batches(K * B, tf.float32)[0]
    feed = {}
    for k, (x, y) in enumerate(inputs):
        feed[x], feed[y] = images[k * B:(k + 1) * B], labels[k * B:(k + 1) * B]
    return sess.run([loss, train], feed)[0]


def _values(sess) -> dict:
    return {v.op.name: sess.run(v) for v in tf1.global_variables()}


def _model_added_late(config) -> tuple[dict, list[float]]:
    """Model a trained a step, model b added, both trained a step; the variables and losses."""
    graph, (first,) = _two_models_graph(second=False)
    with graph.as_default(), tf1.Session(graph=graph, config=config) as sess:
        sess.run(tf1.global_variables_initializer())
        losses = [_step(sess, first)]
        with tf1.variable_scope("b"):
            inputs, loss, _, train, _ = silent_cases.build(K, B, tf.float32, silent_cases._cifar10_tower)
        sess.run(tf1.variables_initializer(tf1.global_variables("b")))
        losses += [_step(sess, first), _step(sess, (inputs, loss, train))]
        return _values(sess), losses


def test_a_model_added_after_the_session_was_synchronized_moves_the_session_with_its_variables(capsys):
    config = tf1.ConfigProto(device_count={"CPU": K})
    bnrewrite.enable()
    late, late_losses = _model_added_late(config)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bnrewrite:")]
    assert any("synchronized across 2 towers" in line and line.split(": ", 2)[2].startswith("6 ") for line in lines), lines
    assert any("the graph grew (a model or train op added; now 6 batch-norm layer(s) with 12 gradient op(s) "
               "synchronized, 3 with 6 before) after its session ran: the session moves to the graph synchronized "
               "again, with the values of its" in line for line in lines), lines
    assert len({line.split(":")[1] for line in lines}) == 1, lines  # one graph, one number
    graph, (first, second) = _two_models_graph(second=True)  # both built before the session
    with graph.as_default(), tf1.Session(graph=graph, config=config) as sess:
        sess.run(tf1.global_variables_initializer())
        early_losses = [_step(sess, first), _step(sess, first), _step(sess, second)]
        early = _values(sess)
    assert late_losses == early_losses and all(np.array_equal(late[k], early[k]) for k in early)
    bnrewrite.disable()
    unsynced, _ = _model_added_late(config)
    assert _error(unsynced, early) > 0.1  # model b's layers train otherwise unsynchronized


def _second_optimizer(config, late: bool) -> tuple[dict, list[float]]:
    """The towers trained a step by gradient descent, then a step by momentum, whose train op is
    built after the first step when `late` (before the session otherwise); the variables and losses."""
    graph = tf.Graph()
    with graph.as_default():
        inputs, loss, _, first, tower_losses = silent_cases.build(K, B, tf.float32, silent_cases._cifar10_tower)
        momentum = tf1.train.MomentumOptimizer(0.1, 0.9)

        def second() -> tf.Operation:
            return silent_cases.apply(momentum, silent_cases.tower_gradients(momentum, tower_losses))

        train = None if late else second()
        with tf1.Session(graph=graph, config=config) as sess:
            sess.run(tf1.global_variables_initializer())
            losses = [_step(sess, (inputs, loss, first))]
            if late:
                train = second()
                sess.run(tf1.variables_initializer(momentum.variables()))
            losses.append(_step(sess, (inputs, loss, train)))
            return _values(sess), losses


def test_a_second_optimizer_added_after_the_session_ran_keeps_the_graph_s_number(tmp_path, capsys):
    """The graph grown by a second train op after its synchronized session ran: one number in
    every line and in the records, a move line that says the graph grew, and the session trains
    bit for bit as one made after both train ops (the towers as built: 0.1 apart)."""
    config = tf1.ConfigProto(device_count={"CPU": K})
    from bnrewrite.session import live

    before = len(live.records())
    bnrewrite.enable()
    late, late_losses = _second_optimizer(config, late=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bnrewrite:")]
    (record,) = live.records()[before:]
    assert {line.split(":")[1] for line in lines} == {f" graph {record['graph']}"}, lines
    assert record["outcome"] == "synchronized" and len(record["report"]["layers"][0]["gradients"]) == 2 * K
    assert lines[-1].endswith(
        "the graph grew (a model or train op added; now 3 batch-norm layer(s) with 12 gradient op(s) synchronized, 3 "
        "with 6 before) after its session ran: the session moves to the graph synchronized again, with the values of "
        "its 17 initialized variable(s)"), lines
    early, early_losses = _second_optimizer(config, late=False)
    assert late_losses == early_losses and all(np.array_equal(late[k], early[k]) for k in early)
    bnrewrite.disable()
    unsynced, _ = _second_optimizer(config, late=True)
    assert _error(unsynced, early) > 0.1


def test_a_model_built_after_its_graph_s_session_ran_moves_the_session_with_its_variables(capsys):
    bnrewrite.enable()
    config = tf1.ConfigProto(device_count={"CPU": K})
    with tf.Graph().as_default():
        counter = tf1.get_variable("counter", [], initializer=tf1.zeros_initializer(), use_resource=True)
        legacy = tf1.get_variable("legacy", [2], initializer=tf1.ones_initializer(), use_resource=False)
        sess = tf1.InteractiveSession(config=config)
        sess.run([counter.initializer, legacy.initializer])
        sess.run([counter.assign(7.0), legacy.assign([3.0, 4.0])])  # state a move must keep
        model = silent_cases.build(K, B, tf.float32, silent_cases._cifar10_tower)
        sess.run(tf1.variables_initializer([v for v in tf1.global_variables() if v.op.name not in ("counter", "legacy")]))
        late = [_step(sess, (model[0], model[1], model[3])) for _ in range(2)]
        assert sess.run(counter) == 7.0 and list(sess.run(legacy)) == [3.0, 4.0]
        sess.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bnrewrite:")]
    assert any("its session ran before the graph trained batch norm on several towers" in line
               and "its 2 initialized variable(s)" in line for line in lines), lines
    with tf.Graph().as_default():  # the session made after the model
        model = silent_cases.build(K, B, tf.float32, silent_cases._cifar10_tower)
        with tf1.Session(config=config) as sess:
            sess.run(tf1.global_variables_initializer())
            assert late == [_step(sess, (model[0], model[1], model[3])) for _ in range(2)]


def _iterator_then_model(read: bool) -> list[int]:
    """An iterator started (and read once, when `read`) by a session, then a 2-tower model added;
    what the iterator gives after."""
    config = tf1.ConfigProto(device_count={"CPU": K})
    with tf.Graph().as_default():
        iterator = tf1.data.make_initializable_iterator(tf.data.Dataset.range(3))
        following = iterator.get_next()
        with tf1.Session(config=config) as sess:
            sess.run(iterator.initializer)  # state in the session that is not a variable
            if read:
                sess.run(following)
            silent_cases.build(K, B, tf.float32, silent_cases._cifar10_tower)
            sess.run(tf1.global_variables_initializer())
            return [int(sess.run(following)) for _ in range(2)]


def test_an_iterator_the_session_started_is_started_again_and_one_it_read_is_refused():
    bnrewrite.enable(quiet=True)
    assert _iterator_then_model(read=False) == [0, 1]  # moved, and started again on the new session
    with pytest.raises(UnsyncedLayerError, match=r"holds state other than variables \(IteratorV2 \(IteratorV2: ran "
                                                 r"IteratorGetNext \(IteratorGetNext\) on it\)\) that cannot be moved"):
        _iterator_then_model(read=True)


def _partial_graph() -> tf.Graph:
    """The cifar10-style 2-tower trainer plus a tf.nn.weighted_moments batch norm in each tower."""
    graph = tf.Graph()
    with graph.as_default():
        inputs, *_ = silent_cases.build(K, B, tf.float32, silent_cases._cifar10_tower)
        for k, (images, _) in enumerate(inputs):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}/weighted"):
                mean, variance = tf.nn.weighted_moments(images, [0, 1, 2], tf.ones_like(images))
                tf.nn.batch_normalization(images, mean, variance, None, None, 1e-3)
    return graph


def test_a_layer_that_cannot_be_synchronized_refuses_the_graph_everywhere(tmp_path, capsys):
    graph = _partial_graph()
    with bnrewrite.enabled(quiet=True):
        with pytest.raises(UnsyncedLayerError, match="tf.nn.weighted_moments is not synchronized") as info:
            tf1.Session(graph=graph, config=tf1.ConfigProto(device_count={"CPU": K}))
    assert info.value.exit_code == 7
    with bnrewrite.enabled(allow_unsynced=True):
        tf1.Session(graph=graph, config=tf1.ConfigProto(device_count={"CPU": K})).close()
    err = capsys.readouterr().err
    assert ": 3 batch-norm layer(s) synchronized" in err
    assert ": 2 batch-norm op(s) run UNSYNCHRONIZED (--allow-unsynced): tower_0/weighted/" in err
    path = str(tmp_path / "partial.pb")
    tf.io.write_graph(graph.as_graph_def(), str(tmp_path), "partial.pb", as_text=False)
    assert main(["convert", path, str(tmp_path / "out.pb")]) == 7
    assert not os.path.exists(tmp_path / "out.pb")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be synchronized" in err and "--allow-unsynced synchronizes the others" in err
    assert main(["inspect", path]) == 7
    assert "convert would fail: 2 training batch-norm op(s) of the 2 towers cannot be synchronized" in capsys.readouterr().out
    assert main(["convert", "-q", "--allow-unsynced", path, str(tmp_path / "out.pb")]) == 0
    assert os.path.exists(tmp_path / "out.pb")
