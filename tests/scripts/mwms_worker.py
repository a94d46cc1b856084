"""One worker of a real MultiWorkerMirroredStrategy cluster in tf.compat.v1 graph mode (issue 49, 4).

TF_CONFIG names the 2 workers on loopback ports and this task; the strategy
(`tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy`, one replica per worker on its
CPU) builds the step with `call_for_each_replica`: conv -> tf.compat.v1.layers batch norm (training,
its updates in the train op) -> ReLU -> pooled squared error, gradients all-reduced by the strategy's
own collectives; a plain Session on the worker's `tf.distribute.Server` trains STEPS steps, worker i
fed examples i*B..(i+1)*B of each step's batch. Writes OUT/worker<I>.npz: the losses and every
variable as the strategy reads it (moving statistics: their mean over the workers).

`--reference`: OUT/one.npz, one device fed all 2*B examples (no strategy), and OUT/perturbed.npz,
the same with the images scaled by 1 + 1e-7 (the noise floor).

Usage: mwms_worker.py --task I --hosts JSON --out DIR | mwms_worker.py --reference --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1
BATCH, STEPS, WORKERS = 4, 3, 2
TARGET = np.array([1.0, -1.0, 0.5, 2.0], np.float32)


def _images(scale: float = 1.0) -> np.ndarray:
    return np.random.RandomState(1).normal(1, 2, (STEPS, WORKERS * BATCH, 6, 6, 3)).astype(np.float32) * np.float32(scale)


def _step(x: tf.Tensor, replicas: int) -> tuple[tf.Operation, tf.Tensor]:
    """The model and its train op (the loss divided by the replicas: the strategy sums the gradients)."""
    kernel = np.linspace(-0.3, 0.3, 108, dtype=np.float32).reshape(3, 3, 3, 4)
    with tf1.variable_scope("net", reuse=tf1.AUTO_REUSE):
        h = tf1.layers.conv2d(x, 4, 3, padding="same", use_bias=False, name="conv",
                              kernel_initializer=tf1.constant_initializer(kernel))
        h = tf1.layers.batch_normalization(h, momentum=0.9, training=True, name="bn")
        loss = tf.reduce_mean(tf.square(tf.reduce_mean(tf.nn.relu(h), [1, 2]) - TARGET))
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        return tf1.train.GradientDescentOptimizer(0.1).minimize(loss / replicas), loss


def _trained(session: tf1.Session, train_op: tf.Operation, loss: tf.Tensor, x: tf.Tensor, rows: slice,
             images: np.ndarray) -> dict[str, np.ndarray]:
    session.run(tf1.global_variables_initializer())
    losses = [session.run([train_op, loss], {x: images[step, rows]})[1] for step in range(STEPS)]
    return {"losses": np.array(losses), **{v.name: session.run(v) for v in tf1.global_variables()}}


def worker(task: int, hosts: list[str], out: str) -> None:
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": task}})
    tf1.disable_eager_execution()
    strategy = tf1.distribute.experimental.MultiWorkerMirroredStrategy()
    config = strategy.update_config_proto(tf1.ConfigProto())
    server = tf.distribute.Server(strategy.cluster_resolver.cluster_spec(), job_name="worker", task_index=task,
                                  config=config, start=True)
    with strategy.scope():
        x = tf1.placeholder(tf.float32, [BATCH, 6, 6, 3], name="images")
        train_op, loss = strategy.extended.call_for_each_replica(_step, args=(x, strategy.num_replicas_in_sync))
    with tf1.Session(server.target, config=config) as session:
        values = _trained(session, train_op, loss, x, slice(task * BATCH, (task + 1) * BATCH), _images())
    np.savez(os.path.join(out, f"worker{task}.npz"), **values)
    sys.stdout.flush()
    os._exit(0)  # a tf.distribute.Server cannot be stopped: skip the interpreter's teardown


def references() -> dict[str, dict[str, np.ndarray]]:
    """"one" and "perturbed" (see the module docstring), each in a graph of its own: callable in a
    test's process (no eager switch)."""
    out = {}
    for name, scale in (("one", 1.0), ("perturbed", 1.0 + 1e-7)):
        with tf.Graph().as_default(), tf1.Session() as session:
            x = tf1.placeholder(tf.float32, [WORKERS * BATCH, 6, 6, 3])
            train_op, loss = _step(x, 1)
            out[name] = _trained(session, train_op, loss, x, slice(None), _images(scale))
    return out


def reference(out: str) -> None:
    for name, values in references().items():
        np.savez(os.path.join(out, f"{name}.npz"), **values)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", type=int)
    parser.add_argument("--hosts")
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    if args.reference:
        reference(args.out)
    else:
        worker(args.task, json.loads(args.hosts), args.out)
