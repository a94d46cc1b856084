"""One-device programs that are not multi-tower, each trained a few steps the usual way.

`python one_device_cases.py OUT.npz [CASE ...]` builds every case (or those named) in a graph of
its own, trains it with its own session and writes every variable to OUT.npz as CASE/variable.
Under `bnrewrite run` each graph must run exactly as under python (issues 38, 49): layers of one
model, two streams, a Siamese net, a GAN, an encoder/decoder, a mean teacher, an ensemble, a Keras
Sequential's fit, and one network applied to two batches inside one summed loss (semi-supervised,
two cross-entropies, a discriminator step, per-domain passes, tf.add_n, a mean over a concat, a
tape, a Keras model calling its encoder on two inputs).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.compat.v1.layers on TF >= 2.16

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

tf1 = tf.compat.v1

STEPS = 3
BATCH = 4
layers = tf1.layers


def _images(seed: int, channels: int = 3) -> np.ndarray:
    return np.random.RandomState(seed).normal(1.0, 2.0, (STEPS, BATCH, 6, 6, channels)).astype(np.float32)


def _block(x: tf.Tensor, filters: int, name: str | None = None) -> tf.Tensor:
    """conv -> batch norm (training) -> ReLU, with the layers' default names unless `name`."""
    with tf1.variable_scope(name) if name else contextlib.nullcontext():
        x = layers.conv2d(x, filters, 3, padding="same", use_bias=False)
        return tf.nn.relu(layers.batch_normalization(x, training=True))


def _updates(which: Callable[[tf.Operation], bool] = lambda update: True) -> list[tf.Operation]:
    return [update for update in tf1.get_collection(tf1.GraphKeys.UPDATE_OPS) if which(update)]


def _train(loss: tf.Tensor, feeds: list[tuple[tf.Tensor, np.ndarray]],
           which: Callable[[tf.Operation], bool] = lambda update: True) -> dict[str, np.ndarray]:
    """Momentum on `loss` with (`which` of) UPDATE_OPS in the train op, STEPS steps in a Session loop."""
    with tf.control_dependencies(_updates(which)):
        train_op = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    return _loop(train_op, feeds)


def _loop(train_op: object, feeds: list[tuple[tf.Tensor, np.ndarray]]) -> dict[str, np.ndarray]:
    """STEPS runs of `train_op` in a plain Session loop, each fed its step's slice; every variable after."""
    init = tf1.global_variables_initializer()
    with tf1.Session() as sess:
        sess.run(init)
        for step in range(STEPS):
            sess.run(train_op, {p: value[step] for p, value in feeds})
        return dict(zip([v.op.name for v in tf1.global_variables()], sess.run(tf1.global_variables())))


def two_plain_layers() -> dict[str, np.ndarray]:
    """The plainest one-GPU trainer: two unscoped tf.layers batch norms, one after the other."""
    images = tf1.placeholder(tf.float32, [BATCH, 6, 6, 3])
    labels = tf1.placeholder(tf.int32, [BATCH])
    x = _block(_block(images, 4), 4)
    logits = layers.dense(tf1.layers.flatten(x), 3)
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    return _train(loss, [(images, _images(1)), (labels, np.arange(STEPS * BATCH).reshape(STEPS, BATCH) % 3)])


def named_layers() -> dict[str, np.ndarray]:
    """Layers named bn1 and bn2 at the top level."""
    images = tf1.placeholder(tf.float32, [BATCH, 6, 6, 3])
    x = tf.nn.relu(layers.batch_normalization(layers.conv2d(images, 4, 3, use_bias=False), training=True, name="bn1"))
    x = tf.nn.relu(layers.batch_normalization(layers.conv2d(x, 4, 3, use_bias=False), training=True, name="bn2"))
    return _train(tf.reduce_mean(tf.square(x - 0.5)), [(images, _images(2))])


def two_streams() -> dict[str, np.ndarray]:
    """rgb/ and flow/ sub-networks with their own variables, fused at the head."""
    rgb = tf1.placeholder(tf.float32, [BATCH, 6, 6, 3])
    flow = tf1.placeholder(tf.float32, [BATCH, 6, 6, 2])
    features = []
    for x, scope in ((rgb, "rgb"), (flow, "flow")):
        with tf1.variable_scope(scope):
            features.append(tf.reduce_mean(_block(_block(x, 4, "a"), 4, "b"), [1, 2]))
    logits = layers.dense(tf.concat(features, 1), 2)
    return _train(tf.reduce_mean(tf.square(logits - 1.0)), [(rgb, _images(3)), (flow, _images(4, 2))])


