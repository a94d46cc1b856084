"""Tests of the oracle itself (tests/models.py / examples/towers_model.py).

They show the comparison is like-for-like (1 tower == reference), that it can
fail (unsynchronized towers differ from the reference) and that it can pass
(a hand-written synchronized-BN towers graph matches the reference).
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

from models import (
    Result,
    Spec,
    build_hand_synced,
    build_reference,
    build_towers,
    load_graph,
    make_batches,
    max_rel_error,
    one_device_run,
    rel_errors,
    towers_once,
    train,
)

STEPS = 3


def _bn_nodes(graph_def):
    return [n for n in graph_def.node if n.op == "FusedBatchNormV3"]


@pytest.mark.parametrize("layer,data_format", [
    ("legacy", "NHWC"), ("fused_op", "NHWC"), ("legacy", "NCHW"), ("fused_op", "NCHW"),
])
def test_one_tower_matches_reference(layer, data_format):
    spec = Spec(towers=1, batch=4, layer=layer, data_format=data_format)
    data = make_batches(spec, STEPS)
    towers = build_towers(spec)
    # Through a GraphDef round trip, as rewritten graphs will be trained.
    got = train(towers.graph.as_graph_def(), towers, data, num_devices=1)
    expected = one_device_run(spec, STEPS)  # trained on make_batches(spec, STEPS): `data`
    assert max_rel_error(got, expected) < 1e-6
    assert max_rel_error(got, expected, elementwise=True) < 1e-6
    assert np.all(np.isfinite(got.losses)) and len(got.losses) == STEPS


@pytest.mark.parametrize("towers", [2, 4])
@pytest.mark.parametrize("layer", ["legacy", "fused_op"])
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
def test_unsynced_towers_differ_from_reference(towers, layer, data_format):
    spec = Spec(towers=towers, batch=4, layer=layer, data_format=data_format)
    data = make_batches(spec, STEPS)
    built = towers_once(spec)
    got = train(built.graph.as_graph_def(), built, data, num_devices=towers)
    expected = one_device_run(spec, STEPS)
    assert np.all(np.isfinite(got.losses))
    err = max_rel_error(got, expected)
    print(f"unsynced K={towers} {layer} {data_format}: max_rel_error={err:.3g}")
    assert err > 1e-3
    # Per-tower BN already changes the first step's loss.
    assert abs(got.losses[0] - expected.losses[0]) > 1e-3 * abs(expected.losses[0])


@functools.cache
def _hand_synced_run(data_format: str) -> Result:
    """build_hand_synced(K=2) trained: its plain ops are the same whichever layer the reference
    has, so it is trained once per data format (read-only)."""
    spec = Spec(towers=2, batch=4, data_format=data_format)
    synced = build_hand_synced(spec)
    return train(synced.graph.as_graph_def(), synced, make_batches(spec, STEPS), num_devices=spec.towers)


@pytest.mark.parametrize("layer", ["legacy", "fused_op"])
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
def test_hand_synced_towers_match_reference(layer, data_format):
    """The oracle can pass: correct synchronized BN == single-device reference."""
    expected = one_device_run(Spec(towers=2, batch=4, layer=layer, data_format=data_format), STEPS)
    got = _hand_synced_run(data_format)
    assert max_rel_error(got, expected) < 1e-5, rel_errors(got, expected)


def test_hand_synced_with_every_towers_updates_fails():
    """Keeping all K towers' moving-average updates must be caught."""
    spec = Spec(towers=2, batch=4, layer="fused_op")
    data = make_batches(spec, STEPS)
    expected = one_device_run(spec, STEPS)
    synced = build_hand_synced(spec, all_tower_updates=True)
    got = train(synced.graph, synced, data, num_devices=spec.towers)
    errors = rel_errors(got, expected)
    assert errors["net/bn1/moving_mean"] > 1e-3
    assert errors["net/conv1/kernel"] < 1e-5  # only the moving statistics are off


