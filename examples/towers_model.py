"""Multi-tower TF1-style (tf.compat.v1 graph mode) conv+BN training graphs.

This module is the single home of the model/graph-building code used by both
``examples/demo.py`` and the test oracle (``tests/models.py`` re-exports it).

It builds:

* ``build_towers(spec)``: K towers (``/cpu:k`` or ``/gpu:k``), each with its
  own placeholders and its own batch norm, sharing resource variables created
  under ``variable_scope("net", reuse=AUTO_REUSE)``. Gradients are averaged
  across towers (``add_n / K`` on the first device), applied once with
  ``MomentumOptimizer(0.1, 0.9)``, and ``train_op`` groups the apply op with
  the UPDATE_OPS of *all* towers.
* ``build_reference(spec)``: the identical model with one tower on ``/cpu:0``
  fed all ``K*B`` examples -- what synchronized batch norm must reproduce.

Tower shapes (Spec fields; the defaults build the graphs above, node for node):

* ``tower_prefix``: tower k's name scope is ``f"{tower_prefix}{k}"``
  (``replica_``, ``clone_``, nested ``model/tower_``...); ``""`` opens no name
  scope at all, so the towers differ only by device and TensorFlow uniquifies
  their op names (``net/...``, ``net_1/...``; the tower losses are then
  ``tower_loss``, ``tower_loss_1``...).
* ``uneven``: placeholders with a dynamic batch dimension and
  ``loss_k = reduce_sum(xent_k) * K / N``, N the float placeholder_with_default
  ``global_batch`` (default K*B) that ``train`` feeds with the step's example
  count; ``train(..., splits=...)`` then gives towers any sizes, 0 included.
* ``updates_tower=k``: ``train_op`` groups tower k's UPDATE_OPS only (-1: the last tower's).
* ``affine=False``: legacy layers without gamma and beta (``center=False, scale=False``).
* ``renorm=True``: legacy layers with batch renormalization.

Model per tower: images -> conv3x3(8) -> BN -> relu -> conv3x3(8) -> BN ->
relu -> global average pool -> dense(4) -> sparse softmax cross entropy (mean).

Implementation notes (things TF refuses or that differ between layers):

* NCHW convolutions (and especially their gradients,
  ``Conv2DCustomBackpropFilterOp only supports NHWC``) are not supported on CPU
  without oneDNN. So on ``device="cpu"`` with ``data_format="NCHW"`` the
  placeholder is NCHW, the convs run in NHWC, and the tensor is transposed to
  NCHW right before each BN and back right after it: the BN op itself runs in
  NCHW. On ``device="gpu"`` NCHW convs are used natively.
* ``dtype`` (float16/bfloat16) is applied with a ``tf.cast`` right before BN
  and a cast back to float32 right after; scale/offset/moving stats stay
  float32. Both layers accept float32, float16 and bfloat16 on CPU (the legacy
  layer infers its dtype from the input and keeps its params in float32).
* ``layer="legacy"`` uses
  ``tf_keras.src.legacy_tf_layers.normalization.batch_normalization``. Inside a
  plain ``tf.Graph`` it does NOT use the fused exponential-average update; it
  emits ``FusedBatchNormV3`` (fed moving_mean / moving_variance as unused
  inputs) + ``AssignSubVariableOp`` updates ``moving -= (moving - stat) * 0.1``
  (colocated with the variable) where stat is the op's batch_mean /
  batch_variance output; ``_bessels_correction_test_only`` is True, so the
  moving variance tracks the op's Bessel-corrected variance n/(n-1) * biased,
  n = elements per channel of that BN input.
* ``layer="fused_op"`` uses ``tf.compat.v1.nn.fused_batch_norm`` and TF1's
  ``assign_moving_average(..., decay=0.9, zero_debias=False)`` fed directly
  with the op's batch_mean / batch_variance outputs, so the moving variance
  also tracks the Bessel-corrected variance (same semantics as legacy).
  ``tf.compat.v1.train.assign_moving_average`` is no longer exported by TF 2.x,
  so it is imported from ``tensorflow.python.training.moving_averages``.
  ``zero_debias=False`` because zero-debiasing is wrong for moving_variance
  (initialised to 1) and creates extra per-call variables.
* Because every tower's UPDATE_OPS are grouped into ``train_op``, the
  unrewritten towers graph applies K read-modify-write moving-average updates
  per step to the same moving_mean / moving_variance variable, with no ordering
  between them (non-deterministic when towers differ).

All initial values come from ``numpy.random.default_rng(spec.seed)`` via
constant initializers, so the towers graph and the reference start identical.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Union

import numpy as np
import tensorflow as tf

try:
    # TF1's tf.train.assign_moving_average is no longer exported by TF 2.x
    # (not even under tf.compat.v1.train); the implementation still exists.
    from tensorflow.python.training.moving_averages import assign_moving_average
except ImportError:  # pragma: no cover - same graph, written out by hand
    def assign_moving_average(variable, value, decay, zero_debias=False, name=None):
        assert not zero_debias
        with tf.name_scope(name or "AssignMovingAvg") as scope:
            delta = tf.convert_to_tensor(1.0 - decay, name="decay")
            return tf.compat.v1.assign_sub(variable, (variable - value) * delta, name=scope)

LAYERS = ("legacy", "fused_op", "legacy_unfused", "legacy_cond_v1", "legacy_cond_v2", "moments_cond_v1", "moments_cond_v2")
#: Layers fed a training placeholder (is_training, default True) through tf.cond.
COND_LAYERS = ("legacy_cond_v1", "legacy_cond_v2", "moments_cond_v1", "moments_cond_v2")
#: Layers whose tf.cond is built with version-1 control flow (Switch/Merge).
V1_LAYERS = ("legacy_cond_v1", "moments_cond_v1")
IS_TRAINING_NAME = "is_training"
DATA_FORMATS = ("NHWC", "NCHW")
DTYPES = ("float32", "float16", "bfloat16")
DEVICES = ("cpu", "gpu")
SPLIT_INPUTS = ("", "split", "split_v", "slice", "strided_slice")

FILTERS = 8
NUM_CLASSES = 4
BN_MOMENTUM = 0.9  # moving = 0.9 * moving + 0.1 * batch_stat
BN_EPSILON = 1e-3
LEARNING_RATE = 0.1
OPTIMIZER_MOMENTUM = 0.9

# Names of the nodes every built graph exposes (see Built).
TRAIN_OP_NAME = "train_op"
LOSS_NAME = "loss"
INIT_NAME = "init"
GLOBAL_BATCH_NAME = "global_batch"  # Spec.uneven: N, the number of examples in the step


@dataclass(frozen=True)
class Spec:
    towers: int = 2  # K
    batch: int = 4  # B, examples per tower
    layer: str = "legacy"  # "legacy" | "fused_op"
    data_format: str = "NHWC"  # "NHWC" | "NCHW"
    dtype: str = "float32"  # dtype of the tensor entering BN
    device: str = "cpu"  # "cpu" | "gpu" (gpu graphs are only built)
    image: int = 6  # H = W
    channels: int = 3  # input channels
    seed: int = 0
    #: Name scope of tower k is f"{tower_prefix}{k}", nested when the prefix has a "/"
    #: ("model/tower_": every tower inside one outer scope); "" means none: only the variable
    #: scope "net" is reused and TensorFlow uniquifies the op names (net/..., net_1/...), so
    #: the towers differ only by device.
    tower_prefix: str = "tower_"
    #: Dynamic batch dimension (placeholders [None, ...]) and a loss that allows uneven
    #: per-tower batches: loss_k = reduce_sum(xent_k) * K / N, where N is the
    #: placeholder_with_default "global_batch" (float, default K*B) fed the total number of
    #: examples. The average of the K tower losses is then the mean over all N examples, and
    #: the averaged tower gradients are the single-device gradient, whatever the split.
    uneven: bool = False
    #: train_op groups only tower k's UPDATE_OPS (the moving-statistics updates; -1: the last
    #: tower's) instead of every tower's, as trainers that read UPDATE_OPS for one tower's scope
    #: do; and references whose moving statistics are those of device 0 only. None: every tower's.
    updates_tower: int | None = None
    #: Legacy layers only: False builds them with center=False, scale=False (no gamma or beta:
    #: the layer's only variables are its moving statistics).
    affine: bool = True
    #: Legacy layers only: batch renormalization (renorm=True; unfused).
    renorm: bool = False
    #: "" gives each tower its own placeholders; "split", "split_v", "slice", "strided_slice"
    #: feed one pair of K*B (images, labels) placeholders, each tower taking its B examples
    #: with that op (tf.split, tf.split by sizes, tf.slice, x[k*B:(k+1)*B]).
    split_input: str = ""

    def __post_init__(self):
        if self.layer not in LAYERS:
            raise ValueError(f"layer must be one of {LAYERS}, got {self.layer!r}")
        if self.data_format not in DATA_FORMATS:
            raise ValueError(f"data_format must be one of {DATA_FORMATS}, got {self.data_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.towers < 1 or self.batch < 1 or self.image < 1 or self.channels < 1:
            raise ValueError(f"towers, batch, image, channels must be >= 1: {self}")
        if (not self.affine or self.renorm) and not self.layer.startswith("legacy"):
            raise ValueError(f"affine=False and renorm=True need a legacy layer, got {self.layer!r}")
        if self.split_input not in SPLIT_INPUTS:
            raise ValueError(f"split_input must be one of {SPLIT_INPUTS}, got {self.split_input!r}")
        if self.tower_prefix.startswith("/") or self.tower_prefix.endswith("/"):
            raise ValueError(f"tower_prefix must be a name scope prefix, got {self.tower_prefix!r}")


@dataclass
class Built:
    graph: tf.Graph
    train_op: str  # op name to run for one training step
    loss: str  # tensor name of the scalar loss
    inputs: list  # [(images tensor name, labels tensor name)] per tower
    init: str  # op name of the variables initializer
    variables: dict  # variable name -> tensor name reading its current value
    global_batch: Union[str, None] = None  # tensor name of N (Spec.uneven), fed by train()


@dataclass
class Result:
    losses: np.ndarray  # loss per step (float64), evaluated before that step's update
    variables: dict  # variable name -> value after the last step


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


def initial_values(spec: Spec) -> dict:
    """Deterministic initial values for every trainable variable."""
    rng = np.random.default_rng(spec.seed)
    cin = spec.channels

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    return {
        "conv1/kernel": normal((3, 3, cin, FILTERS), np.sqrt(2.0 / (9 * cin))),
        "bn1/gamma": (1.0 + normal((FILTERS,), 0.1)).astype(np.float32),
        "bn1/beta": normal((FILTERS,), 0.1),
        "conv2/kernel": normal((3, 3, FILTERS, FILTERS), np.sqrt(2.0 / (9 * FILTERS))),
        "bn2/gamma": (1.0 + normal((FILTERS,), 0.1)).astype(np.float32),
        "bn2/beta": normal((FILTERS,), 0.1),
        "dense/kernel": normal((FILTERS, NUM_CLASSES), np.sqrt(1.0 / FILTERS)),
        "dense/bias": np.zeros((NUM_CLASSES,), np.float32),
    }


def _const_init(value: np.ndarray):
    return tf.compat.v1.constant_initializer(value)


def _conv_in_nchw(spec: Spec) -> bool:
    # CPU kernels (without oneDNN) only support NHWC convs; GPU supports NCHW.
    return spec.data_format == "NCHW" and spec.device == "gpu"


def _to_nchw(x):
    return tf.transpose(x, [0, 3, 1, 2])


def _to_nhwc(x):
    return tf.transpose(x, [0, 2, 3, 1])


def _conv(x, name, init, data_format):
    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable(
            "kernel", shape=init[f"{name}/kernel"].shape, dtype=tf.float32,
            initializer=_const_init(init[f"{name}/kernel"]))
    return tf.nn.conv2d(x, kernel, strides=1, padding="SAME", data_format=data_format,
                        name=f"{name}_conv")


def _batch_norm(x, name, spec: Spec, init):
    """BN in spec.data_format on a tensor of spec.dtype; x is in that format."""
    axis = 3 if spec.data_format == "NHWC" else 1
    if spec.layer.startswith("moments_cond"):
        return _cond_batch_norm(x, name, spec, init, axis)
    if spec.layer in ("legacy", "legacy_unfused", "legacy_cond_v1", "legacy_cond_v2"):
        from tf_keras.src.legacy_tf_layers import normalization as legacy_norm

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return legacy_norm.batch_normalization(
                x, axis=axis, momentum=BN_MOMENTUM, epsilon=BN_EPSILON,
                gamma_initializer=_const_init(init[f"{name}/gamma"]),
                beta_initializer=_const_init(init[f"{name}/beta"]),
                center=spec.affine, scale=spec.affine, renorm=spec.renorm,
                training=_is_training() if spec.layer.startswith("legacy_cond") else True,
                fused=spec.layer != "legacy_unfused" and not spec.renorm, name=name)
    # fused_op
    with tf.compat.v1.variable_scope(name):
        gamma = tf.compat.v1.get_variable(
            "gamma", shape=[FILTERS], dtype=tf.float32,
            initializer=_const_init(init[f"{name}/gamma"]))
        beta = tf.compat.v1.get_variable(
            "beta", shape=[FILTERS], dtype=tf.float32,
            initializer=_const_init(init[f"{name}/beta"]))
        moving_mean = tf.compat.v1.get_variable(
            "moving_mean", shape=[FILTERS], dtype=tf.float32,
            initializer=tf.compat.v1.zeros_initializer(), trainable=False)
        moving_variance = tf.compat.v1.get_variable(
            "moving_variance", shape=[FILTERS], dtype=tf.float32,
            initializer=tf.compat.v1.ones_initializer(), trainable=False)
        y, batch_mean, batch_var = tf.compat.v1.nn.fused_batch_norm(
            x, gamma, beta, epsilon=BN_EPSILON, is_training=True,
            data_format=spec.data_format)
        update_mean = assign_moving_average(
            moving_mean, batch_mean, decay=BN_MOMENTUM, zero_debias=False)
        update_var = assign_moving_average(
            moving_variance, batch_var, decay=BN_MOMENTUM, zero_debias=False)
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update_mean)
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update_var)
    return y


def _is_training():
    return tf.compat.v1.get_default_graph().get_tensor_by_name(f"{IS_TRAINING_NAME}:0")


def _cond_batch_norm(x, name, spec: Spec, init, axis):
    """The hand-written batch norm of the GitHub thread on multi-GPU BN: tf.nn.moments +
    tf.nn.batch_normalization, population statistics in plain per-tower tf.Variables
    updated with tf.assign inside tf.cond(is_training, train, eval)."""
    is_training = _is_training()
    with tf.compat.v1.variable_scope(name):
        gamma = tf.compat.v1.get_variable("gamma", initializer=init[f"{name}/gamma"])
        beta = tf.compat.v1.get_variable("beta", initializer=init[f"{name}/beta"])
    with tf.name_scope(name):
        pop_mean = tf.Variable(np.zeros(FILTERS, np.float32), trainable=False, name="pop_mean")
        pop_var = tf.Variable(np.ones(FILTERS, np.float32), trainable=False, name="pop_var")
    shape = [1, 1, 1, 1]
    shape[axis] = FILTERS
    axes = [a for a in range(4) if a != axis]

    def like_x(t):  # float32 variables meet half-precision data (a no-op for float32)
        return tf.reshape(tf.cast(t, x.dtype), shape)

    def train():
        batch_mean, batch_var = tf.nn.moments(x, axes)  # of x's dtype (computed in float32 for float16)
        train_mean = tf.compat.v1.assign(
            pop_mean, pop_mean * BN_MOMENTUM + tf.cast(batch_mean, tf.float32) * (1 - BN_MOMENTUM))
        train_var = tf.compat.v1.assign(
            pop_var, pop_var * BN_MOMENTUM + tf.cast(batch_var, tf.float32) * (1 - BN_MOMENTUM))
        with tf.control_dependencies([train_mean, train_var]):
            return tf.nn.batch_normalization(
                x, tf.reshape(batch_mean, shape), tf.reshape(batch_var, shape), like_x(beta), like_x(gamma), BN_EPSILON)

    def evaluate():
        return tf.nn.batch_normalization(
            x, like_x(pop_mean), like_x(pop_var), like_x(beta), like_x(gamma), BN_EPSILON)

    return tf.compat.v1.cond(is_training, train, evaluate)


def _conv_bn_relu(x, idx, spec: Spec, init):
    """x is in the conv layout; returns relu(BN(conv(x))) in the conv layout."""
    conv_nchw = _conv_in_nchw(spec)
    y = _conv(x, f"conv{idx}", init, "NCHW" if conv_nchw else "NHWC")
    transpose = spec.data_format == "NCHW" and not conv_nchw
    if transpose:
        y = _to_nchw(y)
    if spec.dtype != "float32":
        y = tf.cast(y, spec.dtype)
    y = _batch_norm(y, f"bn{idx}", spec, init)
    if spec.dtype != "float32":
        y = tf.cast(y, tf.float32)
    if transpose:
        y = _to_nhwc(y)
    return tf.nn.relu(y)


def _logits(images, spec: Spec, init):
    """images: placeholder in spec.data_format."""
    with tf.compat.v1.variable_scope("net", reuse=tf.compat.v1.AUTO_REUSE):
        conv_nchw = _conv_in_nchw(spec)
        x = images
        if spec.data_format == "NCHW" and not conv_nchw:
            x = _to_nhwc(x)
        x = _conv_bn_relu(x, 1, spec, init)
        x = _conv_bn_relu(x, 2, spec, init)
        x = tf.reduce_mean(x, axis=[2, 3] if conv_nchw else [1, 2], name="global_pool")
        with tf.compat.v1.variable_scope("dense"):
            kernel = tf.compat.v1.get_variable(
                "kernel", shape=[FILTERS, NUM_CLASSES], dtype=tf.float32,
                initializer=_const_init(init["dense/kernel"]))
            bias = tf.compat.v1.get_variable(
                "bias", shape=[NUM_CLASSES], dtype=tf.float32,
                initializer=_const_init(init["dense/bias"]))
        return tf.nn.bias_add(tf.matmul(x, kernel), bias, name="logits")


def image_shape(spec: Spec, batch: int) -> tuple:
    h = w = spec.image
    if spec.data_format == "NHWC":
        return (batch, h, w, spec.channels)
    return (batch, spec.channels, h, w)


def _build(spec: Spec, towers: int, batch: int, device: str) -> Built:
    from tensorflow.python.ops import control_flow_util

    v2 = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = spec.layer not in V1_LAYERS
    try:
        return _build_graph(spec, towers, batch, device)
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = v2


def _build_graph(spec: Spec, towers: int, batch: int, device: str) -> Built:
    init_values = initial_values(spec)
    graph = tf.Graph()
    with graph.as_default():
        if spec.layer in COND_LAYERS:
            tf.compat.v1.placeholder_with_default(True, [], name=IS_TRAINING_NAME)
        global_batch = None
        if spec.uneven:
            global_batch = tf.compat.v1.placeholder_with_default(
                float(towers * batch), [], name=GLOBAL_BATCH_NAME)
        opt = tf.compat.v1.train.MomentumOptimizer(LEARNING_RATE, OPTIMIZER_MOMENTUM)
        inputs, tower_losses, tower_grads, tower_updates = [], [], [], []
        placeholder_batch = None if spec.uneven else batch
        split = _split_inputs(spec, towers, batch) if spec.split_input and towers > 1 else None
        for k in range(towers):
            updates_before = len(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS))
            with tf.device(f"/{device}:{k}"), _tower_scope(spec.tower_prefix, k):
                if split is None:
                    images = tf.compat.v1.placeholder(
                        tf.float32, image_shape(spec, placeholder_batch), name="images")
                    labels = tf.compat.v1.placeholder(tf.int32, [placeholder_batch], name="labels")
                else:
                    images, labels = split[1][k], split[3][k]
                logits = _logits(images, spec, init_values)
                xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
                # Without a tower scope, "loss" would take the name of the graph's total loss.
                loss_name = "loss" if spec.tower_prefix else "tower_loss"
                if spec.uneven:
                    loss_k = tf.math.multiply(tf.reduce_sum(xent), float(towers) / global_batch, name=loss_name)
                else:
                    loss_k = tf.reduce_mean(xent, name=loss_name)
                grads = opt.compute_gradients(loss_k)
            if split is None or not k:
                inputs.append((images.name, labels.name) if split is None else (split[0].name, split[2].name))
            tower_losses.append(loss_k)
            tower_grads.append(grads)
            tower_updates.append(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)[updates_before:])

        with tf.device(f"/{device}:0"), tf.name_scope("average"):
            avg_grads = []
            for per_var in zip(*tower_grads):
                var = per_var[0][1]
                grads = [g for g, _ in per_var]
                if any(g is None for g in grads):
                    raise RuntimeError(f"no gradient for {var.op.name}")
                avg_grads.append((tf.math.truediv(tf.add_n(grads), float(towers)), var))
            loss = tf.math.truediv(tf.add_n(tower_losses), float(towers))
        loss = tf.identity(loss, name=LOSS_NAME)
        apply_op = opt.apply_gradients(avg_grads, name="apply_gradients")
        update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
        if spec.updates_tower is not None and towers > 1:  # the one device's are its only tower's
            update_ops = tower_updates[spec.updates_tower]
        train_op = tf.group(apply_op, *update_ops, name=TRAIN_OP_NAME)
        init = tf.compat.v1.global_variables_initializer()
        assert init.name == INIT_NAME, init.name

        variables = {}
        with tf.name_scope("readout"):
            for v in tf.compat.v1.global_variables():
                # value() places the read on the variable's device.
                variables[v.op.name] = v.value().name
    return Built(graph=graph, train_op=train_op.name, loss=loss.name, inputs=inputs,
                 init=init.name, variables=variables,
                 global_batch=global_batch.name if global_batch is not None else None)


def _split_inputs(spec: Spec, towers: int, batch: int) -> tuple:
    """(images, per-tower images, labels, per-tower labels): one pair of placeholders of the
    whole batch, cut into the towers' B examples by spec.split_input."""
    images = tf.compat.v1.placeholder(tf.float32, image_shape(spec, towers * batch), name="images")
    labels = tf.compat.v1.placeholder(tf.int32, [towers * batch], name="labels")

    def cut(x):
        if spec.split_input == "split":
            return tf.split(x, towers)
        if spec.split_input == "split_v":
            return tf.split(x, [batch] * (towers - 1) + [-1])
        if spec.split_input == "slice":
            return [tf.slice(x, [k * batch] + [0] * (x.shape.rank - 1), [batch] + [-1] * (x.shape.rank - 1))
                    for k in range(towers)]
        return [x[k * batch:(k + 1) * batch] for k in range(towers)]

    return images, cut(images), labels, cut(labels)


