"""enable() and rewrite_graph(g, in_place=True) in process: sessions on the script's own graph
run the synchronized graph, and every handle of that graph keeps working.

The oracle: tests/models.py's K-tower graph trained through the graph's own handles against one
device fed K*B (one_device_run), and the same graph without bnrewrite missing it (unrewritten_run).
"""

import collections
import contextlib
import dataclasses
import re

import numpy as np
import pytest
import tensorflow as tf

import bnrewrite
from bnrewrite import AlreadyRewrittenError, BnRewriteError, PassError, RemovedByRewriteError, rewrite_graph
from bnrewrite.rewrite import api
from bnrewrite.rewrite.passes import PIPELINE, dedupe_moving_averages, run_passes
from models import Spec, assert_synced, build_towers, make_batches, one_device_run, session_config, train, unrewritten_run

tf1 = tf.compat.v1
SPEC = Spec(towers=2, batch=2, layer="legacy")
STEPS = 3


@pytest.fixture(autouse=True)
def _disabled_after():
    yield
    bnrewrite.disable()


def test_enable_trains_like_one_device_and_disable_stops(capsys):
    built = build_towers(SPEC)
    unrewritten_run(SPEC, STEPS, built)
    with bnrewrite.enabled():
        got = train(built.graph, built, make_batches(SPEC, STEPS), num_devices=SPEC.towers)
        again = train(built.graph, built, make_batches(SPEC, STEPS), num_devices=SPEC.towers)  # a second session
    assert_synced("enable()", got, unrewritten_run(SPEC, STEPS), one_device_run(SPEC, STEPS), 1e-5)
    np.testing.assert_array_equal(again.losses, got.losses)
    err = capsys.readouterr().err
    assert err.count("bnrewrite: graph") == 1 and "2 batch-norm layer(s) synchronized across 2 towers" in err
    fresh = build_towers(SPEC)  # decided after disable(): runs as built
    plain = train(fresh.graph, fresh, make_batches(SPEC, STEPS), num_devices=SPEC.towers)
    np.testing.assert_allclose(plain.losses, unrewritten_run(SPEC, STEPS).losses, rtol=1e-6)
    after = train(built.graph, built, make_batches(SPEC, STEPS), num_devices=SPEC.towers)  # synced while enabled
    np.testing.assert_allclose(after.losses, unrewritten_run(SPEC, STEPS).losses, rtol=1e-6)
    with pytest.raises(AlreadyRewrittenError, match=r"already run its synchronized graph \(enable\(\) synchronized it"):
        rewrite_graph(built.graph, in_place=True)


def test_verbose_lists_every_op_removed(capsys):
    """enable(verbose=True) (`run -v`) prints the whole report: every op the rewrite removed,
    none cut behind a pointer to the Python API."""
    built = build_towers(SPEC)
    removed = rewrite_graph(built.graph).report.removed
    with bnrewrite.enabled(verbose=True):
        train(built.graph, built, make_batches(SPEC, 1), num_devices=SPEC.towers)
    err = capsys.readouterr().err
    assert len(removed) > 5 and all(f"  {r['node']}: {r['why']}" in err for r in removed)
    assert "lists them" not in err


def test_in_place_sessions_run_the_synchronized_graph():
    built = build_towers(SPEC)
    result = rewrite_graph(built.graph, in_place=True)
    assert result.report.backend == "local" and len(result.report.layers) == 2
    got = train(built.graph, built, make_batches(SPEC, STEPS), num_devices=SPEC.towers)
    assert_synced("in_place=True", got, unrewritten_run(SPEC, STEPS), one_device_run(SPEC, STEPS), 1e-5)
    with pytest.raises(AlreadyRewrittenError, match="already run its synchronized graph"):
        rewrite_graph(built.graph, in_place=True)


def test_in_place_refuses_a_graph_with_a_session_open():
    built = build_towers(SPEC)
    sess = tf1.Session(graph=built.graph, config=session_config(2))
    with pytest.raises(BnRewriteError, match="1 session.* already exist on this graph"):
        rewrite_graph(built.graph, in_place=True)
    sess.close()
    rewrite_graph(built.graph, in_place=True)  # closed: nothing runs it unsynchronized any more


