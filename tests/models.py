"""Test oracle: multi-tower TF1-style training graphs, the single-device
reference, a trainer and an error measure.

Import as ``from models import Spec, build_towers, ...`` (pytest puts tests/
on sys.path). The builder code itself lives in examples/towers_model.py (one
copy shared with the demo); this module re-exports it and adds test-only
helpers.

    Spec(towers=2, batch=4, layer="legacy"|"fused_op"|..., data_format="NHWC"|"NCHW",
         dtype="float32"|"float16"|"bfloat16", device="cpu"|"gpu", image=6,
         channels=3, seed=0, tower_prefix="tower_", uneven=False,
         updates_tower=None)                      frozen dataclass
    Built(graph, train_op, loss, inputs, init, variables, global_batch=None)
    Result(losses, variables)
    build_towers(spec) -> Built
    build_reference(spec) -> Built
    make_batches(spec, steps) -> [(images, labels)]
    train(graph_def_or_graph, built, batches, num_devices, splits=None) -> Result
    max_rel_error(a, b, floor=1e-3, elementwise=False) -> float
    rel_errors(a, b, floor=1e-3, elementwise=False) -> {quantity: float}
    load_graph(GraphDef | MetaGraphDef | tf.Graph | bytes | path) -> tf.Graph
    build_hand_synced(spec, all_tower_updates=False) -> Built   (test-only)
    assert_synced(label, synced, unsynced, expected, tolerance) -> float   (test-only)
    use_passes(monkeypatch); kernel_gradients(graph_def), kernel_moments(graph_def) -> [names]   (test-only)
    one_device_run(spec, steps), unrewritten_run(spec, steps) -> Result   (test-only, once per process)
    towers_once(spec) -> Built   (test-only: build_towers once per process, read-only)

Typical oracle test::

    built = build_towers(spec)
    out = rewrite_graph(built.graph, ...)                 # the code under test
    data = make_batches(spec, steps=5)
    ref = build_reference(spec)
    expected = train(ref.graph, ref, data, num_devices=1)
    got = train(out.graph_def, built, data, num_devices=spec.towers)
    assert max_rel_error(got, expected) < 1e-4          # float32

Measured (default norm-wise measure, 5 steps): mathematically equivalent
float32 graphs differ by ~1e-6 (summation order); float16 ~5e-5, bfloat16
~5e-4; unsynchronized towers ~1.6-2; synchronized stats but all K towers'
moving-average updates kept ~0.7-1.2; synced stats with a per-tower instead
of global Bessel count ~3e-3 (moving_variance).
"""

import functools
import importlib
import os
import sys

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from towers_model import (  # noqa: E402,F401
    BN_EPSILON,
    BN_MOMENTUM,
    DATA_FORMATS,
    DEVICES,
    DTYPES,
    FILTERS,
    INIT_NAME,
    LAYERS,
    LEARNING_RATE,
    LOSS_NAME,
    NUM_CLASSES,
    OPTIMIZER_MOMENTUM,
    REL_FLOOR,
    TRAIN_OP_NAME,
    Built,
    Result,
    Spec,
    build_reference,
    build_towers,
    image_shape,
    initial_values,
    load_graph,
    make_batches,
    max_rel_error,
    rel_errors,
    session_config,
    train,
)

__all__ = [
    "Spec", "Built", "Result", "build_towers", "build_reference", "make_batches",
    "train", "max_rel_error", "rel_errors", "load_graph", "build_hand_synced",
    "LAYERS", "DATA_FORMATS", "DTYPES", "DEVICES", "assert_synced", "one_device_run", "unrewritten_run",
    "towers_once",
]


@functools.lru_cache(maxsize=None)
def towers_once(spec: Spec) -> Built:
    """build_towers(spec), built once per test process: rewrite_graph and train only read the
    graph, so every backend, option and un-rewritten run can share it (never add ops to it)."""
    return build_towers(spec)


@functools.lru_cache(maxsize=None)
def one_device_run(spec: Spec, steps: int) -> Result:
    """The one-device reference trained on make_batches(spec, steps): the same for every backend
    and option a test rewrites with, so trained once per test process (treat it as read-only)."""
    reference = build_reference(spec)
    return train(reference.graph, reference, make_batches(spec, steps), num_devices=1)