def _tower_scope(prefix: str, k: int):
    """Tower k's name scope, or none at all when prefix is ""."""
    if prefix:
        return tf.name_scope(f"{prefix}{k}")
    return contextlib.nullcontext()


def build_towers(spec: Spec) -> Built:
    """K-tower graph: tower k on /{spec.device}:k, fed spec.batch examples."""
    return _build(spec, spec.towers, spec.batch, spec.device)


def build_reference(spec: Spec) -> Built:
    """Single-device (/cpu:0) graph of the same model, fed all K*B examples."""
    return _build(spec, 1, spec.towers * spec.batch, "cpu")


# ---------------------------------------------------------------------------
# Data and training
# ---------------------------------------------------------------------------


def make_batches(spec: Spec, steps: int) -> list:
    """Deterministic global batches: [(images (K*B, ...) float32, labels (K*B,) int32)].

    Tower slice k (rows k*B:(k+1)*B) gets its own scale (1 + 0.75k) and a
    per-channel offset, so per-tower batch statistics clearly differ.
    """
    rng = np.random.default_rng(10_000 + spec.seed)
    k_towers, b = spec.towers, spec.batch
    cin, h = spec.channels, spec.image
    scales = 1.0 + 0.75 * np.arange(k_towers)
    offsets = rng.uniform(-2.0, 2.0, size=(k_towers, cin))
    batches = []
    for _ in range(steps):
        x = rng.standard_normal((k_towers, b, h, h, cin))
        x = x * scales[:, None, None, None, None] + offsets[:, None, None, None, :]
        x = x.reshape(k_towers * b, h, h, cin).astype(np.float32)
        if spec.data_format == "NCHW":
            x = np.ascontiguousarray(np.transpose(x, (0, 3, 1, 2)))
        y = rng.integers(0, NUM_CLASSES, size=(k_towers * b,)).astype(np.int32)
        batches.append((x, y))
    return batches


