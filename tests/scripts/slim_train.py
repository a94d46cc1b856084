"""TF-Slim's train_image_classifier.py way: model_deploy-style clones (clone_i name scopes on
/device:GPU:i, variables on the CPU, each clone's loss divided by the number of clones, their
gradients summed), clone 0's UPDATE_OPS grouped with the gradient update, `train_tensor` an
identity of the loss under that group, and slim.learning.train, which makes its own
Supervisor and session and saves a checkpoint in --train_dir when it stops.
"""

import argparse
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import tensorflow as tf  # noqa: E402
import tf_slim as slim  # noqa: E402

import multi_gpu_train as trainer  # noqa: E402

tf1 = tf.compat.v1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_clones", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--train_dir", required=True)
    args = parser.parse_args()
    tf1.disable_eager_execution()
    k = args.num_clones
    with tf.device("/cpu:0"):
        global_step = tf1.train.get_or_create_global_step()
        data = trainer.images_and_labels(k * args.batch_size * args.steps, args.size).batch(k * args.batch_size)
        images, labels = tf1.data.make_one_shot_iterator(data.repeat()).get_next()
        images, labels = tf.split(images, k), tf.split(labels, k)
        optimizer = tf1.train.MomentumOptimizer(0.1, 0.9)
    clone_grads, losses = [], []
    for i in range(k):
        with tf1.variable_scope(tf1.get_variable_scope(), reuse=i > 0), tf.name_scope(f"clone_{i}") as scope, \
                tf.device(f"/device:GPU:{i}"):
            with slim.arg_scope([slim.model_variable, slim.variable], device="/device:CPU:0"):
                loss = trainer.tower_loss(images[i], labels[i]) / k
            losses.append(loss)
            if i == 0:
                update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope)  # model_deploy keeps clone 0's
            clone_grads.append(optimizer.compute_gradients(loss))
    grads = [(tf.add_n([g for g, _ in pairs]), pairs[0][1]) for pairs in zip(*clone_grads)]
    update_op = tf.group(optimizer.apply_gradients(grads, global_step=global_step), *update_ops)
    with tf.control_dependencies([update_op]):
        train_tensor = tf.identity(tf.add_n(losses), name="train_op")
    slim.learning.train(train_tensor, args.train_dir, number_of_steps=args.steps, save_summaries_secs=0,
                        save_interval_secs=0, log_every_n_steps=1,
                        session_config=tf1.ConfigProto(allow_soft_placement=True))


if __name__ == "__main__":
    main()
