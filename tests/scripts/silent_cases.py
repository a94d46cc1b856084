"""Trainers that bnrewrite once left unsynchronized without a word (issue 38), trained in turn;
every variable (and the step losses) of every case goes to one .npz.

* cifar10: the cifar10 multi-GPU tutorial's tower trainer, whose `_activation_summary` calls
  tf.nn.zero_fraction (a control-flow-v2 cond) on each layer's output: two conv layers with
  fused batch norm and a dense one with tf.nn.moments, each followed by its summary.
* interactive: the notebook habit: `InteractiveSession()` first, the model built afterwards.
* spawn: the cifar10 model trained in a multiprocessing 'spawn' child (under `bnrewrite run`
  only; imported, `train(case, ...)` trains it in the calling process).
* float64: dense layers in float64 with batch norm by tf.nn.moments.

Called with --towers 1 --batch K*B it trains the one-device reference of the same models
(same variable names and initial values, the same global batch per step).
Usage: silent_cases.py OUT.npz [--towers K] [--batch B]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import warnings
import zlib

import numpy as np
import tensorflow as tf
from tf_keras.src.legacy_tf_layers import normalization

tf1 = tf.compat.v1
CASES = ("cifar10", "interactive", "spawn", "float64")
STEPS, CLASSES, IMAGE = 2, 3, 4


def _initializer(name: str, shape: list[int], dtype: tf.DType) -> tf1.constant_initializer:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return tf1.constant_initializer(rng.normal(0.0, 0.5, shape).astype(dtype.as_numpy_dtype))


def _variable(name: str, shape: list[int], dtype: tf.DType = tf.float32) -> tf.Variable:
    with tf.device("/cpu:0"):
        return tf1.get_variable(name, shape, dtype, initializer=_initializer(name, shape, dtype))


def _batch_norm(x: tf.Tensor, name: str, fused: bool) -> tf.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normalization.batch_normalization(x, momentum=0.9, epsilon=1e-3, training=True, fused=fused, name=name)


def _activation_summary(x: tf.Tensor) -> tf.Tensor:
    """cifar10_multi_gpu_train's: a histogram and the sparsity (tf.nn.zero_fraction)."""
    tf1.summary.histogram(x.op.name + "/activations", x)
    return tf1.summary.scalar(x.op.name + "/sparsity", tf.nn.zero_fraction(x))


def _cifar10_tower(images: tf.Tensor) -> tf.Tensor:
    x = images
    for i in (1, 2):
        with tf1.variable_scope(f"conv{i}") as scope:
            kernel = _variable("weights", [3, 3, x.shape[-1], 4])
            x = tf.nn.relu(_batch_norm(tf.nn.conv2d(x, kernel, 1, "SAME"), "bn", fused=True), name=scope.name)
            _activation_summary(x)
    with tf1.variable_scope("local3") as scope:
        flat = tf.reshape(x, [x.shape[0], -1])
        dense = tf.matmul(flat, _variable("weights", [flat.shape[-1], 6]))
        x = tf.nn.relu(_batch_norm(dense, "bn", fused=False), name=scope.name)  # 2-D: tf.nn.moments
        _activation_summary(x)
    with tf1.variable_scope("softmax_linear"):
        return tf.matmul(x, _variable("weights", [6, CLASSES])) + _variable("biases", [CLASSES])


def _float64_tower(images: tf.Tensor) -> tf.Tensor:
    x = tf.reshape(images, [images.shape[0], -1])
    for i in (1, 2):
        with tf1.variable_scope(f"dense{i}"):
            x = tf.nn.relu(_batch_norm(tf.matmul(x, _variable("weights", [x.shape[-1], 5], tf.float64)), "bn", False))
    return tf.matmul(x, _variable("logits", [5, CLASSES], tf.float64))