GraphLike = Union[tf.Graph, "tf.compat.v1.GraphDef", "tf.compat.v1.MetaGraphDef", str, bytes]


def load_graph(graph_like) -> tf.Graph:
    """tf.Graph (returned as is), GraphDef, MetaGraphDef, serialized GraphDef
    bytes, or a path to a binary GraphDef file -> tf.Graph (imported, name="")."""
    if isinstance(graph_like, tf.Graph):
        return graph_like
    if isinstance(graph_like, str):
        with open(graph_like, "rb") as f:
            graph_like = f.read()
    if isinstance(graph_like, bytes):
        gd = tf.compat.v1.GraphDef()
        gd.ParseFromString(graph_like)
        graph_like = gd
    graph = tf.Graph()
    with graph.as_default():
        if isinstance(graph_like, tf.compat.v1.MetaGraphDef):
            tf.compat.v1.train.import_meta_graph(graph_like, clear_devices=False)
        elif isinstance(graph_like, tf.compat.v1.GraphDef):
            tf.graph_util.import_graph_def(graph_like, name="")
        else:
            raise TypeError(f"cannot load a graph from {type(graph_like).__name__}")
    return graph


def session_config(num_devices: int) -> "tf.compat.v1.ConfigProto":
    return tf.compat.v1.ConfigProto(
        device_count={"CPU": num_devices},
        allow_soft_placement=False,
        intra_op_parallelism_threads=1,
        inter_op_parallelism_threads=2,
    )