def siamese() -> dict[str, np.ndarray]:
    """One network applied to two batches (its variable scope re-entered with reuse), a contrastive loss."""
    left = tf1.placeholder(tf.float32, [BATCH, 6, 6, 3])
    right = tf1.placeholder(tf.float32, [BATCH, 6, 6, 3])
    outputs = []
    for x in (left, right):
        with tf1.variable_scope("net", reuse=tf1.AUTO_REUSE):
            outputs.append(tf.reduce_mean(_block(_block(x, 4, "a"), 4, "b"), [1, 2]))
    loss = tf.reduce_mean(tf.square(outputs[0] - outputs[1]) - 0.1 * tf.abs(outputs[0]))
    return _train(loss, [(left, _images(5)), (right, _images(6))], _first_application)


def _first_application(update: tf.Operation) -> bool:
    """The moving averages follow the first application of a network applied twice: both would
    update one variable in an order TensorFlow leaves open, and runs would differ from each other."""
    return not update.name.split("/", 1)[0].endswith("_1")


def gan() -> dict[str, np.ndarray]:
    """A generator with batch norm feeding a discriminator applied to real and generated images."""
    real = tf1.placeholder(tf.float32, [BATCH, 6, 6, 3])
    noise = tf1.placeholder(tf.float32, [BATCH, 6, 6, 3])

    def discriminator(x: tf.Tensor) -> tf.Tensor:
        with tf1.variable_scope("discriminator", reuse=tf1.AUTO_REUSE):
            return layers.dense(tf.reduce_mean(_block(_block(x, 4, "a"), 4, "b"), [1, 2]), 1)

    with tf1.variable_scope("generator"):
        fake = layers.conv2d(_block(noise, 4, "a"), 3, 3, padding="same")
    real_logits, fake_logits = discriminator(real), discriminator(fake)
    xent = tf.nn.sigmoid_cross_entropy_with_logits
    d_loss = tf.reduce_mean(xent(labels=tf.ones_like(real_logits), logits=real_logits)) + tf.reduce_mean(
        xent(labels=tf.zeros_like(fake_logits), logits=fake_logits))
    g_loss = tf.reduce_mean(xent(labels=tf.ones_like(fake_logits), logits=fake_logits))
    d_vars = tf1.trainable_variables("discriminator")
    g_vars = tf1.trainable_variables("generator")
    with tf.control_dependencies(_updates(_first_application)):
        train_op = tf.group(tf1.train.AdamOptimizer(1e-2).minimize(d_loss, var_list=d_vars),
                            tf1.train.AdamOptimizer(1e-2).minimize(g_loss, var_list=g_vars))
    return _loop(train_op, [(real, _images(7)), (noise, _images(8))])


def encoder_decoder() -> dict[str, np.ndarray]:
    """One batch norm under encoder/, one under decoder/."""
    images = tf1.placeholder(tf.float32, [BATCH, 6, 6, 3])
    code = _block(images, 4, "encoder")
    with tf1.variable_scope("decoder"):
        x = tf.nn.relu(layers.batch_normalization(layers.conv2d_transpose(code, 4, 3, padding="same"), training=True))
        out = layers.conv2d(x, 3, 1)
    return _train(tf.reduce_mean(tf.square(out - images)), [(images, _images(9))])


def mean_teacher() -> dict[str, np.ndarray]:
    """student/ and teacher/ copies; the teacher an exponential moving average of the student."""
    images = tf1.placeholder(tf.float32, [BATCH, 6, 6, 3])
    noisy = images + tf1.random_normal(tf.shape(images), stddev=0.1, seed=1)
    outputs = {}
    for scope, x in (("student", images), ("teacher", noisy)):
        with tf1.variable_scope(scope):
            outputs[scope] = layers.dense(tf.reduce_mean(_block(_block(x, 4, "a"), 4, "b"), [1, 2]), 3)
    consistency = tf.reduce_mean(tf.square(outputs["student"] - tf.stop_gradient(outputs["teacher"])))
    loss = consistency + tf.reduce_mean(tf.square(outputs["student"] - 1.0))
    student = tf1.trainable_variables("student")
    teacher = tf1.trainable_variables("teacher")
    with tf.control_dependencies(_updates()):
        step_op = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, var_list=student)
    with tf.control_dependencies([step_op]):
        train_op = tf.group(*[t.assign(0.9 * t + 0.1 * s) for s, t in zip(student, teacher)])
    return _loop(train_op, [(images, _images(10))])