_UNREWRITTEN: dict[tuple[Spec, int], Result] = {}


def unrewritten_run(spec: Spec, steps: int, built: Built | None = None) -> Result:
    """The K-tower graph as built, not rewritten, trained on make_batches(spec, steps): the
    oracle's must-not-match side, trained once per test process (treat it as read-only).
    `built`: the caller's own build_towers(spec), not yet rewritten nor run: a copy of its
    GraphDef is trained (its Python graph is left alone); else the towers_once(spec) graph."""
    key = (spec, steps)
    if key not in _UNREWRITTEN:
        if built is None:
            built = towers_once(spec)
            graph = built.graph
        else:
            graph = built.graph.as_graph_def()
        _UNREWRITTEN[key] = train(graph, built, make_batches(spec, steps), num_devices=spec.towers)
    return _UNREWRITTEN[key]


unrewritten_run.cache_clear = _UNREWRITTEN.clear  # type: ignore[attr-defined]  # as a functools cache (tests/conftest.py)


def assert_synced(label: str, synced: Result, unsynced: Result, expected: Result, tolerance: float) -> float:
    """The oracle's verdict: `synced` matches the one-device `expected` within `tolerance`, and
    `unsynced` (the graph before the rewrite) misses it by more than 1e-2, so the check can
    fail. Prints both figures; returns the synced error."""
    error, off = max_rel_error(synced, expected), max_rel_error(unsynced, expected)
    print(f"{label}: synced {error:.2e}, unsynced {off:.2e}")
    assert off > 1e-2
    assert error <= tolerance, rel_errors(synced, expected)
    return error


