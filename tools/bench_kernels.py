"""Where the fused kernels pay in a synced layer: elementwise passes against fused batch-norm
kernels, forward and backward, per activation size (what sets bnrewrite's KERNEL_MIN_ELEMENTS).

    python tools/bench_kernels.py [--towers 4] [--shapes 8x16x16x32,8x16x16x64,16x32x32x32,16x32x32x64]

Each of K virtual CPU devices runs a chain of 40 computations on its own NHWC float32 tensor
(the chains are independent, as towers between two all-reduces are; K > cores shares the cores
as training does), without the all-reduce, whose cost is the same for both forms:

- forward, passes: the local moments as sum(x), then the deviations d = x - mean and their
  sum of squares (EuclideanNorm), and x normalized as d * gain + (offset - shift * gain), then
  a ReLU: what sync_forward builds below the threshold;
- forward, kernels: the local moments from a training-mode FusedBatchNormV3 (whose y goes
  unused), and x normalized by an inference-mode FusedBatchNormV3 with the ReLU after it (which
  Grappler fuses into it): what it builds above;
- normalize: the normalizations of the two forms alone (the passes' from the deviations, the
  kernel's from x);
- backward, passes: given the forward's deviations d and shift, sum(dy), sum(dy * d) - shift *
  sum(dy), then (dy - d * b + c) * gain: what sync_backward builds below the threshold;
- backward, kernels: an inference-mode FusedBatchNormGradV3 (gain * dy and both sums), an
  inference-mode FusedBatchNormV3 of x (the correction) and an AddV2.

Then the gradient kernel alone, FusedBatchNormGradV3 fed fixed moments, in training mode (what
the un-synced graph runs) and in inference mode (what sync_backward's kernel path runs), in
float32 and float16: why the kernel path takes the inference mode in float16 too.

Prints wall and process CPU microseconds per computation and tower, medians of 15 steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1
CHAIN = 40


def forward_passes(x: tf.Tensor, gain: tf.Tensor) -> tf.Tensor:
    mean = tf.reduce_sum(x, [0, 1, 2]) * (1.0 / np.prod(x.shape[:3]))
    deviations = x - mean
    m2 = tf.math.square(tf.raw_ops.EuclideanNorm(input=deviations, axis=[0, 1, 2]))
    return normalize_passes(deviations, gain, mean * 1e-3, m2)


def forward_kernels(x: tf.Tensor, gain: tf.Tensor) -> tf.Tensor:
    _, mean, variance = tf1.nn.fused_batch_norm(x, gain, gain * 0.0, is_training=True)[:3]
    return normalize_kernel(x, gain, mean, variance)


def normalize_passes(deviations: tf.Tensor, gain: tf.Tensor, shift: tf.Tensor, variance: tf.Tensor) -> tf.Tensor:
    scale = gain * tf.math.rsqrt(variance * 1e-3 + 1e-3)
    return tf.nn.relu(deviations * scale + (gain - shift * scale))


def normalize_kernel(x: tf.Tensor, gain: tf.Tensor, mean: tf.Tensor, variance: tf.Tensor) -> tf.Tensor:
    return tf.nn.relu(tf1.nn.fused_batch_norm(x, gain, mean, mean=mean, variance=variance * 1e-3, is_training=False)[0])


def backward_passes(dy: tf.Tensor, deviations: tf.Tensor, shift: tf.Tensor, variance: tf.Tensor) -> tf.Tensor:
    sum_dy = tf.reduce_sum(dy, [0, 1, 2])
    sum_dy_xc = tf.reduce_sum(dy * deviations, [0, 1, 2]) - shift * sum_dy
    projection = sum_dy_xc * 1e-3
    return (dy - deviations * projection + (shift * projection - sum_dy * 1e-3)) * variance


def backward_kernels(dy: tf.Tensor, x: tf.Tensor, mean: tf.Tensor, variance: tf.Tensor) -> tf.Tensor:
    local, sum_dy_xhat, sum_dy = tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=variance, reserve_space_1=mean, reserve_space_2=variance,
        reserve_space_3=tf.zeros([0]), epsilon=1e-3, is_training=False)[:3]
    correction = tf1.nn.fused_batch_norm(x, sum_dy_xhat * 1e-3, sum_dy * 1e-3, mean=mean, variance=variance,
                                         is_training=False)[0]
    return local + correction


def gradient_kernel(training: bool) -> Callable[[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor], tf.Tensor]:
    """A link: dx of FusedBatchNormGradV3 for dy = t, in training or inference mode."""
    def link(t: tf.Tensor, x: tf.Tensor, mean: tf.Tensor, variance: tf.Tensor) -> tf.Tensor:
        return tf.raw_ops.FusedBatchNormGradV3(
            y_backprop=t, x=x, scale=variance, reserve_space_1=mean, reserve_space_2=variance,
            reserve_space_3=tf.zeros([0]), epsilon=1e-3, is_training=training)[0]
    return link


def measure(link: Callable[[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor], tf.Tensor], shape: list[int],
            towers: int, dtype: tf.DType = tf.float32) -> tuple[float, float]:
    """`link(t, x, mean, variance)` -> the next t, CHAIN times per tower: wall and CPU seconds per
    link and tower. x and t are `dtype`; mean and variance float32, as the fused ops keep them."""
    graph = tf.Graph()
    with graph.as_default():
        outputs, feeds = [], {}
        for k in range(towers):
            with tf.device(f"/cpu:{k}"):
                x = tf1.placeholder(dtype, shape)
                mean, variance = tf.reduce_mean(tf.cast(x, tf.float32), [0, 1, 2]), tf.ones([shape[-1]])
                t = x
                for _ in range(CHAIN):
                    t = link(t, x, mean, variance)
                outputs.append(tf.reduce_sum(t))
                feeds[x] = np.random.default_rng(k).standard_normal(shape).astype(dtype.as_numpy_dtype)
    config = tf1.ConfigProto()
    config.device_count["CPU"] = towers
    with tf1.Session(graph=graph, config=config) as session:
        for _ in range(3):
            session.run(outputs, feeds)
        wall, cpu = [], []
        for _ in range(15):
            start, start_cpu = time.perf_counter(), time.process_time()
            session.run(outputs, feeds)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    per = CHAIN * towers
    return statistics.median(wall) / per, statistics.median(cpu) / per


#: (direction, passes, kernels), each link taking (t, x, mean, variance).
LINKS = (
    ("forward", lambda t, x, mean, variance: forward_passes(t, variance),
     lambda t, x, mean, variance: forward_kernels(t, variance)),
    ("normalize", lambda t, x, mean, variance: normalize_passes(t, variance, mean, variance),
     lambda t, x, mean, variance: normalize_kernel(t, variance, mean, variance)),
    ("backward", backward_passes, backward_kernels),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--shapes", default="8x16x16x32,8x16x16x64,16x32x32x32,16x32x32x64")
    args = parser.parse_args(argv)
    print(f"K={args.towers} virtual CPU devices ({os.cpu_count()} cores); µs per layer and tower")
    print(f"{'':>9} {'shape':>14} {'elements':>9} {'passes wall':>12} {'CPU':>7} {'kernels wall':>13} {'CPU':>7} "
          f"{'kernels/passes':>15}")
    for direction, passes, kernels in LINKS:
        for text in args.shapes.split(","):
            shape = [int(d) for d in text.split("x")]
            p_wall, p_cpu = measure(passes, shape, args.towers)
            k_wall, k_cpu = measure(kernels, shape, args.towers)
            print(f"{direction:>9} {text:>14} {int(np.prod(shape)):>9} {p_wall * 1e6:>12.1f} {p_cpu * 1e6:>7.1f} "
                  f"{k_wall * 1e6:>13.1f} {k_cpu * 1e6:>7.1f} {k_wall / p_wall:>15.2f}")
    print(f"\ngradient kernel alone; µs per layer and tower\n{'dtype':>8} {'shape':>14} {'training wall':>14} {'CPU':>7} "
          f"{'inference wall':>15} {'CPU':>7} {'inference/training':>19}")
    for dtype in (tf.float32, tf.float16):
        for text in args.shapes.split(","):
            shape = [int(d) for d in text.split("x")]
            t_wall, t_cpu = measure(gradient_kernel(True), shape, args.towers, dtype)
            i_wall, i_cpu = measure(gradient_kernel(False), shape, args.towers, dtype)
            print(f"{dtype.name:>8} {text:>14} {t_wall * 1e6:>14.1f} {t_cpu * 1e6:>7.1f} {i_wall * 1e6:>15.1f} "
                  f"{i_cpu * 1e6:>7.1f} {i_wall / t_wall:>19.2f}")


if __name__ == "__main__":
    main()
