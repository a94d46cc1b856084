"""A multi-tower InceptionV3 trainer in the shape of tensorflow/models' inception_train.train(),
for timing what `bnrewrite run` adds to a whole training process (issue 42).

    python tools/inception_train.py [--towers 2] [--batch 2] [--image 107] [--steps 2] [--out DIR]
    bnrewrite run tools/inception_train.py [same arguments]

One tf_keras.applications.InceptionV3 (weights=None, 10 classes) called per tower on its own
virtual CPU with training=True, gradients averaged, momentum SGD, the towers' batch-norm
updates in the train op (as inception_train groups them), a Saver; then `--steps` steps, each
followed by a checkpoint, as the trainer writes one. Prints the seconds of step 0 (session,
init, first step) and of the steps after it, as the trainer prints its step times.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1


def build(towers: int, batch: int, image: int) -> tuple[tf.Operation, tf.Tensor, list[tuple[tf.Tensor, tf.Tensor]]]:
    """The trainer's graph in the default graph: (train op, mean loss, each tower's (images, labels))."""
    import tf_keras

    opt = tf1.train.MomentumOptimizer(0.01, 0.9)
    model, grads, losses, feeds = None, [], [], []
    for k in range(towers):
        with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"):
            images = tf1.placeholder(tf.float32, [batch, image, image, 3], name="images")
            labels = tf1.placeholder(tf.int32, [batch], name="labels")
            if model is None:
                model = tf_keras.applications.InceptionV3(weights=None, input_shape=(image, image, 3),
                                                          classes=10, classifier_activation=None)
            logits = model(images, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
            grads.append(opt.compute_gradients(loss, var_list=model.trainable_weights))
            losses.append(loss)
            feeds.append((images, labels))
    with tf.device("/cpu:0"):
        averaged = [(tf.add_n([g for g, _ in per_var]) / towers, per_var[0][1]) for per_var in zip(*grads)]
        loss = tf.add_n(losses) / towers
        updates = [u for k in range(towers) for u in model.get_updates_for(feeds[k][0])]
        train_op = tf.group(opt.apply_gradients(averaged), *updates, name="train_op")
    return train_op, loss, feeds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--towers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--image", type=int, default=107)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    tf1.disable_eager_execution()
    start = time.perf_counter()
    train_op, loss, feeds = build(args.towers, args.batch, args.image)
    saver = tf1.train.Saver()
    init = tf1.global_variables_initializer()
    rng = np.random.RandomState(0)
    config = tf1.ConfigProto(device_count={"CPU": args.towers})
    out = args.out or tempfile.mkdtemp()
    with tf1.Session(config=config) as session:
        session.run(init)
        for step in range(args.steps):
            feed = {x: rng.standard_normal(x.shape.as_list()).astype(np.float32) for x, _ in feeds}
            feed.update({y: rng.randint(0, 10, args.batch) for _, y in feeds})
            value = session.run([train_op, loss], feed)[1]
            saver.save(session, os.path.join(out, "model.ckpt"), global_step=step)
            print(f"step {step}: loss {value:.4f}, {time.perf_counter() - start:.2f} s since the graph was started",
                  flush=True)
            start = time.perf_counter()
    return 0


if __name__ == "__main__":
    sys.exit(main())