def ensemble() -> dict[str, np.ndarray]:
    """Two members of an ensemble, model_a/ and model_b/, each with its own loss and optimizer."""
    images = tf1.placeholder(tf.float32, [BATCH, 6, 6, 3])
    steps = []
    for scope in ("model_a", "model_b"):
        with tf1.variable_scope(scope):
            out = layers.dense(tf.reduce_mean(_block(_block(images, 4, "a"), 4, "b"), [1, 2]), 3)
            loss = tf.reduce_mean(tf.square(out - 1.0))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope)):
            steps.append(tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, var_list=tf1.trainable_variables(scope)))
    return _loop(steps, [(images, _images(13))])


def keras_fit() -> dict[str, np.ndarray]:
    """A tf_keras Sequential with two default-named BatchNormalization layers: compile, then fit."""
    model = keras.Sequential([
        keras.layers.Conv2D(4, 3, use_bias=False, input_shape=(6, 6, 3)), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.Conv2D(4, 3, use_bias=False), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3),
    ])
    model.compile(keras.optimizers.legacy.SGD(0.1, momentum=0.9), "mse")
    images = _images(12).reshape(STEPS * BATCH, 6, 6, 3)
    model.fit(images, np.ones((STEPS * BATCH, 3), np.float32), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return {w.name: value for w, value in zip(model.weights, model.get_weights())}


def _shared_net(x: tf.Tensor, outputs: int = 3) -> tf.Tensor:
    """One network (its scope re-entered with AUTO_REUSE) from images to `outputs` logits."""
    with tf1.variable_scope("net", reuse=tf1.AUTO_REUSE):
        return layers.dense(tf.reduce_mean(_block(_block(x, 4, "a"), 4, "b"), [1, 2]), outputs)


def _labels(seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 3, (STEPS, BATCH)).astype(np.int32)


def _settled(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`values` less the moving statistics that both applications of a network update in one
    step: the program leaves the order of the two updates open, and python's own runs differ there."""
    return {name: value for name, value in values.items() if "/moving_" not in name}


def semi_supervised() -> dict[str, np.ndarray]:
    """Entropy minimisation: one network on a labelled and an unlabelled batch, loss = sup + 0.1 * ent."""
    labelled, unlabelled = (tf1.placeholder(tf.float32, [BATCH, 6, 6, 3]) for _ in range(2))
    labels = tf1.placeholder(tf.int32, [BATCH])
    supervised = tf1.losses.sparse_softmax_cross_entropy(labels, _shared_net(labelled))
    p = tf.nn.softmax(_shared_net(unlabelled))
    entropy = -tf.reduce_mean(tf.reduce_sum(p * tf.math.log(p + 1e-8), 1))
    feeds = [(labelled, _images(14)), (unlabelled, _images(15)), (labels, _labels(14))]
    return _settled(_train(supervised + 0.1 * entropy, feeds))


def two_cross_entropies() -> dict[str, np.ndarray]:
    """One network on two labelled batches, the two cross-entropies summed."""
    images = [tf1.placeholder(tf.float32, [BATCH, 6, 6, 3]) for _ in range(2)]
    labels = [tf1.placeholder(tf.int32, [BATCH]) for _ in range(2)]
    loss = sum(tf1.losses.sparse_softmax_cross_entropy(y, _shared_net(x)) for x, y in zip(images, labels))
    feeds = [(images[0], _images(16)), (images[1], _images(17)), (labels[0], _labels(16)), (labels[1], _labels(17))]
    return _settled(_train(loss, feeds))


def gan_discriminator_step() -> dict[str, np.ndarray]:
    """A discriminator on real and generated images, `minimize(d_loss)` under both applications' UPDATE_OPS."""
    real, noise = (tf1.placeholder(tf.float32, [BATCH, 6, 6, 3]) for _ in range(2))
    with tf1.variable_scope("generator"):
        fake = layers.conv2d(noise, 3, 3, padding="same")
    with tf1.variable_scope("discriminator", reuse=tf1.AUTO_REUSE):
        real_logits = layers.dense(tf.reduce_mean(_block(real, 4, "a"), [1, 2]), 1)
    with tf1.variable_scope("discriminator", reuse=tf1.AUTO_REUSE):
        fake_logits = layers.dense(tf.reduce_mean(_block(fake, 4, "a"), [1, 2]), 1)
    xent = tf.nn.sigmoid_cross_entropy_with_logits
    d_loss = tf.reduce_mean(xent(labels=tf.ones_like(real_logits), logits=real_logits)) + tf.reduce_mean(
        xent(labels=tf.zeros_like(fake_logits), logits=fake_logits))
    with tf.control_dependencies(_updates()):
        train_op = tf1.train.AdamOptimizer(1e-2).minimize(d_loss, var_list=tf1.trainable_variables("discriminator"))
    return _settled(_loop(train_op, [(real, _images(18)), (noise, _images(19))]))


def per_domain() -> dict[str, np.ndarray]:
    """Domain adaptation: a source and a target batch through one network, the source's
    cross-entropy and a feature-matching term on both summed."""
    source, target = (tf1.placeholder(tf.float32, [BATCH, 6, 6, 3]) for _ in range(2))
    labels = tf1.placeholder(tf.int32, [BATCH])
    source_out, target_out = _shared_net(source), _shared_net(target)
    matching = tf.reduce_sum(tf.square(tf.reduce_mean(source_out, 0) - tf.reduce_mean(target_out, 0)))
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, source_out) + matching
    return _settled(_train(loss, [(source, _images(20)), (target, _images(21, 3) * 0.5), (labels, _labels(20))]))


def weighted_add_n() -> dict[str, np.ndarray]:
    """Two applications' losses weighted by a fed scalar and summed with tf.add_n."""
    left, right = (tf1.placeholder(tf.float32, [BATCH, 6, 6, 3]) for _ in range(2))
    weight = tf1.placeholder_with_default(0.3, [])
    loss = tf.add_n([tf.reduce_mean(tf.square(_shared_net(left))), weight * tf.reduce_mean(tf.abs(_shared_net(right)))])
    return _settled(_train(loss, [(left, _images(22)), (right, _images(23))]))


def mean_over_concat() -> dict[str, np.ndarray]:
    """One network on two batches of unknown size, the loss a mean over the concatenated per-example terms."""
    left, right = (tf1.placeholder(tf.float32, [None, 6, 6, 3]) for _ in range(2))
    terms = tf.concat([tf.square(_shared_net(left)), tf.square(_shared_net(right) - 1.0)], 0)
    return _settled(_train(tf.reduce_mean(terms), [(left, _images(24)), (right, _images(25))]))


def tape_summed_loss() -> dict[str, np.ndarray]:
    """One network on two batches, a tf.GradientTape over the summed loss (its seed a constant `ones`)."""
    left, right = (tf1.placeholder(tf.float32, [BATCH, 6, 6, 3]) for _ in range(2))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(_shared_net(left))) + 0.5 * tf.reduce_mean(tf.abs(_shared_net(right)))
    variables = tf1.trainable_variables()
    with tf.control_dependencies(_updates()):
        train_op = tf1.train.MomentumOptimizer(0.1, 0.9).apply_gradients(zip(tape.gradient(loss, variables), variables))
    return _settled(_loop(train_op, [(left, _images(28)), (right, _images(29))]))


