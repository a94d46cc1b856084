"""Unfused batch norm (tf.nn.moments) and batch norm under tf.cond, against the one-device oracle.

Cond models take an `is_training` placeholder (default True). After training, the eval
branch (is_training=False, the population statistics) must give the reference's outputs,
and it must never wait on an all-reduce.
"""

import functools
from dataclasses import replace

import numpy as np
import pytest
import tensorflow as tf

import bnrewrite
from bnrewrite import rewrite_graph
from models import (
    Result,
    Spec,
    assert_synced,
    build_reference,
    build_towers,
    load_graph,
    make_batches,
    max_rel_error,
    one_device_run,
    rel_errors,
    session_config,
    towers_once,
    train,
    unrewritten_run,
)

STEPS = 3
TOLERANCE = 2e-4
#: Batch statistics in half precision: rounding of the data's dtype (as in tests/test_oracle.py).
HALF_TOLERANCE = {"float16": 2e-3, "bfloat16": 2e-2}
EVAL_TIMEOUT_MS = 20_000


def _feed(built, images, labels):
    per = len(images) // len(built.inputs)
    feed = {}
    for k, (img, lbl) in enumerate(built.inputs):
        feed[img], feed[lbl] = images[k * per:(k + 1) * per], labels[k * per:(k + 1) * per]
    return feed


def train_then_eval(graph_like, built, batches, eval_batch, num_devices, evaluate=True):
    """Train on `batches`, then (cond models) run the loss in eval mode on `eval_batch`."""
    graph = load_graph(graph_like)
    losses = []
    with tf.compat.v1.Session(graph=graph, config=session_config(num_devices)) as sess:
        sess.run(built.init)
        for images, labels in batches:
            losses.append(sess.run([built.train_op, built.loss], _feed(built, images, labels))[1])
        eval_loss = None
        if evaluate:
            feed = _feed(built, *eval_batch)
            feed["is_training:0"] = False
            options = tf.compat.v1.RunOptions(timeout_in_ms=EVAL_TIMEOUT_MS)
            eval_loss = sess.run(built.loss, feed, options=options)
        values = sess.run(dict(built.variables))
    return Result(np.asarray(losses, np.float64), values), eval_loss


def _batches(spec):
    batches = make_batches(spec, STEPS + 1)
    return batches[:STEPS], batches[STEPS]


@functools.lru_cache(maxsize=None)
def _reference(spec, evaluate):
    """The one-device reference and its eval loss: the same for every backend, and the float32
    truth of the half-precision cases, so trained once per test process (read-only)."""
    ref = build_reference(spec)
    return train_then_eval(ref.graph, ref, *_batches(spec), 1, evaluate)


@functools.lru_cache(maxsize=None)
def _unsynced(spec):
    """The un-rewritten towers trained: the same for every backend, trained once per test process
    (read-only)."""
    built = towers_once(spec)
    return train_then_eval(built.graph, built, *_batches(spec), spec.towers, False)[0]


@functools.lru_cache(maxsize=None)
def _rewritten(spec, evaluate, graph_bytes):
    """The rewritten graph (serialized) trained and evaluated: backend auto under control flow
    v2 is the collective backend, the same graph, trained once (read-only)."""
    built = towers_once(spec)
    train_batches, eval_batch = _batches(spec)
    graph_def = tf.compat.v1.GraphDef.FromString(graph_bytes)
    return train_then_eval(graph_def, built, train_batches, eval_batch, spec.towers, evaluate)


def _oracle(spec, evaluate, backend="collective"):
    result = rewrite_graph(towers_once(spec).graph, backend=backend)
    (expected, expected_eval), unsynced = _reference(spec, evaluate), _unsynced(spec)
    synced, synced_eval = _rewritten(spec, evaluate, result.graph_def.SerializeToString(deterministic=True))
    return result, expected, expected_eval, synced, synced_eval, unsynced