@pytest.mark.parametrize("layer,dtype", [
    ("fused_op", "float16"), ("legacy", "float16"), ("fused_op", "bfloat16"),
])
def test_low_precision_graph_trains(layer, dtype):
    spec = Spec(towers=2, batch=4, layer=layer, dtype=dtype)
    built = towers_once(spec)
    bns = _bn_nodes(built.graph.as_graph_def())
    assert len(bns) == 2 * spec.towers
    expected_t = tf.as_dtype(dtype).as_datatype_enum
    assert all(n.attr["T"].type == expected_t for n in bns)
    assert all(n.attr["U"].type == tf.float32.as_datatype_enum for n in bns)
    data = make_batches(spec, STEPS)
    got = train(built.graph, built, data, num_devices=spec.towers)
    assert np.all(np.isfinite(got.losses))
    assert all(np.all(np.isfinite(v)) for v in got.variables.values())
    # The single-device reference (same dtype) trains too.
    ref = one_device_run(spec, STEPS)
    assert np.all(np.isfinite(ref.losses))


@pytest.mark.parametrize("layer,data_format", [("legacy", "NHWC"), ("fused_op", "NCHW")])
def test_gpu_graph_builds_without_running(layer, data_format):
    spec = Spec(device="gpu", towers=4, layer=layer, data_format=data_format)
    built = build_towers(spec)
    gd = built.graph.as_graph_def()
    devices = {n.device for n in gd.node}
    assert {f"/device:GPU:{k}" for k in range(4)} <= devices
    assert not any("CPU" in d for d in devices)
    bns = _bn_nodes(gd)
    assert len(bns) == 8
    assert {n.device for n in bns} == {f"/device:GPU:{k}" for k in range(4)}
    assert all(n.attr["data_format"].s.decode() == data_format for n in bns)
    if data_format == "NCHW":  # native NCHW convs on GPU
        convs = [n for n in gd.node if n.op == "Conv2D"]
        assert convs and all(n.attr["data_format"].s == b"NCHW" for n in convs)


@pytest.mark.parametrize("layer", ["legacy", "fused_op"])
def test_built_structure(layer):
    spec = Spec(towers=3, layer=layer, data_format="NCHW")
    towers, ref = build_towers(spec), build_reference(spec)
    assert set(towers.variables) == set(ref.variables)
    assert {"net/conv1/kernel", "net/bn1/gamma", "net/bn1/beta", "net/bn1/moving_mean",
            "net/bn1/moving_variance", "net/bn2/moving_variance", "net/dense/kernel",
            "net/dense/bias"} <= set(ref.variables)
    assert len(towers.inputs) == 3 and len(ref.inputs) == 1
    gd = towers.graph.as_graph_def()
    graph = load_graph(gd)  # every name in Built resolves after a GraphDef import
    graph.get_operation_by_name(towers.train_op)
    graph.get_operation_by_name(towers.init)
    assert graph.get_tensor_by_name(towers.loss).shape.rank == 0
    for images, labels in towers.inputs:
        assert graph.get_tensor_by_name(images).shape.as_list() == [4, 3, 6, 6]
        assert graph.get_tensor_by_name(labels).shape.as_list() == [4]
    for name in towers.variables.values():
        graph.get_tensor_by_name(name)
    bns = _bn_nodes(gd)
    assert len(bns) == 6 and all(n.attr["data_format"].s == b"NCHW" for n in bns)
    assert {n.device for n in bns} == {"/device:CPU:0", "/device:CPU:1", "/device:CPU:2"}
    # All towers' moving-average updates are part of train_op.
    train_op = graph.get_operation_by_name(towers.train_op)
    assert len(train_op.control_inputs) == 1 + 4 * 3


def test_make_batches():
    spec = Spec(towers=4, batch=2, data_format="NCHW", channels=3, image=5)
    a, b = make_batches(spec, 2), make_batches(spec, 2)
    assert len(a) == 2
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
        assert xa.shape == (8, 3, 5, 5) and xa.dtype == np.float32
        assert ya.shape == (8,) and ya.min() >= 0 and ya.max() < 4
    # Tower slices have clearly different statistics (per-channel offsets, scales).
    x = a[0][0].reshape(4, 2, 3, 5, 5)  # (tower, example, channel, h, w)
    means = x.mean(axis=(1, 3, 4))  # (tower, channel)
    stds = x.std(axis=(1, 3, 4)).mean(axis=1)  # (tower,)
    assert np.ptp(means, axis=0).max() > 0.5
    assert stds[-1] > 2 * stds[0]
    assert not np.array_equal(a[0][0], a[1][0])
    nhwc = make_batches(Spec(towers=4, batch=2, image=5), 1)[0][0]
    assert nhwc.shape == (8, 5, 5, 3)
