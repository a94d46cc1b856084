"""When a synced fused layer takes fused batch-norm kernels instead of elementwise passes:
channels last, CPU towers, and float16, or float32 with an activation whose recorded static
shape has at least KERNEL_MIN_ELEMENTS elements per tower (bnrewrite.passes.sites), for the
local moments (sync_forward) and dx (sync_backward); float32 activations known to be smaller
are also normalized by passes rather than by the op. Their float32 numbers are tested in
test_fused_math.py (both paths), and here through the oracle in float32 and float16."""

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite import rewrite_graph
from bnrewrite.passes.sites import DEVIATIONS_ATTR, KERNEL_MIN_ELEMENTS
from models import (Spec, build_reference, build_towers, kernel_gradients, kernel_moments, make_batches, max_rel_error,
                    train, use_kernels)

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


LARGE = (2, 32, 64, 32)  # 131,072 elements per tower: KERNEL_MIN_ELEMENTS


@pytest.mark.parametrize("bare", [False, True], ids=["tf.Graph", "bare GraphDef"])
def test_large_channels_last_float32_takes_the_kernels(bare):
    """Also from a GraphDef that records no shapes: they are inferred (bnrewrite.shapes)."""
    assert np.prod(LARGE) == KERNEL_MIN_ELEMENTS
    graph = _towers(2, LARGE)
    result = rewrite_graph(graph.as_graph_def() if bare else graph)
    assert not [note for note in result.report.notes if "static shapes" in note]
    assert sorted(kernel_moments(result.graph_def)) == [f"tower_{i}/sync_bn/local_moments" for i in range(2)]
    assert sorted(kernel_gradients(result.graph_def)) == [
        f"tower_{i}/gradients/tower_{i}/FusedBatchNormV3_grad/sync_bn_grad/local" for i in range(2)]


@pytest.mark.parametrize("why, graph", [
    ("one element short", lambda: _towers(2, (2, 32, 64, 32 - 1))),
    ("channels first", lambda: _towers(2, (2, 32, 32, 64), data_format="NCHW")),
    ("float16 channels first", lambda: _towers(2, (2, 8, 4, 4), data_format="NCHW", dtype=tf.float16)),
    ("bfloat16", lambda: _towers(2, LARGE, dtype=tf.bfloat16)),
    ("batch size unknown", lambda: _towers(2, (None, *LARGE[1:]))),
    ("bare GraphDef, batch size unknown", lambda: _towers(2, (None, *LARGE[1:])).as_graph_def()),
])
def test_otherwise_the_elementwise_passes(why, graph):
    result = rewrite_graph(graph())
    assert not kernel_moments(result.graph_def) and not kernel_gradients(result.graph_def), why
    names = {n.name.rsplit("/", 1)[-1] for n in result.graph_def.node}
    assert {"local_m2", "dy_gain_minus_xc"} <= names, why


@pytest.mark.parametrize("why, graph", [
    ("small", lambda: _towers(2, (2, 4, 4, 8), dtype=tf.float16)),
    ("no static shapes recorded", lambda: _towers(2, (2, 4, 4, 8), dtype=tf.float16).as_graph_def()),
    ("batch size unknown", lambda: _towers(2, (None, 4, 4, 8), dtype=tf.float16)),
])
def test_float16_channels_last_takes_the_kernels_at_any_size(why, graph):
    """Its passes would hold float32 copies of the activation and its gradient across the
    all-reduce (more peak memory than the un-synced graph); the size does not matter."""
    result = rewrite_graph(graph())
    assert len(kernel_moments(result.graph_def)) == len(kernel_gradients(result.graph_def)) == 2, why
    assert not [note for note in result.report.notes if "static shapes" in note], why


SITE = "tower_0/FusedBatchNormV3"