def build(towers: int, batch: int, dtype: tf.DType, tower_fn) -> tuple[list, tf.Tensor, list, tf.Operation, list]:
    """Towers tower_i on /cpu:i sharing variables on /cpu:0, gradients averaged, every tower's
    UPDATE_OPS in the train op: (per-tower (images, labels), mean loss, summaries, train op,
    per-tower losses)."""
    inputs, losses, grads = [], [], []
    optimizer = tf1.train.GradientDescentOptimizer(0.5)
    for i in range(towers):
        with tf.device(f"/cpu:{i}"), tf.name_scope(f"tower_{i}"), tf1.variable_scope(tf1.get_variable_scope(), reuse=i > 0):
            images = tf1.placeholder(dtype, [batch, IMAGE, IMAGE, 3], name="images")
            labels = tf1.placeholder(tf.int32, [batch], name="labels")
            logits = tower_fn(images)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
            inputs.append((images, labels))
            losses.append(loss)
            grads.append(optimizer.compute_gradients(loss))
    return inputs, tf.add_n(losses) / towers, tf1.get_collection(tf1.GraphKeys.SUMMARIES), apply(optimizer, grads), losses


def tower_gradients(optimizer: tf1.train.Optimizer, losses: list[tf.Tensor]) -> list:
    """compute_gradients of each tower's loss on its device: a further optimizer of built towers."""
    grads = []
    for i, loss in enumerate(losses):
        with tf.device(f"/cpu:{i}"):
            grads.append(optimizer.compute_gradients(loss))
    return grads


def apply(optimizer: tf1.train.Optimizer, grads: list) -> tf.Operation:
    """The towers' gradients averaged and applied, with this model's UPDATE_OPS (every tower's)."""
    averaged = [(tf.add_n([g for g, _ in pairs]) / len(grads), pairs[0][1]) for pairs in zip(*grads)
                if pairs[0][0] is not None]
    scope = tf1.get_default_graph().get_name_scope()  # this model's updates only, when a graph holds two
    return tf.group(optimizer.apply_gradients(averaged), *tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope))


def _batches(total: int, dtype: tf.DType) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(38)
    return [(rng.normal(0.5, 1.0, [total, IMAGE, IMAGE, 3]).astype(dtype.as_numpy_dtype),
             rng.integers(0, CLASSES, total).astype(np.int32)) for _ in range(STEPS)]


def train(case: str, towers: int, batch: int) -> dict[str, np.ndarray]:
    """Train `case` in a graph of its own in this process: {variable name: value, "loss": losses}."""
    dtype = tf.float64 if case == "float64" else tf.float32
    tower_fn = _float64_tower if case == "float64" else _cifar10_tower
    config = tf1.ConfigProto(device_count={"CPU": towers})
    with tf.Graph().as_default() as graph:
        sess = tf1.InteractiveSession(config=config) if case == "interactive" else None  # before the model
        inputs, loss, summaries, train_op, _ = build(towers, batch, dtype, tower_fn)
        init = tf1.global_variables_initializer()
        sess = sess or tf1.Session(graph=graph, config=config)
        sess.run(init)
        losses = []
        for images, labels in _batches(towers * batch, dtype):
            feed = {}
            for k, (x, y) in enumerate(inputs):
                feed[x], feed[y] = images[k * batch:(k + 1) * batch], labels[k * batch:(k + 1) * batch]
            losses.append(sess.run([loss, train_op, summaries], feed)[0])
        values = {v.op.name: sess.run(v) for v in tf1.global_variables()}
        sess.close()
    return {**values, "loss": np.asarray(losses)}


def _child(path: str, towers: int, batch: int) -> None:
    np.savez(path, **train("cifar10", towers, batch))


def _in_spawned_child(towers: int, batch: int) -> dict[str, np.ndarray]:
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "child.npz")
        child = multiprocessing.get_context("spawn").Process(target=_child, args=(path, towers, batch))
        child.start()
        child.join()
        if child.exitcode != 0:
            sys.exit(f"the spawned child exited with {child.exitcode}")
        with np.load(path) as saved:
            return dict(saved)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--towers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    tf1.disable_eager_execution()
    found = {}
    for case in CASES:
        values = _in_spawned_child(args.towers, args.batch) if case == "spawn" else train(case, args.towers, args.batch)
        found.update({f"{case}/{name}": value for name, value in values.items()})
    np.savez(args.out, **found)


if __name__ == "__main__":
    main()