def keras_shared_encoder() -> dict[str, np.ndarray]:
    """A tf_keras two-input model whose encoder (with batch norm) is called on both inputs: compile, then fit."""
    encoder = keras.Sequential([
        keras.layers.Conv2D(4, 3, use_bias=False, input_shape=(6, 6, 3)), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(),
    ], name="encoder")
    inputs = [keras.Input((6, 6, 3)) for _ in range(2)]
    outputs = keras.layers.Dense(1)(keras.layers.concatenate([encoder(x) for x in inputs]))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.legacy.SGD(0.1, momentum=0.9), "mse")
    images = [_images(seed).reshape(STEPS * BATCH, 6, 6, 3) for seed in (26, 27)]
    model.fit(images, np.ones((STEPS * BATCH, 1), np.float32), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return _settled({w.name: value for w, value in zip(model.weights, model.get_weights())})


CASES = {f.__name__: f for f in (two_plain_layers, named_layers, two_streams, siamese, gan, encoder_decoder,
                                mean_teacher, ensemble, keras_fit, semi_supervised, two_cross_entropies,
                                gan_discriminator_step, per_domain, weighted_add_n, mean_over_concat,
                                tape_summed_loss, keras_shared_encoder)}


def main(out: str, names: list[str]) -> None:
    """As a script (the tests also import the cases, and must not change their process)."""
    tf1.disable_eager_execution()
    tf.config.experimental.enable_op_determinism()
    warnings.filterwarnings("ignore", category=UserWarning)  # tf.layers is deprecated
    values = {}
    for name in names or CASES:
        with tf.Graph().as_default():
            keras.utils.set_random_seed(0)  # tf.layers' Keras initializers draw from Keras' own seed
            values.update({f"{name}/{k}": v for k, v in CASES[name]().items()})
        print(f"case {name}: trained", flush=True)
    np.savez(out, **values)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
