"""A classic multi-GPU trainer, written the way TensorFlow 1 trainers were (inception's,
cifar10_multi_gpu_train's): a tower loop over /gpu:i under tower_i name scopes, one tf.data
input split across the towers, batch norm from tf.compat.v1.layers, UPDATE_OPS, averaged
gradients, summaries, a Saver and a tf.compat.v1.Session loop. Nothing in it knows bnrewrite.

    python examples/multi_gpu_train.py --num_gpus 4            # each tower normalizes its own batch
    bnrewrite run examples/multi_gpu_train.py --num_gpus 4     # every tower, the global batch

Without GPUs the towers run on the CPU (soft placement) and bnrewrite sums their statistics
there. With --num_gpus K and --batch_size B, `bnrewrite run` trains like
`--num_gpus 1 --batch_size K*B` (its checkpoint, to float rounding); without it, it does not.
"""

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.compat.v1.layers on TensorFlow >= 2.16
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_gpus", type=int, default=2, help="towers, one per /gpu:i")
    parser.add_argument("--batch_size", type=int, default=2, help="examples per tower per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--train_dir", default="multi_gpu_train_logs", help="checkpoint and summaries")
    parser.add_argument("--updates", choices=["last", "all"], default="last",
                        help="moving-average updates the train op runs: the last tower's (inception) or all towers'")
    parser.add_argument("--session", choices=["session", "supervisor", "monitored"], default="session",
                        help="tf.Session loop, train.Supervisor, or MonitoredTrainingSession with hooks")
    parser.add_argument("--size", type=int, default=8, help="image height and width")
    return parser.parse_args()


def images_and_labels(total: int, size: int) -> tf1.data.Dataset:
    """A fixed synthetic data set: the same examples in the same order for any tower count."""
    rng = np.random.RandomState(0)
    images = rng.randn(total, size, size, 3).astype(np.float32)
    labels = rng.randint(0, 5, size=total).astype(np.int64)
    return tf1.data.Dataset.from_tensor_slices((images, labels))


def tower_loss(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    def init(seed: int) -> tf1.keras.initializers.Initializer:
        return tf1.glorot_uniform_initializer(seed=seed)

    net = tf1.layers.conv2d(images, 8, 3, padding="same", use_bias=False, kernel_initializer=init(1), name="conv1")
    net = tf1.layers.batch_normalization(net, training=True, momentum=0.9, name="bn1")
    net = tf.nn.relu(net)
    net = tf1.layers.conv2d(net, 8, 3, padding="same", use_bias=False, kernel_initializer=init(2), name="conv2")
    net = tf1.layers.batch_normalization(net, training=True, momentum=0.9, name="bn2")
    net = tf.reduce_mean(tf.nn.relu(net), axis=[1, 2])
    logits = tf1.layers.dense(net, 5, kernel_initializer=init(3), name="logits")
    return tf.reduce_mean(tf1.losses.sparse_softmax_cross_entropy(labels, logits, reduction="none"))


def average_gradients(tower_grads: list) -> list:
    averaged = []
    for grads_and_vars in zip(*tower_grads):
        grads = tf.stack([g for g, _ in grads_and_vars])
        averaged.append((tf.reduce_mean(grads, axis=0), grads_and_vars[0][1]))
    return averaged


def build(args: argparse.Namespace) -> dict:
    global_batch = args.num_gpus * args.batch_size
    with tf.device("/cpu:0"):
        global_step = tf1.train.get_or_create_global_step()
        data = images_and_labels(global_batch * args.steps, args.size).batch(global_batch).repeat()
        images, labels = tf1.data.make_one_shot_iterator(data).get_next()
        image_splits, label_splits = tf.split(images, args.num_gpus), tf.split(labels, args.num_gpus)
        optimizer = tf1.train.MomentumOptimizer(0.1, 0.9)
        tower_grads, losses = [], []
        with tf1.variable_scope(tf1.get_variable_scope()):
            for i in range(args.num_gpus):
                with tf.device(f"/gpu:{i}"), tf.name_scope(f"tower_{i}") as scope:
                    loss = tower_loss(image_splits[i], label_splits[i])
                    tf1.get_variable_scope().reuse_variables()
                    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope)
                    if args.updates == "last":
                        batchnorm_updates = updates  # inception's trainer keeps the last tower's
                    tower_grads.append(optimizer.compute_gradients(loss))
                    losses.append(loss)
        if args.updates == "all":
            batchnorm_updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        loss = tf.add_n(losses) / args.num_gpus
        apply = optimizer.apply_gradients(average_gradients(tower_grads), global_step=global_step)
        train_op = tf.group(apply, *batchnorm_updates)
        tf1.summary.scalar("loss", loss)
    return {"train_op": train_op, "loss": loss, "global_step": global_step, "summaries": tf1.summary.merge_all()}


def train_with_session(args: argparse.Namespace, handles: dict) -> None:
    config = tf1.ConfigProto(allow_soft_placement=True)
    sess = tf1.Session(config=config)
    sess.run(tf1.global_variables_initializer())  # built after the session, as inception's trainer does
    saver = tf1.train.Saver()
    writer = tf1.summary.FileWriter(args.train_dir, sess.graph)
    for step in range(args.steps):
        _, loss, summary = sess.run([handles["train_op"], handles["loss"], handles["summaries"]])
        writer.add_summary(summary, step)
        print(f"step {step}: loss {loss:.6f}")
    writer.close()
    saver.save(sess, os.path.join(args.train_dir, "model.ckpt"), global_step=handles["global_step"])
    sess.close()


def train_with_supervisor(args: argparse.Namespace, handles: dict) -> None:
    saver = tf1.train.Saver()
    supervisor = tf1.train.Supervisor(logdir=args.train_dir, saver=saver, save_model_secs=0, save_summaries_secs=0,
                                      global_step=handles["global_step"])
    with supervisor.managed_session(config=tf1.ConfigProto(allow_soft_placement=True)) as sess:
        for step in range(args.steps):
            _, loss = sess.run([handles["train_op"], handles["loss"]])
            print(f"step {step}: loss {loss:.6f}")
        saver.save(sess, os.path.join(args.train_dir, "model.ckpt"), global_step=handles["global_step"])


def train_monitored(args: argparse.Namespace, handles: dict) -> None:
    hooks = [tf1.train.StopAtStepHook(last_step=args.steps)]
    with tf1.train.MonitoredTrainingSession(
            checkpoint_dir=args.train_dir, hooks=hooks, save_checkpoint_steps=args.steps, save_summaries_steps=None,
            save_summaries_secs=None, log_step_count_steps=0,
            config=tf1.ConfigProto(allow_soft_placement=True)) as sess:
        step = 0
        while not sess.should_stop():
            _, loss = sess.run([handles["train_op"], handles["loss"]])
            print(f"step {step}: loss {loss:.6f}")
            step += 1


def main() -> None:
    args = parse_args()
    tf1.disable_eager_execution()
    handles = build(args)
    {"session": train_with_session, "supervisor": train_with_supervisor, "monitored": train_monitored}[args.session](
        args, handles)


if __name__ == "__main__":
    main()
