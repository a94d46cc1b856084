"""Unfused batch norm (tf.nn.moments) and batch norm under tf.cond, against the one-device oracle.

Cond models take an `is_training` placeholder (default True). After training, the eval
branch (is_training=False, the population statistics) must give the reference's outputs,
and it must never wait on an all-reduce.
"""

import numpy as np
import pytest
import tensorflow as tf

import bnrewrite
from bnrewrite import rewrite_graph
from models import (
    Result,
    Spec,
    build_reference,
    build_towers,
    load_graph,
    make_batches,
    max_rel_error,
    session_config,
)

STEPS = 3
TOLERANCE = 2e-4
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


def _oracle(spec, evaluate):
    built = build_towers(spec)
    result = rewrite_graph(built.graph, backend="collective")
    batches = make_batches(spec, STEPS + 1)
    train_batches, eval_batch = batches[:STEPS], batches[STEPS]
    ref = build_reference(spec)
    expected, expected_eval = train_then_eval(ref.graph, ref, train_batches, eval_batch, 1, evaluate)
    synced, synced_eval = train_then_eval(result.graph_def, built, train_batches, eval_batch, spec.towers, evaluate)
    unsynced, _ = train_then_eval(built.graph, built, train_batches, eval_batch, spec.towers, False)
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
    ],
    ids=lambda s: f"K{s.towers}-{s.layer}-{s.data_format}",
)
def test_unfused_and_cond_train_like_one_device(spec):
    evaluate = "cond" in spec.layer
    result, expected, expected_eval, synced, synced_eval, unsynced = _oracle(spec, evaluate)
    error, off = max_rel_error(synced, expected), max_rel_error(unsynced, expected)
    print(f"{spec.layer} K={spec.towers} {spec.data_format}: synced {error:.2e}, unsynced {off:.2e}")
    assert off > 1e-2
    assert error <= TOLERANCE
    assert all(row.collectives == 2 * spec.towers for row in result.report.layers)
    if evaluate:
        assert abs(synced_eval - expected_eval) <= TOLERANCE * max(1.0, abs(expected_eval))
    if spec.layer == "moments_cond_v1":
        # Each tower owns population statistics: every copy ends at the one-device value.
        for name, value in synced.variables.items():
            if "/pop_" in name:
                twin = "tower_0/" + name.split("/", 1)[1]
                np.testing.assert_allclose(value, expected.variables[twin], rtol=1e-5, atol=1e-6)
        assert not result.report.removed  # per-tower variables: every update stays


def test_control_flow_v2_is_reported_not_rewritten():
    with pytest.raises(bnrewrite.NoBatchNormError, match="control flow v2") as info:
        rewrite_graph(build_towers(Spec(towers=2, layer="moments_cond_v2")).graph)
    assert "disable_control_flow_v2" in str(info.value)


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
