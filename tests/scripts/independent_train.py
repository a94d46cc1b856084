"""Two towers that train independent models (tf_cnn_benchmarks' --variable_update=independent):
each tower has its own variables and its own optimizer. bnrewrite refuses to couple them.
Saves a checkpoint in --train_dir after the loop."""

import argparse
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_dir", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    tf1.disable_eager_execution()
    rng = np.random.RandomState(0)
    train_ops = []
    for i in range(2):
        with tf.device(f"/gpu:{i}"), tf1.variable_scope(f"tower_{i}"):
            images = tf.constant(rng.randn(2, 6, 6, 3).astype(np.float32))
            net = tf1.layers.conv2d(images, 4, 3, name="conv")
            net = tf1.layers.batch_normalization(net, training=True, name="bn")
            loss = tf.reduce_mean(tf.square(net))
            with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, f"tower_{i}")):
                train_ops.append(tf1.train.GradientDescentOptimizer(0.1).minimize(loss))
    train_op = tf.group(*train_ops)
    with tf1.Session(config=tf1.ConfigProto(allow_soft_placement=True)) as sess:
        sess.run(tf1.global_variables_initializer())
        for step in range(args.steps):
            sess.run(train_op)
            print(f"step {step}")
        tf1.train.Saver().save(sess, os.path.join(args.train_dir, "model.ckpt"))


if __name__ == "__main__":
    main()
