"""Synchronized batch norm written in model code, as tensorpack writes it: the reference that
tools/bench_step.py sets bnrewrite against.

tensorpack's `BatchNorm(..., sync_statistics='nccl'/'horovod')` has each tower compute its
local E[x] and E[x²], all-reduce them, divide by the number of towers K, take
var = E[x²] − E[x]², normalize with `tf.nn.batch_normalization` and let autodiff differentiate
through the all-reduce, whose gradient is the all-reduce of the incoming gradient divided by K.
Here the two statistics travel in ONE all-reduce (their concatenation), and the moving averages
are updated by tower 0 alone, with the global batch's Bessel correction so that the moving
variance is the one a single device fed the whole batch would keep (tensorpack uses the biased
variance; the benchmark compares against graphs that train like one device).

The all-reduces are `CollectiveReduceV2` (any device; its keys as bnrewrite/rewrite/collectives.py
builds them) or `NcclAllReduce` (every tower on a GPU). Forward and backward all-reduces of a
layer are data-dependent on the previous layer's, so every tower issues them in one order
without control edges.
"""

from __future__ import annotations

import tensorflow as tf

tf1 = tf.compat.v1

#: Group key of the model-code all-reduces; bnrewrite uses 0x5B00, the floor 0x7F00.
GROUP_KEY = 0x7E00
BACKENDS = ("collective", "nccl")


def all_reduce(x: tf.Tensor, towers: int, group_key: int, instance_key: int, backend: str,
               after: list[tf.Operation] = ()) -> tf.Tensor:
    """The sum of `x` over the towers: one all-reduce, identified by its keys on every tower,
    run after the ops `after` (its key constants do not wait, so they stay constants)."""
    if backend == "nccl":
        with tf.control_dependencies(after):
            return tf.raw_ops.NcclAllReduce(
                input=x, reduction="sum", num_devices=towers, shared_name=f"model_g{group_key}_i{instance_key}")
    keys = [tf.constant(value) for value in (towers, group_key, instance_key)]
    with tf.control_dependencies(after):
        return tf.raw_ops.CollectiveReduceV2(
            input=x, group_size=keys[0], group_key=keys[1], instance_key=keys[2], ordering_token=[],
            merge_op="Add", final_op="Id", communication_hint="auto")


def mean_over_towers(x: tf.Tensor, towers: int, instance_key: int, backend: str) -> tf.Tensor:
    """The mean of `x` over the towers. Its gradient is the mean of the towers' incoming
    gradients (instance key + 1): tower j's input reaches every tower's loss through it."""

    @tf.custom_gradient
    def reduce(value: tf.Tensor) -> tuple[tf.Tensor, object]:
        def grad(upstream: tf.Tensor) -> tf.Tensor:
            return all_reduce(upstream, towers, GROUP_KEY, instance_key + 1, backend) / float(towers)

        return all_reduce(value, towers, GROUP_KEY, instance_key, backend) / float(towers), grad

    return reduce(x)


def sync_batch_norm(x: tf.Tensor, towers: int, tower: int, layer: int, name: str, backend: str = "collective",
                    momentum: float = 0.99, epsilon: float = 1e-3) -> tf.Tensor:
    """Batch norm of an NHWC tensor over the global batch of `towers` equal slices.

    Variables (`gamma`, `beta`, `moving_mean`, `moving_variance`, float32) are those of the
    legacy `batch_normalization` layer, under the same names and defaults, so checkpoints and
    initial values carry over. Statistics are float32 whatever x's dtype (as the fused op
    keeps them); normalization runs in x's dtype. Layer `layer` uses instance keys 2·layer
    (forward) and 2·layer + 1 (gradient).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    channels = x.shape[-1]
    with tf1.variable_scope(name):
        gamma = tf1.get_variable("gamma", [channels], tf.float32, tf1.ones_initializer())
        beta = tf1.get_variable("beta", [channels], tf.float32, tf1.zeros_initializer())
        moving_mean = tf1.get_variable("moving_mean", [channels], tf.float32, tf1.zeros_initializer(), trainable=False)
        moving_variance = tf1.get_variable(
            "moving_variance", [channels], tf.float32, tf1.ones_initializer(), trainable=False)
        xf = tf.cast(x, tf.float32)
        axes = [0, 1, 2]
        local = tf.concat([tf.reduce_mean(xf, axes), tf.reduce_mean(tf.square(xf), axes)], 0)
        mean, mean_square = tf.split(mean_over_towers(local, towers, 2 * layer, backend), 2)
        variance = mean_square - tf.square(mean)
        y = tf.nn.batch_normalization(
            x, *(tf.cast(t, x.dtype) for t in (mean, variance, beta, gamma)), variance_epsilon=epsilon)
        if tower == 0:
            count = float(towers * x.shape[:3].num_elements())
            unbiased = variance * (count / (count - 1.0))
            for variable, value in ((moving_mean, mean), (moving_variance, unbiased)):
                update = tf1.assign_sub(variable, (variable - value) * (1.0 - momentum))
                tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
    return y