def build_hand_synced(spec: Spec, all_tower_updates: bool = False) -> Built:
    """Positive control: K towers with batch norm synchronized BY HAND.

    Same model, variables, names of inputs/loss/train_op/init/variables and
    initial values as build_towers(spec), but each BN is written with plain ops:
    per-tower E[x] and E[x^2] are averaged across towers on /cpu:0, every tower
    normalizes with the global statistics (gradients flow across towers through
    autodiff), and only tower 0 updates the moving statistics (global mean and
    global Bessel-corrected variance, like FusedBatchNormV3). It is what a
    correct rewrite must be equivalent to; it should match build_reference(spec)
    to float32 round-off. ``all_tower_updates=True`` keeps every tower's
    moving-average updates (a plausible rewrite bug the oracle must catch).

    Supports float32, device="cpu"; NHWC or NCHW (statistics are taken over
    the non-channel axes; the graph itself runs in NHWC).
    """
    if spec.dtype != "float32" or spec.device != "cpu":
        raise ValueError("build_hand_synced supports float32 on cpu only")
    init = initial_values(spec)
    k_towers, batch = spec.towers, spec.batch
    n_global = k_towers * batch * spec.image * spec.image
    graph = tf.Graph()
    with graph.as_default():
        opt = tf.compat.v1.train.MomentumOptimizer(LEARNING_RATE, OPTIMIZER_MOMENTUM)
        var = {}
        with tf.device("/cpu:0"), tf.compat.v1.variable_scope("net"):
            for name, value in init.items():
                var[name] = tf.compat.v1.get_variable(name, initializer=value)
            for idx in (1, 2):
                for stat, value in (("moving_mean", 0.0), ("moving_variance", 1.0)):
                    var[f"bn{idx}/{stat}"] = tf.compat.v1.get_variable(
                        f"bn{idx}/{stat}", initializer=np.full(FILTERS, value, np.float32),
                        trainable=False)

        def tower(k):
            return _TowerScope(k)

        inputs, xs = [], []
        for k in range(k_towers):
            with tower(k):
                images = tf.compat.v1.placeholder(tf.float32, image_shape(spec, batch), name="images")
                labels = tf.compat.v1.placeholder(tf.int32, [batch], name="labels")
            inputs.append((images, labels))
            xs.append(tf.transpose(images, [0, 2, 3, 1]) if spec.data_format == "NCHW" else images)

        for idx in (1, 2):
            sums, sqsums = [], []
            for k in range(k_towers):
                with tower(k):
                    xs[k] = tf.nn.conv2d(xs[k], var[f"conv{idx}/kernel"], 1, "SAME")
                    sums.append(tf.reduce_mean(xs[k], [0, 1, 2]))
                    sqsums.append(tf.reduce_mean(tf.square(xs[k]), [0, 1, 2]))
            with tf.device("/cpu:0"), tf.name_scope(f"sync_bn{idx}"):
                mean = tf.add_n(sums) / k_towers
                variance = tf.add_n(sqsums) / k_towers - tf.square(mean)
            for k in range(k_towers):
                with tower(k):
                    xs[k] = tf.nn.relu(
                        (xs[k] - mean) * tf.math.rsqrt(variance + BN_EPSILON)
                        * var[f"bn{idx}/gamma"] + var[f"bn{idx}/beta"])
                    if k == 0 or all_tower_updates:
                        unbiased = variance * (n_global / (n_global - 1.0))
                        for stat, value in (("moving_mean", mean), ("moving_variance", unbiased)):
                            v = var[f"bn{idx}/{stat}"]
                            tf.compat.v1.add_to_collection(
                                tf.compat.v1.GraphKeys.UPDATE_OPS,
                                tf.compat.v1.assign_sub(
                                    v, (v - tf.stop_gradient(value)) * (1.0 - BN_MOMENTUM)))

        tower_grads, tower_losses = [], []
        for k in range(k_towers):
            with tower(k):
                logits = tf.matmul(tf.reduce_mean(xs[k], [1, 2]), var["dense/kernel"]) + var["dense/bias"]
                loss_k = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=inputs[k][1], logits=logits))
                tower_losses.append(loss_k)
                tower_grads.append(opt.compute_gradients(loss_k))
        with tf.device("/cpu:0"):
            avg = [(tf.add_n([g for g, _ in per_var]) / k_towers, per_var[0][1])
                   for per_var in zip(*tower_grads)]
            loss = tf.identity(tf.add_n(tower_losses) / k_towers, name=LOSS_NAME)
        apply_op = opt.apply_gradients(avg)
        train_op = tf.group(apply_op, *tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS),
                            name=TRAIN_OP_NAME)
        init_op = tf.compat.v1.global_variables_initializer()
        with tf.name_scope("readout"):
            variables = {v.op.name: v.value().name for v in tf.compat.v1.global_variables()}
    return Built(graph=graph, train_op=train_op.name, loss=loss.name,
                 inputs=[(i.name, l.name) for i, l in inputs], init=init_op.name,
                 variables=variables)


class _TowerScope:
    """with tf.device(/cpu:k), re-entered name scope tower_k/ (re-enterable)."""

    def __init__(self, k):
        self._device = tf.device(f"/cpu:{k}")
        self._name = tf.name_scope(f"tower_{k}/")

    def __enter__(self):
        self._device.__enter__()
        self._name.__enter__()

    def __exit__(self, *exc):
        self._name.__exit__(*exc)
        self._device.__exit__(*exc)


def use_passes(monkeypatch) -> None:
    """Send channels-last float32/float16 fused sites down sync_forward's and sync_backward's
    elementwise passes (which channels-first and bfloat16 sites take) instead of the kernels."""
    monkeypatch.setattr(importlib.import_module("bnrewrite.rewrite.passes.sites"), "KERNEL_DTYPES", frozenset())


def kernel_gradients(graph_def) -> list[str]:
    """The FusedBatchNormGradV3 nodes sync_backward's kernel path adds for the local sums, one
    per tower and gradient."""
    return [n.name for n in graph_def.node if n.op == "FusedBatchNormGradV3" and n.name.endswith("/sync_bn_grad/local")]


def kernel_moments(graph_def) -> list[str]:
    """The training-mode FusedBatchNormV3 nodes sync_forward's kernel path adds for the local
    moments, one per tower and layer."""
    return [n.name for n in graph_def.node if n.op == "FusedBatchNormV3" and n.name.endswith("/local_moments")]
