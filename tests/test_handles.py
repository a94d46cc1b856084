"""`result.to_graph()` and `result.find(...)`: from `rewrite_graph(g)` back to a session.

A user who rewrites the tf.Graph they built holds Operations, Tensors and Variables of it;
the rewritten graph must train through the new graph with those handles mapped, like one
device (the oracle), with its collections, saver and an existing checkpoint usable.
"""

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite import BnRewriteError, RemovedByRewriteError, rewrite_graph
from models import Result, Spec, assert_synced, build_reference, build_towers, make_batches, session_config, train

tf1 = tf.compat.v1
STEPS = 3


def _handles(graph: tf.Graph, built) -> dict:
    """What a user holds after building: the train op, the loss, the placeholders, variables."""
    variables = {v.op.name: v for v in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)}
    return {
        "train_op": graph.get_operation_by_name(built.train_op),
        "loss": graph.get_tensor_by_name(built.loss),
        "inputs": [tuple(graph.get_tensor_by_name(n) for n in pair) for pair in built.inputs],
        "variables": variables,
    }


def _train_through(graph: tf.Graph, held: dict, batches: list, towers: int) -> Result:
    """Train with the mapped handles only (no names), initializing from the graph's collections."""
    with graph.as_default():
        init = tf1.global_variables_initializer()
    losses = []
    with tf1.Session(graph=graph, config=session_config(towers)) as sess:
        sess.run(init)
        for images, labels in batches:
            per = len(images) // towers
            feed = {}
            for k, (x, y) in enumerate(held["inputs"]):
                feed[x], feed[y] = images[k * per:(k + 1) * per], labels[k * per:(k + 1) * per]
            losses.append(sess.run([held["train_op"], held["loss"]], feed)[1])
        values = sess.run({name: v.value() for name, v in held["variables"].items()})
    return Result(np.asarray(losses, np.float64), values)


def test_training_through_the_new_graph_with_mapped_handles_matches_one_device():
    spec = Spec(towers=2, batch=4)
    built = build_towers(spec)
    held = _handles(built.graph, built)
    result = rewrite_graph(built.graph)
    graph = result.to_graph()
    mapped = result.find(graph, held)
    assert mapped["train_op"].graph is graph and mapped["loss"].graph is graph
    assert all(v.graph is graph for v in mapped["variables"].values())
    assert [t.name for pair in mapped["inputs"] for t in pair] == [n for pair in built.inputs for n in pair]
    data = make_batches(spec, STEPS)
    reference = build_reference(spec)
    expected = train(reference.graph, reference, data, num_devices=1)
    synced = _train_through(graph, mapped, data, spec.towers)
    unsynced = train(built.graph, built, data, num_devices=spec.towers)
    assert_synced("to_graph + find", synced, unsynced, expected, 1e-4)


def test_saver_and_an_existing_checkpoint_work_in_the_new_graph(tmp_path):
    built = build_towers(Spec(towers=2))
    with built.graph.as_default():
        saver = tf1.train.Saver()
        gamma = next(v for v in tf1.global_variables() if v.op.name.endswith("bn1/gamma"))
        poke = gamma.assign(tf.fill(tf.shape(gamma), 3.0))
    with tf1.Session(graph=built.graph, config=session_config(2)) as sess:
        sess.run(built.init)
        sess.run(poke)
        path = saver.save(sess, str(tmp_path / "model.ckpt"))
    result = rewrite_graph(built.graph)
    graph = result.to_graph()
    removed = {r["node"] for r in result.report.removed}
    updates = {op.name for op in built.graph.get_collection(tf1.GraphKeys.UPDATE_OPS)}
    assert {op.name for op in graph.get_collection(tf1.GraphKeys.UPDATE_OPS)} == updates - removed != updates
    assert {v.name for v in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)} == {
        v.name for v in built.graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)}
    new_gamma = result.find(graph, gamma)
    with graph.as_default():
        restorer = tf1.train.Saver()
    with tf1.Session(graph=graph, config=session_config(2)) as sess:
        restorer.restore(sess, path)
        assert np.all(sess.run(new_gamma.value()) == 3.0)
    with graph.as_default(), tf1.train.MonitoredTrainingSession(config=session_config(2)) as sess:
        feed = {graph.get_tensor_by_name(n): np.zeros(graph.get_tensor_by_name(n).shape, np.float32 if "images" in n else np.int32)
                for pair in built.inputs for n in pair}
        sess.run(result.find(graph, built.train_op), feed)


def test_find_names_what_the_rewrite_removed():
    built = build_towers(Spec(towers=2))
    result = rewrite_graph(built.graph)
    graph = result.to_graph()
    removed = result.report.removed[0]["node"]
    duplicate = built.graph.get_operation_by_name(removed)
    with pytest.raises(RemovedByRewriteError, match=f"{removed} was removed by the rewrite .*duplicate update"):
        result.find(graph, [duplicate])
    with pytest.raises(BnRewriteError, match="cannot map a int"):
        result.find(graph, {"step": 3})