Pair = collections.namedtuple("Pair", "loss step")


def test_every_handle_keeps_working(tmp_path):
    built = build_towers(SPEC)
    graph = built.graph
    result = rewrite_graph(graph, in_place=True)
    removed = result.report.removed[0]["node"]
    (images, labels), = make_batches(SPEC, 1)
    feed = {}
    for k, (image_name, label_name) in enumerate(built.inputs):  # by name and by tensor
        feed[image_name] = images[k * SPEC.batch:(k + 1) * SPEC.batch]
        feed[graph.get_tensor_by_name(label_name)] = labels[k * SPEC.batch:(k + 1) * SPEC.batch]
    loss, train_op = graph.get_tensor_by_name(built.loss), graph.get_operation_by_name(built.train_op)
    with tf1.Session(graph=graph, config=session_config(2)) as sess:
        assert sess.graph is graph
        with graph.as_default():
            init = tf1.global_variables_initializer()  # built after the session exists
            saver = tf1.train.Saver()
            doubled = loss * 2.0
            reads_removed = tf.group(graph.get_operation_by_name(removed))
        sess.run(init)
        fetched = sess.run({"pair": Pair(loss, [train_op]), "name": built.loss, "doubled": doubled}, feed)
        assert fetched["pair"].step == [None] and np.isclose(fetched["doubled"], 2 * fetched["name"])
        callable_step = sess.make_callable([loss, train_op], feed_list=list(feed))
        assert callable_step(*feed.values())[0] > 0
        with pytest.raises(RemovedByRewriteError, match=f"{removed} is not in the synchronized graph"):
            sess.run(graph.get_operation_by_name(removed))
        with pytest.raises(RemovedByRewriteError, match="it reads .*the rewrite removed it"):
            sess.run(reads_removed)
        fed = next(op.outputs[0] for op in (graph.get_operation_by_name(r["node"]) for r in result.report.removed) if op.outputs)
        with pytest.raises(RemovedByRewriteError, match=f"{fed.op.name} is not in the synchronized graph, so it cannot be fed"):
            sess.run(loss, {**feed, fed: np.zeros(fed.shape, fed.dtype.as_numpy_dtype)})
        path = saver.save(sess, str(tmp_path / "synced.ckpt"))
        values = sess.run(dict(built.variables))
    plain = build_towers(SPEC)  # the checkpoint restores into the un-rewritten graph, and back
    with plain.graph.as_default(), tf1.Session(graph=plain.graph, config=session_config(2)) as sess:
        tf1.train.Saver().restore(sess, path)
        restored = sess.run(dict(plain.variables))
        back = tf1.train.Saver().save(sess, str(tmp_path / "plain.ckpt"))
    for name, value in values.items():
        np.testing.assert_array_equal(restored[name], value)
    with tf1.Session(graph=graph, config=session_config(2)) as sess:
        saver.restore(sess, back)
        np.testing.assert_array_equal(sess.run(built.variables["net/bn1/moving_mean"]), values["net/bn1/moving_mean"])


def test_graphs_with_nothing_to_synchronize_run_unchanged(capsys):
    spec = dataclasses.replace(SPEC, towers=1, batch=4)
    one = build_towers(spec)
    with bnrewrite.enabled():
        got = train(one.graph, one, make_batches(spec, STEPS), num_devices=1)
    expected = train(one.graph, one, make_batches(spec, STEPS), num_devices=1)  # decided once: as built
    np.testing.assert_array_equal(got.losses, expected.losses)
    assert "runs unchanged: " in capsys.readouterr().err
    other = build_towers(spec)
    with bnrewrite.enabled(quiet=True):
        train(other.graph, other, make_batches(spec, 1), num_devices=1)
    assert capsys.readouterr().err == ""


def test_enable_checks_its_options_without_a_graph():
    with pytest.raises(bnrewrite.BackendError, match="unknown backend 'gpu'"):
        bnrewrite.enable(backend="gpu")
    with pytest.raises(BnRewriteError, match="group_size='2' is not valid"):
        bnrewrite.enable(group_size="2")