@pytest.mark.parametrize("why, graph, by_passes", [
    ("float32 one element short", lambda: _towers(2, (2, 32, 64, 32 - 1)), True),
    ("float32 at the threshold", lambda: _towers(2, LARGE), False),
    ("bare GraphDef, shapes inferred", lambda: _towers(2, (2, 4, 4, 8)).as_graph_def(), True),
    ("bare GraphDef, batch size unknown", lambda: _towers(2, (None, 4, 4, 8)).as_graph_def(), False),
    ("batch size unknown", lambda: _towers(2, (None, 4, 4, 8)), False),
    ("channels first", lambda: _towers(2, (2, 8, 4, 4), data_format="NCHW"), False),
    ("float16", lambda: _towers(2, (2, 4, 4, 8), dtype=tf.float16), False),
])
def test_small_float32_is_normalized_by_passes(why, graph, by_passes):
    """Below the threshold, known from static shapes, the op gives way to an IdentityN of its
    name fed deviations * gain + bias, the deviations of x from the tower's mean (whose sum of
    squares an EuclideanNorm takes as it reads them), which it also passes on with the shift
    for the gradient to read instead of x; otherwise the op stays, in inference mode, and the
    gradient reads x."""
    nodes = {n.name: n for n in rewrite_graph(graph()).graph_def.node}
    site = nodes[SITE]
    x = "tower_0/x"
    grad_reads_x = any(x in n.input for n in nodes.values() if "FusedBatchNormV3_grad/" in n.name)
    if by_passes:
        assert site.op == "IdentityN" and nodes[site.input[0]].op == "AddV2", why
        scaled = nodes[nodes[site.input[0]].input[0]]
        index = site.attr[DEVIATIONS_ATTR].i
        deviations, shift = nodes[site.input[index]], nodes[site.input[index + 1]]
        assert scaled.op == "Mul" and scaled.input[0] == deviations.name, why
        assert deviations.op == "Sub" and deviations.input[0] == x and shift.op == "Sub", why
        readers = {n.op for n in nodes.values() if deviations.name in n.input and "_grad/" not in n.name}
        assert readers == {"Mul", "EuclideanNorm", "IdentityN"}, why  # no x-sized Square for the moments
        assert f"{SITE}:{index}" in nodes["tower_0/gradients/tower_0/FusedBatchNormV3_grad/sync_bn_grad/dy_deviations"].input
        assert not grad_reads_x, why
    else:
        assert site.op == "FusedBatchNormV3" and not site.attr["is_training"].b, why
        assert DEVIATIONS_ATTR not in site.attr and grad_reads_x, why


#: As in test_oracle: float32 rounding, and float16's 11 bits of input and output.
TOLERANCE = {"float32": 2e-4, "float16": 2e-3}


@pytest.mark.parametrize("spec", [Spec(towers=2, layer="legacy"), Spec(towers=4, layer="fused_op"),
                                  Spec(towers=4, layer="legacy", batch=3), Spec(towers=2, layer="fused_op", dtype="float16"),
                                  Spec(towers=4, layer="legacy", dtype="float16")],
                         ids=lambda s: f"K{s.towers}-{s.layer}-{s.dtype}")
def test_kernel_path_trains_like_one_device(spec, monkeypatch):
    use_kernels(monkeypatch)
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


def test_report_says_when_shapes_are_missing():
    """A layer that could take the kernels but whose input's size is unknown (a placeholder of
    unknown batch size; a bare GraphDef's shapes are otherwise inferred): the report says why it
    did not."""
    unknown = (None, *LARGE[1:])
    notes = [note for note in rewrite_graph(_towers(2, unknown).as_graph_def()).report.notes if "static shapes" in note]
    assert len(notes) == 1 and notes[0].startswith("1 layer(s) on CPU towers: elementwise passes"), notes
    for graph in (_towers(2, LARGE).as_graph_def(), _towers(2, unknown, data_format="NCHW").as_graph_def()):
        assert not [note for note in rewrite_graph(graph).report.notes if "static shapes" in note]
