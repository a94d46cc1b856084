"""When a synced fused layer takes fused batch-norm kernels instead of elementwise passes:
channels last, float32 or float16, at any size (bnrewrite.rewrite.passes.sites.takes_kernels), for the
local moments (sync_forward) and dx (sync_backward). Their float32 numbers are tested in
test_fused_math.py (both paths), and here through the oracle in float32 and float16."""

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite import rewrite_graph
from models import (Spec, build_reference, build_towers, kernel_gradients, kernel_moments, make_batches, max_rel_error,
                    train)

tf1 = tf.compat.v1


def _towers(k: int, shape: tuple, data_format: str = "NHWC", dtype=tf.float32) -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/cpu:0"):
            channels = shape[-1 if data_format == "NHWC" else 1]
            scale = tf1.get_variable("scale", initializer=np.ones(channels, np.float32))
            offset = tf1.get_variable("offset", initializer=np.zeros(channels, np.float32))
        for i in range(k):
            with tf.device(f"/cpu:{i}"), tf.name_scope(f"tower_{i}"):
                x = tf1.placeholder(dtype, shape, name="x")
                y, _, _ = tf1.nn.fused_batch_norm(x, scale, offset, is_training=True, data_format=data_format)
                tf.gradients(tf.reduce_sum(tf.cast(y, tf.float32) ** 2), [x, scale, offset])
    return graph


@pytest.mark.parametrize("why, graph", [
    ("float32", lambda: _towers(2, (2, 4, 4, 8))),
    ("float32, bare GraphDef", lambda: _towers(2, (2, 4, 4, 8)).as_graph_def()),
    ("float32, batch size unknown", lambda: _towers(2, (None, 4, 4, 8))),
    ("float16", lambda: _towers(2, (2, 4, 4, 8), dtype=tf.float16)),
    ("float16, batch size unknown", lambda: _towers(2, (None, 4, 4, 8), dtype=tf.float16)),
])
def test_channels_last_takes_the_kernels_at_any_size(why, graph):
    """Forward and backward, and the op stays in inference mode under its name."""
    result = rewrite_graph(graph())
    assert sorted(kernel_moments(result.graph_def)) == [f"tower_{i}/sync_bn/local_moments" for i in range(2)], why
    assert sorted(kernel_gradients(result.graph_def)) == [
        f"tower_{i}/gradients/tower_{i}/FusedBatchNormV3_grad/sync_bn_grad/local" for i in range(2)], why
    site = next(n for n in result.graph_def.node if n.name == "tower_0/FusedBatchNormV3")
    assert site.op == "FusedBatchNormV3" and not site.attr["is_training"].b, why


@pytest.mark.parametrize("why, graph", [
    ("channels first", lambda: _towers(2, (2, 8, 4, 4), data_format="NCHW")),
    ("float16 channels first", lambda: _towers(2, (2, 8, 4, 4), data_format="NCHW", dtype=tf.float16)),
    ("bfloat16", lambda: _towers(2, (2, 4, 4, 8), dtype=tf.bfloat16)),
])
def test_otherwise_the_elementwise_passes(why, graph):
    result = rewrite_graph(graph())
    assert not kernel_moments(result.graph_def) and not kernel_gradients(result.graph_def), why
    names = {n.name.rsplit("/", 1)[-1] for n in result.graph_def.node}
    assert {"local_m2", "dy_gain_minus_xc"} <= names, why


#: As in test_oracle: float32 rounding, and float16's 11 bits of input and output.
TOLERANCE = {"float32": 2e-4, "float16": 2e-3}


@pytest.mark.parametrize("spec", [Spec(towers=2, layer="legacy"), Spec(towers=4, layer="fused_op"),
                                  Spec(towers=4, layer="legacy", batch=3), Spec(towers=2, layer="fused_op", dtype="float16"),
                                  Spec(towers=4, layer="legacy", dtype="float16")],
                         ids=lambda s: f"K{s.towers}-{s.layer}-{s.dtype}")
def test_kernel_path_trains_like_one_device(spec):
    built = build_towers(spec)
    result = rewrite_graph(built.graph)
    assert len(kernel_gradients(result.graph_def)) == len(kernel_moments(result.graph_def)) == spec.towers * len(result.report.layers)
    data = make_batches(spec, 3)
    ref = build_reference(spec)
    expected = train(ref.graph, ref, data, num_devices=1)
    synced = max_rel_error(train(result.graph_def, built, data, num_devices=spec.towers), expected)
    unsynced = max_rel_error(train(built.graph, built, data, num_devices=spec.towers), expected)
    print(f"kernels K={spec.towers} {spec.layer} {spec.dtype}: synced {synced:.2e}, unsynced {unsynced:.2e}")
    assert unsynced > 1e-2 and synced <= TOLERANCE[spec.dtype]