def test_to_graph_adds_no_saver_and_find_maps_one(tmp_path):
    built = build_towers(SPEC)
    with built.graph.as_default():
        saver = tf1.train.Saver(name="mine")
    result = rewrite_graph(built.graph)
    graph = result.to_graph()
    assert not [op.name for op in graph.get_operations() if op.name.startswith("save/")]
    new_saver, init = result.find(graph, (saver, built.init))
    with graph.as_default():
        assert tf1.train.Saver().saver_def.save_tensor_name.startswith("save/")  # the name it would have had
    with tf1.Session(graph=graph, config=session_config(2)) as sess:
        sess.run(init)
        path = new_saver.save(sess, str(tmp_path / "model.ckpt"))
    assert tf.train.load_checkpoint(path).has_tensor("net/bn1/moving_mean")


def _dequeued(graph: tf.Graph, sess: tf1.Session, constant: float) -> float:
    """What a queue filled by a QueueRunner thread (which runs its enqueue op by handle) gives."""
    with graph.as_default():
        queue = tf1.FIFOQueue(4, tf.float32, shapes=[])
        tf1.train.add_queue_runner(tf1.train.QueueRunner(queue, [queue.enqueue(tf.constant(constant))]))
        value, close = queue.dequeue(), queue.close(cancel_pending_enqueues=True)
    coordinator = tf1.train.Coordinator()
    threads = tf1.train.start_queue_runners(sess, coordinator)
    got = sess.run(value)
    coordinator.request_stop()
    sess.run(close)
    coordinator.join(threads)
    return got


def test_already_rewritten_graph_runs_unchanged_and_queue_runners_work(capsys):
    rewritten = rewrite_graph(build_towers(SPEC).graph).to_graph()
    with bnrewrite.enabled(), tf1.Session(graph=rewritten, config=session_config(2)) as sess:
        assert _dequeued(rewritten, sess, 7.0) == 7.0
    assert "runs unchanged: it was already rewritten by bnrewrite" in capsys.readouterr().err
    graph = build_towers(SPEC).graph
    rewrite_graph(graph, in_place=True)
    with tf1.Session(graph=graph, config=session_config(2)) as sess:  # the shadow gets the queue's ops
        assert _dequeued(graph, sess, 5.0) == 5.0


#: Every form the README lists that the check can see (layers inside control flow v2 branch
#: functions cannot be fetched: test_cond_v2_layers_are_named_not_checked), at K=2 or 4; the legacy
#: layer and the v1 cond at K=2 (SPEC, COND_V1) in test_verify_checks_the_training_step.
VERIFY_FORMS = {
    "fused op K2": Spec(towers=2, batch=2, layer="fused_op"),
    "moments K4": Spec(towers=4, batch=2, layer="legacy_unfused"), "renorm K2": Spec(towers=2, batch=2, renorm=True),
    "moments cond v1 K4": Spec(towers=4, batch=2, layer="moments_cond_v1"),
    "NCHW K4": Spec(towers=4, batch=2, data_format="NCHW"), "float16 K2": Spec(towers=2, batch=2, dtype="float16"),
    "bfloat16 K2": Spec(towers=2, batch=2, dtype="bfloat16"),
}
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}


@pytest.mark.parametrize("spec", VERIFY_FORMS.values(), ids=VERIFY_FORMS)
def test_verify_checks_the_first_step_once(spec, capsys):
    built = build_towers(spec)
    unsynced = unrewritten_run(spec, 2, built)
    with bnrewrite.enabled(verify=True):
        got = train(built.graph, built, make_batches(spec, 2), num_devices=spec.towers)
    devices = f"/device:CPU:0..{spec.towers - 1}"
    lines = [line for line in capsys.readouterr().err.splitlines() if "verified" in line]
    assert len(lines) == 1 and f"verified 2 layers x {spec.towers} towers on {devices}: worst " in lines[0], lines
    assert "moving statistics updated once" in lines[0]
    assert_synced("verify", got, unsynced, one_device_run(spec, 2), TOLERANCE[spec.dtype])  # once


