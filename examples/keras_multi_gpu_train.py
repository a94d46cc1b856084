"""A Keras model trained on several GPUs in graph mode, the way people wrote it from 2018 on: a
tf_keras functional model built once on its own Input, called on each GPU's share of the batch
under tf.device, the towers' gradients averaged, `model.get_updates_for` of every tower in the
train op, a tf.compat.v1.Session loop, `save_weights` at the end. Nothing in it knows bnrewrite.

    python examples/keras_multi_gpu_train.py --num_gpus 2            # each tower, its own batch
    bnrewrite run examples/keras_multi_gpu_train.py --num_gpus 2     # every tower, the global batch

Without GPUs the towers run on as many virtual CPUs. With --num_gpus K and --batch_size B,
`bnrewrite run` trains like `--num_gpus 1 --batch_size K*B` (its weights and moving statistics,
to float rounding); without it, it does not. The call that built the model on its Input is no
tower: nothing trains through it (docs/how-it-works.md, "Only live work is a tower").
"""

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf_keras, not Keras 3, on TensorFlow >= 2.16
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

tf1 = tf.compat.v1
CLASSES, SIZE = 4, 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_gpus", type=int, default=2, help="towers, one per GPU (or virtual CPU)")
    parser.add_argument("--batch_size", type=int, default=4, help="examples per tower per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--weights", default="keras_multi_gpu_train_logs/weights", help="save_weights' checkpoint prefix")
    return parser.parse_args()


def build_model() -> keras.Model:
    """Two convolutions with batch norm, seeded so that every run starts from the same weights."""
    layers = keras.layers
    inputs = keras.Input((SIZE, SIZE, 3))
    x = inputs
    for k, filters in enumerate((8, 8)):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"conv{k + 1}",
                          kernel_initializer=keras.initializers.HeNormal(seed=k))(x)
        x = layers.ReLU()(layers.BatchNormalization(momentum=0.9, name=f"bn{k + 1}")(x))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(CLASSES, name="logits", kernel_initializer=keras.initializers.GlorotNormal(seed=9))(x))


def main() -> None:
    args = parse_args()
    tf1.disable_eager_execution()
    gpus = len(tf.config.list_physical_devices("GPU"))
    device = "gpu" if gpus >= args.num_gpus else "cpu"
    config = tf1.ConfigProto(device_count={"CPU": 1 if device == "gpu" else args.num_gpus})
    model = build_model()
    total = args.num_gpus * args.batch_size
    images = tf1.placeholder(tf.float32, [total, SIZE, SIZE, 3], name="images")
    labels = tf1.placeholder(tf.int32, [total], name="labels")
    optimizer = tf1.train.MomentumOptimizer(0.05, 0.9)
    grads, updates, losses = [], [], []
    for i in range(args.num_gpus):
        with tf.device(f"/{device}:{i}"), tf1.name_scope(f"tower_{i}"):
            share = slice(i * args.batch_size, (i + 1) * args.batch_size)
            part = images[share]
            logits = model(part, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels[share], logits=logits))
            grads.append(optimizer.compute_gradients(loss, model.trainable_weights))
            updates += model.get_updates_for(part)
            losses.append(loss)
    averaged = [(tf.add_n([g[j][0] for g in grads]) / args.num_gpus, grads[0][j][1]) for j in range(len(grads[0]))]
    train_op = tf.group(optimizer.apply_gradients(averaged), *updates, name="train_op")
    mean_loss = tf.add_n(losses) / args.num_gpus
    rng = np.random.RandomState(0)
    data = rng.normal(0.5, 1.0, (args.steps * total, SIZE, SIZE, 3)).astype(np.float32)
    targets = rng.randint(0, CLASSES, args.steps * total)
    with tf1.Session(config=config) as sess:
        tf1.keras.backend.set_session(sess)  # save_weights reads the variables through it
        sess.run(tf1.global_variables_initializer())
        for step in range(args.steps):
            batch = slice(step * total, (step + 1) * total)
            value, _ = sess.run([mean_loss, train_op], {images: data[batch], labels: targets[batch]})
            print(f"step {step}: loss {value:.6f}")
        model.save_weights(args.weights)


if __name__ == "__main__":
    main()