@pytest.mark.parametrize(
    "spec",
    [
        Spec(towers=2, layer="legacy_unfused"),
        Spec(towers=4, layer="legacy_unfused", data_format="NCHW"),
        Spec(towers=2, layer="legacy_cond_v1"),
        Spec(towers=4, layer="legacy_cond_v1", data_format="NCHW"),
        Spec(towers=2, layer="moments_cond_v1"),
        Spec(towers=4, layer="moments_cond_v1", data_format="NCHW"),
        Spec(towers=2, layer="legacy_cond_v2"),
        Spec(towers=4, layer="legacy_cond_v2", data_format="NCHW"),
        Spec(towers=2, layer="moments_cond_v2"),
        Spec(towers=4, layer="moments_cond_v2", data_format="NCHW"),
        Spec(towers=3, layer="legacy_cond_v1", renorm=True),
    ],
    ids=lambda s: f"K{s.towers}-{s.layer}-{s.data_format}" + ("-renorm" if s.renorm else ""),
)
@pytest.mark.parametrize("backend", ["collective", "auto"])
def test_unfused_and_cond_train_like_one_device(spec, backend):
    """backend auto: the local sum, except under control flow v2, whose all-reduces sit in
    branch functions that only keyed all-reduces reach."""
    evaluate = "cond" in spec.layer
    result, expected, expected_eval, synced, synced_eval, unsynced = _oracle(spec, evaluate, backend)
    if backend == "auto":
        assert result.report.backend == ("collective" if spec.layer.endswith("_v2") else "local")
    assert_synced(f"{spec.layer} K={spec.towers} {spec.data_format}", synced, unsynced, expected, TOLERANCE)
    assert all(row.collectives == 2 * spec.towers for row in result.report.layers)
    if evaluate:
        assert abs(synced_eval - expected_eval) <= TOLERANCE * max(1.0, abs(expected_eval))
    if spec.layer.endswith("_v2"):
        assert not result.report.skipped
    if spec.layer.startswith("moments_cond"):
        # Each tower owns population statistics: every copy ends at the one-device value.
        for name, value in synced.variables.items():
            if "/pop_" in name:
                twin = "tower_0/" + name.split("/", 1)[1]
                np.testing.assert_allclose(value, expected.variables[twin], rtol=1e-5, atol=1e-6)
        assert not result.report.removed  # per-tower variables: every update stays


@pytest.mark.parametrize("layer, dtype, data_format", [
    ("moments_cond_v1", "float16", "NHWC"),
    ("moments_cond_v2", "bfloat16", "NCHW"),
    ("legacy_cond_v2", "float16", "NCHW"),
    ("legacy_unfused", "bfloat16", "NHWC"),
])
def test_half_precision_is_as_close_to_float32_as_one_device(layer, dtype, data_format):
    """Batch norm in half precision, unfused or under tf.cond.

    Its towers round their partial gradient sums in the data's dtype, so no K-tower graph can
    equal the one-device graph bit for bit (hand-written moments in bfloat16: momentum slots
    5e-2 apart), while both are some 6e-2 from the float32 model. What must hold: the
    rewritten graph is as close to the float32 model as the one-device graph of its dtype is,
    its moving statistics equal the one-device ones to the dtype's rounding, and the
    un-rewritten graph is far off.
    """
    spec = Spec(towers=2, layer=layer, dtype=dtype, data_format=data_format)
    built = towers_once(spec)
    truth, one = _reference(replace(spec, dtype="float32"), "cond" in layer)[0], one_device_run(spec, STEPS)
    result = rewrite_graph(built.graph, backend="collective")
    synced = train(result.graph_def, built, make_batches(spec, STEPS), num_devices=spec.towers)
    unsynced = unrewritten_run(spec, STEPS)
    one_off, synced_off, unsynced_off = (max_rel_error(r, truth) for r in (one, synced, unsynced))
    moving = {q: e for q, e in rel_errors(synced, one).items() if "/pop_" in q or "/moving_" in q}
    print(f"{layer} {dtype} {data_format}: from float32 one device {one_off:.2e}, synced {synced_off:.2e}, "
          f"unsynced {unsynced_off:.2e}; moving statistics vs one device {max(moving.values()):.2e}")
    assert result.report.layers and not result.report.skipped
    assert synced_off <= 1.1 * one_off
    assert unsynced_off > 5 * one_off
    assert max(moving.values()) <= HALF_TOLERANCE[dtype], moving