def test_verify_says_where_soft_placement_ran_the_towers(monkeypatch, capsys):
    """Towers asked for /gpu:k on a machine without GPUs, placed by soft placement: the line names
    the devices asked for and where the towers ran; they train like one device."""
    import towers_model

    spec = dataclasses.replace(SPEC, device="gpu")
    soft = session_config(spec.towers)
    soft.allow_soft_placement = True
    monkeypatch.setattr(towers_model, "session_config", lambda devices: soft)
    built = build_towers(spec)
    with bnrewrite.enabled(verify=True):
        got = train(built.graph, built, make_batches(spec, 2), num_devices=spec.towers)
    lines = [line for line in capsys.readouterr().err.splitlines() if "verified" in line]
    assert len(lines) == 1 and "verified 2 layers x 2 towers on /device:GPU:0..1 (ran on /device:CPU:0): worst " in lines[0]
    unsynced = train(built.graph, built, make_batches(spec, 2), num_devices=spec.towers)
    assert_synced("soft placement", got, unsynced, one_device_run(SPEC, 2), 2e-5)  # one device: SPEC's reference


def test_cond_v2_layers_are_named_not_checked(capsys):
    spec = Spec(towers=2, batch=2, layer="legacy_cond_v2")
    built = build_towers(spec)
    unsynced = unrewritten_run(spec, 2, built)
    with bnrewrite.enabled(verify=True):
        got = train(built.graph, built, make_batches(spec, 2), num_devices=spec.towers)
    lines = [line for line in capsys.readouterr().err.splitlines() if "verified" in line]
    assert len(lines) == 1 and lines[0].endswith(
        ": nothing verified: its 2 layer(s) are inside function bodies (control flow v2), which the check cannot fetch "
        "(net/bn1, net/bn2)")
    assert_synced("verify cond v2", got, unsynced, one_device_run(spec, 2), 2e-5)


def test_verify_stops_a_broken_rewrite_after_its_first_step(monkeypatch, capsys):
    no_dedupe = tuple(p for p in PIPELINE if p is not dedupe_moving_averages)  # every tower's update kept
    monkeypatch.setattr(api, "run_passes", lambda graph, plan: run_passes(graph, plan, no_dedupe))
    monkeypatch.setattr(api.meaning, "check_meaning", lambda *args: None)
    built = build_towers(SPEC)
    with bnrewrite.enabled(verify=True), pytest.raises(PassError, match="layer net/bn1: .*updated more than once"):
        train(built.graph, built, make_batches(SPEC, 2), num_devices=2)
    built = build_towers(SPEC)
    with bnrewrite.enabled(verify=True, exit_on_refusal=True), pytest.raises(SystemExit) as stopped:
        train(built.graph, built, make_batches(SPEC, 2), num_devices=2)
    assert stopped.value.code == 12
    err = capsys.readouterr().err
    assert "bnrewrite: error: graph" in err and "the first step failed its check, the script is stopped: " in err
    assert "layer net/bn1" in err.splitlines()[-1]


def test_independent_models_are_refused_or_run_unsynced_when_allowed(capsys):
    import trainers

    batches = make_batches(SPEC, 2)
    trainer = trainers.independent(2, SPEC.batch)
    with bnrewrite.enabled(), pytest.raises(bnrewrite.IndependentModelsError, match="train independent models"):
        trainers.run(trainer.graph, trainer, batches, num_devices=2)
    capsys.readouterr()
    allowed = trainers.independent(2, SPEC.batch)
    with bnrewrite.enabled(allow_unsynced=True):
        got, _ = trainers.run(allowed.graph, allowed, batches, num_devices=2)
    as_built = trainers.independent(2, SPEC.batch)
    expected, _ = trainers.run(as_built.graph, as_built, batches, num_devices=2)
    np.testing.assert_array_equal(got.losses, expected.losses)  # run as it is
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs UNSYNCHRONIZED (--allow-unsynced): the towers" in err


