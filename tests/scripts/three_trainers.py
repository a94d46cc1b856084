"""A trainer script that trains examples/multi_gpu_train.py's model three times, each in a graph
of its own and through another session creator: a tf.Session loop (init op and Saver built
after the session), train.Supervisor, and MonitoredTrainingSession with StopAtStepHook and
CheckpointSaverHook (a finalized graph). Then it evaluates the last checkpoint in an eval
graph (batch norm in inference mode) and prints the eval loss. Checkpoints go to
TRAIN_DIR/session, TRAIN_DIR/supervisor, TRAIN_DIR/monitored.
"""

import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # set by the script itself, before TensorFlow is imported
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import tensorflow as tf  # noqa: E402

import multi_gpu_train as trainer  # noqa: E402

tf1 = tf.compat.v1


def evaluate(args, checkpoint: str) -> float:
    with tf.Graph().as_default():
        images, labels = tf1.data.make_one_shot_iterator(
            trainer.images_and_labels(8, args.size).batch(8)).get_next()
        net = tf1.layers.conv2d(images, 8, 3, padding="same", use_bias=False, name="conv1")
        net = tf.nn.relu(tf1.layers.batch_normalization(net, training=False, name="bn1"))
        net = tf1.layers.conv2d(net, 8, 3, padding="same", use_bias=False, name="conv2")
        net = tf.reduce_mean(tf.nn.relu(tf1.layers.batch_normalization(net, training=False, name="bn2")), axis=[1, 2])
        logits = tf1.layers.dense(net, 5, name="logits")
        loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
        saver = tf1.train.Saver(tf1.global_variables())
        with tf1.Session() as sess:
            saver.restore(sess, checkpoint)
            return float(sess.run(loss))


def main() -> None:
    sys.argv += [] if "--train_dir" in sys.argv else ["--train_dir", "three_trainers"]
    args = trainer.parse_args()
    tf1.disable_eager_execution()
    root = args.train_dir
    for mode, train in (("session", trainer.train_with_session), ("supervisor", trainer.train_with_supervisor),
                        ("monitored", trainer.train_monitored)):
        args.train_dir = os.path.join(root, mode)
        with tf.Graph().as_default():
            train(args, trainer.build(args))
    print(f"eval loss {evaluate(args, tf.train.latest_checkpoint(os.path.join(root, 'monitored'))):.6f}")


if __name__ == "__main__":
    main()