def test_batch_renorm_under_v2_cond_is_reported_not_rewritten():
    """With a training tensor under control flow v2, tf_keras's batch renormalization updates
    its shared moving averages inside If branch functions that carry its statistics; those
    functions are not searched, so the layer cannot be synchronized: the graph is refused, with the
    way out named."""
    with pytest.raises(bnrewrite.UnsyncedLayerError, match="disable_control_flow_v2") as info:
        rewrite_graph(build_towers(Spec(towers=2, layer="legacy_cond_v2", renorm=True)).graph)
    assert "(If)" in str(info.value)


def _v2_graph(body):
    """Two CPU towers, each applying `body(x, k)` to its own input under control flow v2."""
    from tensorflow.python.ops import control_flow_util

    previous = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = True
    try:
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.placeholder_with_default(True, [], name="is_training")
            gamma = tf.compat.v1.get_variable("gamma", initializer=np.ones(3, np.float32))
            for k in range(2):
                with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"):
                    x = tf.compat.v1.placeholder(tf.float32, [4, 5, 5, 3], name="x")
                    y = body(x * gamma, k)
                    tf.compat.v1.gradients(tf.reduce_sum(y * y), [gamma])
        return graph
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = previous


def test_batch_norm_in_tf_function_is_reported_not_rewritten():
    @tf.function
    def normalize(x):
        return tf.compat.v1.nn.fused_batch_norm(x, tf.ones([3]), tf.zeros([3]), is_training=True)[0]

    with pytest.raises(bnrewrite.NoBatchNormError, match="function body") as info:
        rewrite_graph(_v2_graph(lambda x, k: normalize(x)))
    assert "tf.function" in str(info.value)


def test_shared_population_variables_in_v2_branch_are_skipped_with_reason():
    pop_mean = []

    def body(x, k):
        if not pop_mean:
            pop_mean.append(tf.Variable(np.zeros(3, np.float32), trainable=False, name="pop_mean"))

        def train():
            mean, var = tf.nn.moments(x, [0, 1, 2])
            with tf.control_dependencies([tf.compat.v1.assign(pop_mean[0], 0.9 * pop_mean[0] + 0.1 * mean)]):
                return tf.nn.batch_normalization(x, mean, var, None, None, 1e-3)

        return tf.compat.v1.cond(tf.compat.v1.get_default_graph().get_tensor_by_name("is_training:0"),
                                 train, lambda: x - pop_mean[0])

    with pytest.raises(bnrewrite.UnsyncedLayerError, match="shared by the towers and updated inside a branch function"):
        rewrite_graph(_v2_graph(body), backend="collective")


@pytest.mark.parametrize("layer", ["legacy_cond_v2", "moments_cond_v2"])
def test_nccl_structure_v2(layer):
    """All-reduces live in the branch functions (forward in the then-branch, backward in its gradient)."""
    k = 4
    result = rewrite_graph(build_towers(Spec(towers=k, layer=layer, device="gpu")).graph)
    assert result.report.backend == "nccl" and not result.report.skipped
    assert not [n for n in result.graph_def.node if n.op == "NcclAllReduce"]
    nccl = [n for f in result.graph_def.library.function for n in f.node_def if n.op == "NcclAllReduce"]
    assert len(nccl) == 2 * 2 * k
    assert {n.attr["num_devices"].i for n in nccl} == {k}
    assert len({n.attr["shared_name"].s for n in nccl}) == 4
    assert any("order_collectives" in note for note in result.report.notes)
    with pytest.raises(bnrewrite.AlreadyRewrittenError):
        rewrite_graph(result.graph_def)
    with tf.Graph().as_default():
        tf.compat.v1.import_graph_def(result.graph_def, name="")


@pytest.mark.parametrize("layer", ["legacy_unfused", "legacy_cond_v1", "moments_cond_v1"])
def test_nccl_structure(layer):
    k = 4
    result = rewrite_graph(build_towers(Spec(towers=k, layer=layer, device="gpu")).graph)
    nccl = [n for n in result.graph_def.node if n.op == "NcclAllReduce"]
    assert len(nccl) == 2 * 2 * k  # two layers, one forward and one backward all-reduce each, per tower
    assert {n.attr["num_devices"].i for n in nccl} == {k}
    assert len({n.attr["shared_name"].s for n in nccl}) == 4
    with tf.Graph().as_default():
        tf.compat.v1.import_graph_def(result.graph_def, name="")