def test_mirrored_strategy_graph_under_enable():
    """A graph MirroredStrategy built (replicated variables, its own collective all-reduce of the
    gradients), its session made under enable(): trains like one device."""
    from test_mirrored import BATCH, STEPS, _build, _every_copy, _one_device

    data = make_batches(Spec(towers=2, batch=BATCH), STEPS)
    built = _build("legacy_fused", 2, BATCH)
    unsynced = train(built.graph.as_graph_def(), built, data, num_devices=2)  # a copy: the graph stays as built
    with bnrewrite.enabled(quiet=True):
        synced = train(built.graph, built, data, num_devices=2)
    assert_synced("MirroredStrategy under enable()", synced, unsynced, _every_copy(_one_device("legacy_fused", 2), 2), 1e-4)


def _steps(spec: Spec, built, batches: list, first=None, step=None):
    """models.train's loop on the script's own graph, with `first(sess, feed)` run before the
    first step and `step(sess, feed) -> loss` in place of sess.run([train_op, loss], feed)."""
    from models import Result

    graph = built.graph
    train_op, loss = graph.get_operation_by_name(built.train_op), graph.get_tensor_by_name(built.loss)
    losses = []
    with tf1.Session(graph=graph, config=session_config(spec.towers)) as sess:
        sess.run(built.init)
        for n, (images, labels) in enumerate(batches):
            feed = {}
            for k, (x, y) in enumerate(built.inputs):
                feed[x], feed[y] = np.split(images, spec.towers)[k], np.split(labels, spec.towers)[k]
            if n == 0 and first is not None:
                first(sess, feed)
            losses.append(step(sess, feed) if step is not None else sess.run([train_op, loss], feed)[1])
        values = sess.run(dict(built.variables))
    return Result(np.asarray(losses, np.float64), {k: np.asarray(v) for k, v in values.items()})


def _partial_step(built):
    """One training step through partial_run: the loss first, then a tensor run after the train op
    (partial_run fetches tensors only)."""
    graph = built.graph
    loss = graph.get_tensor_by_name(built.loss)
    with graph.as_default(), tf.control_dependencies([graph.get_operation_by_name(built.train_op)]):
        trained = tf.constant(True)

    def step(sess, feed):
        handle = sess.partial_run_setup([loss, trained], list(feed))
        value = sess.partial_run(handle, loss, feed)
        assert sess.partial_run(handle, trained)
        return value
    return step


COND_V1 = Spec(towers=2, batch=2, layer="legacy_cond_v1")
VERIFIED = "verified 2 layers x 2 towers on /device:CPU:0..1: worst "
#: name: (spec, build, first(built) -> run before the first step, step(built), what --verify says).
#: Reference variables (a snapshot fed, never fetched) are slim's in test_run.py's summary threads.
STEP_CASES = {
    "initial loss fetched first": (SPEC, build_towers, lambda b: lambda sess, feed: sess.run(b.loss, feed), None,
                                   VERIFIED + r".*, moving statistics updated once$"),
    "cond v1 evaluation pass first": (
        COND_V1, build_towers, lambda b: lambda sess, feed: sess.run(b.loss, {**feed, "is_training:0": False}), None,
        VERIFIED + r".*, moving statistics updated once$"),
    "partial_run": (SPEC, build_towers, None, _partial_step,
                    r": nothing verified: its first training step runs through partial_run, to which the check "
                    "cannot add its fetches$"),
}


@pytest.mark.parametrize("case", STEP_CASES)
def test_verify_checks_the_training_step(case, capsys):
    """The checked step is the script's first training run, whatever forward-only runs come first
    (an initial loss, an evaluation pass through a v1 cond, whose training branch is dead); a step
    through partial_run is named unverified. Every one trains like one device."""
    spec, build, first, step, said = STEP_CASES[case]
    built = build(spec)
    unsynced = unrewritten_run(spec, 2, built)
    with bnrewrite.enabled(verify=True):
        got = _steps(spec, built, make_batches(spec, 2), first and first(built), step and step(built))
    lines = [line for line in capsys.readouterr().err.splitlines() if "verif" in line]
    assert len(lines) == 1 and re.search(said, lines[0]), lines
    assert_synced(case, got, unsynced, one_device_run(spec, 2), 2e-5)