def _step_splits(splits, steps: int, n: int) -> list:
    """splits -> one list of n per-tower sizes per step (None: equal slices)."""
    if splits is None:
        return [None] * steps
    if all(isinstance(b, (int, np.integer)) for b in splits):
        splits = [splits] * steps
    splits = [list(map(int, s)) for s in splits]
    if len(splits) != steps:
        raise ValueError(f"{len(splits)} splits for {steps} steps")
    for s in splits:
        if len(s) != n or min(s) < 0:
            raise ValueError(f"split {s} is not {n} non-negative tower sizes")
    return splits


def train(graph_def_or_graph, built: Built, batches, num_devices: int, splits=None) -> Result:
    """Run len(batches) training steps; tower k gets the k-th equal slice of
    each global batch (one input pair = the whole batch).

    splits: per-tower sizes [b_0, ..., b_{K-1}] used every step, or one such list per
    step; tower k then gets the next b_k examples of the global batch (b_k may be 0;
    the sizes must add up to the global batch). Needs a graph with a dynamic batch
    dimension (Spec.uneven). When the graph has a global_batch input it is fed the
    number of examples in the step.
    """
    graph = load_graph(graph_def_or_graph)
    n = len(built.inputs)
    losses = []
    step_splits = _step_splits(splits, len(batches), n)
    with tf.compat.v1.Session(graph=graph, config=session_config(num_devices)) as sess:
        sess.run(built.init)
        train_op = graph.get_operation_by_name(built.train_op)
        loss = graph.get_tensor_by_name(built.loss)
        for (images, labels), sizes in zip(batches, step_splits):
            if len(labels) != len(images):
                raise ValueError(f"{len(images)} images but {len(labels)} labels")
            if sizes is None:
                if len(images) % n:
                    raise ValueError(f"global batch of {len(images)} does not split into {n} towers")
                sizes = [len(images) // n] * n
            if sum(sizes) != len(images):
                raise ValueError(f"split {sizes} does not add up to the global batch of {len(images)}")
            starts = np.concatenate([[0], np.cumsum(sizes)])
            feed = {}
            for k, (img_name, lbl_name) in enumerate(built.inputs):
                feed[img_name] = images[starts[k]:starts[k + 1]]
                feed[lbl_name] = labels[starts[k]:starts[k + 1]]
            if built.global_batch is not None:
                feed[built.global_batch] = float(len(images))
            _, loss_value = sess.run([train_op, loss], feed_dict=feed)
            losses.append(float(loss_value))
        values = sess.run(dict(built.variables))
    return Result(losses=np.asarray(losses, dtype=np.float64),
                  variables={k: np.asarray(v) for k, v in values.items()})


REL_FLOOR = 1e-3


def _rel_error(x, y, floor: float, elementwise: bool) -> float:
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch {x.shape} vs {y.shape}")
    if x.size == 0:
        return 0.0
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return float("inf")
    diff = np.abs(x - y)
    if elementwise:
        return float(np.max(diff / np.maximum(np.abs(y), floor)))
    return float(np.max(diff) / max(float(np.max(np.abs(y))), floor))


def rel_errors(a: Result, b: Result, floor: float = REL_FLOOR, elementwise: bool = False) -> dict:
    """Relative error of ``a`` against the reference ``b``, per quantity.

    Keys: "loss" (the vector of per-step losses) and every variable of ``b``
    (a variable missing from ``a`` raises KeyError; extra ones in ``a`` are
    ignored). Default (per-tensor, norm-wise):

        max|a - b| / max(max|b|, floor)

    With ``elementwise=True``: max(|a - b| / max(|b|, floor)), which is much
    noisier on near-zero elements (e.g. optimizer slots). Non-finite values
    give inf.
    """
    out = {"loss": _rel_error(a.losses, b.losses, floor, elementwise)}
    for name, ref in b.variables.items():
        out[name] = _rel_error(a.variables[name], ref, floor, elementwise)
    return out


def max_rel_error(a: Result, b: Result, floor: float = REL_FLOOR, elementwise: bool = False) -> float:
    """Max of rel_errors(a, b) over the losses and every variable (b is the
    reference). Measured noise floor of a mathematically equivalent float32
    computation (reference fed a permuted batch, 5 steps): ~1e-6..5e-6;
    float16 ~5e-5; bfloat16 ~5e-4. Unsynchronized towers: ~1.6-2."""
    return max(rel_errors(a, b, floor, elementwise).values())