def test_a_train_op_without_moving_average_updates_is_reported_as_such(capsys):
    """The script's train op runs the optimizer only: its moving statistics stay as initialized,
    which --verify reports as the script's wiring (kept), not as a bnrewrite bug."""
    built = build_towers(SPEC)
    initial = {}
    apply = built.graph.get_operation_by_name("apply_gradients")

    def record(sess, feed):
        initial.update(sess.run(dict(built.variables)))

    def step(sess, feed):
        return sess.run([apply, built.loss], feed)[1]

    with bnrewrite.enabled(verify=True):
        got = _steps(SPEC, built, make_batches(SPEC, 2), record, step)
    lines = [line for line in capsys.readouterr().err.splitlines() if "verified" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "), 4 moving statistic(s) not updated: the script's step does not run their "
        "updates (its own wiring, kept as it is; add them to the train op, e.g. tf.GraphKeys.UPDATE_OPS)"), lines
    moving = [name for name in got.variables if "moving_" in name]
    assert len(moving) == 4
    for name in moving:
        np.testing.assert_array_equal(got.variables[name], initial[name])

    def trained(result):
        return dataclasses.replace(result, variables={k: v for k, v in result.variables.items() if k not in moving})

    assert_synced("no updates", trained(got), trained(unrewritten_run(SPEC, 2)), trained(one_device_run(SPEC, 2)), 2e-5)


def _callables_around_a_move(enabled: bool) -> list[float]:
    """Two towers' forward pass, a session that runs it and makes its callables (make_callable
    with and without a feed list, and from options, as Keras does), then the optimizer added and
    a step run (under enable(): the session moves to the synchronized graph); tower 1's mean
    output through each callable made before, and through run."""
    from tensorflow.core.protobuf import config_pb2
    import tf_keras as keras
    from tf_keras.src.legacy_tf_layers import convolutional, normalization

    graph = tf.Graph()
    with graph.as_default():
        keras.utils.set_random_seed(0)  # the legacy layers' initial values (Keras' own seed): run to run the same
        data = np.random.RandomState(0).normal(1, 2, (8, 6, 6, 3)).astype(np.float32)
        data[4:] = data[4:] * 3 + 2  # the towers' batches far apart
        x = tf1.placeholder_with_default(tf.constant(data), [8, 6, 6, 3], name="x")
        losses = []
        for k in range(2):
            with tf.device(f"/cpu:{k}"), tf1.name_scope(f"tower_{k}"), tf1.variable_scope("net", reuse=tf1.AUTO_REUSE):
                h = normalization.batch_normalization(convolutional.conv2d(x[4 * k:4 * k + 4], 4, 3, name="conv"),
                                                      training=True, name="bn")
                losses.append(tf.reduce_mean(tf.square(h - 1.0)))
        loss = tf.add_n(losses) / 2
        shifted = tf.reduce_mean(h)  # tower 1's output: normalized on its own or on the global batch
        init = tf1.global_variables_initializer()
    with bnrewrite.enabled() if enabled else contextlib.nullcontext():
        sess = tf1.Session(graph=graph, config=session_config(2))
        sess.run(init)
        options = config_pb2.CallableOptions(fetch=[shifted.name])
        made = [sess.make_callable(shifted), sess.make_callable(shifted, feed_list=[x]),
                sess._make_callable_from_options(options)]
        with graph.as_default(), tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        sess.run(train_op)
        values = [float(np.asarray(value).reshape(-1)[0]) for value in (made[0](), made[1](data), made[2]())]
        return [*values, float(sess.run(shifted))]


def test_callables_made_before_a_move_follow_the_session(capsys):
    synced = _callables_around_a_move(True)
    assert "moves to the synchronized graph" in capsys.readouterr().err
    assert len(set(synced)) == 1, synced  # each runs the synchronized graph, bit for bit as run does
    plain = _callables_around_a_move(False)
    assert len(set(plain)) == 1 and abs(plain[0] - synced[0]) > 0.5 * abs(synced[0]), (plain, synced)
