"""tf_keras models trained on several devices in v1 graph mode, the ways people wrote it (issue 39).

* functional: a functional model built once on its own `Input`, called per tower under
  `tf.device` (`model(x, training=True)`), gradients averaged, `model.get_updates_for(x)` of
  every tower in the train op.
* learning_phase: the same called as `model(x)`: batch norm under the learning-phase cond, the
  phase fed 1 in training; cond_v1: the same built with control flow v1 (Switch/Merge).
* set_learning_phase: the same after `keras.backend.set_learning_phase(1)` (no cond).
* update_ops: the towers' updates put in UPDATE_OPS, the train op under
  `tf.control_dependencies(UPDATE_OPS)`.
* sequential: a Sequential with `input_shape=` (built at construction), called per tower.
* unfused, renorm: the functional model with `fused=False` / `renorm=True` batch norm;
  unfused_any_batch: unfused, fed through placeholders of unknown batch size (the Means' gradients
  then take the incoming gradient in by a BroadcastTo).
* float16: the functional model under tf_keras' 'mixed_float16' policy.
* mobilenet: tf_keras.applications.MobileNetV2 (alpha 0.35, 32x32, no weights) per tower.
* multi_gpu: the `keras.utils.multi_gpu_model` pattern (Keras <= 2.3): slice the batch with
  `Lambda`, call the model per slice under `tf.device`, `concatenate`; compile + fit the merged
  model.
* multi_gpu_soft: the same with the towers on `/gpu:i` in a session without GPUs (soft placement
  puts both on the CPU; batch norm under the learning-phase cond v2); learning_phase_soft: the
  per-tower loop so (issue 49).
* multi_gpu_then_template: multi_gpu, then the template model compiled and fitted on its own on
  one device (the all-reduces must not span the template's own call).
* mirrored_fit: compile and fit under `tf.distribute.MirroredStrategy` (one replica per device);
  mirrored_fit_unfused: the same with `fused=False` batch norm (each replica's gradients come
  from a tf.GradientTape, whose moments' gradients carry no `mean_grad` scope).
* multi_gpu_refit: multi_gpu, fit, then compiled again with a new optimizer and learning rate and
  fit on (issue 49: the second train op read an update the rewrite had removed).
* mirrored_shared: mirrored_fit of a model with a layer shared inside it: one encoder (its batch
  norm) applied to both of two inputs in every replica.

With --reference each also trains the one-device reference: the same model fed the whole batch
(fit without the merging model or the strategy), once as is and once with its images scaled by
1 + 1e-7 (the noise floor of the comparison), and the towers as built (unsynchronized). Initial values are set from the weights'
names, so both sides start equal. After training (but MobileNetV2's) the weights go to a
checkpoint (`save_weights`, and a `tf.compat.v1.train.Saver` one); a graph of the case's own, not
training's (built once per process), has the model for inference restore each, its weights set
back to their initializers first, and its `predict` and `evaluate` outputs are saved beside every
weight.

Usage: keras_towers.py OUT_DIR CASE... [--towers K] [--batch B] [--reference]
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import zlib

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import oracle_cli  # noqa: E402
import tf_keras as keras  # noqa: E402
from tf_keras.src import backend  # noqa: E402

tf1 = tf.compat.v1
CASES = ("functional", "learning_phase", "cond_v1", "set_learning_phase", "update_ops", "sequential", "unfused",
         "unfused_any_batch", "renorm", "float16", "mobilenet", "multi_gpu", "mirrored_fit", "mirrored_fit_unfused",
         "multi_gpu_soft", "learning_phase_soft", "multi_gpu_then_template", "multi_gpu_refit", "mirrored_shared")
#: Cases whose towers ask for GPUs this machine lacks: soft placement runs them on its one CPU.
SOFT = ("multi_gpu_soft", "learning_phase_soft")
FITTED = ("multi_gpu", "mirrored_fit", "mirrored_fit_unfused", "multi_gpu_soft", "multi_gpu_then_template",
          "multi_gpu_refit", "mirrored_shared")
STEPS, CLASSES = 3, 3


def _image(case: str) -> int:
    return 32 if case == "mobilenet" else 6


def _model(case: str) -> keras.Model:
    """The case's model, its variables given values from their names."""
    if case == "mobilenet":
        return keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=CLASSES,
                                              classifier_activation=None)
    options = {"unfused": {"fused": False}, "unfused_any_batch": {"fused": False}, "renorm": {"renorm": True},
               "mirrored_fit_unfused": {"fused": False}}.get(case, {})
    layers = keras.layers
    if case == "mirrored_shared":
        image = keras.Input((6, 6, 3))
        x = layers.Conv2D(4, 3, use_bias=False, name="conv1")(image)
        x = layers.GlobalAveragePooling2D()(layers.ReLU()(layers.BatchNormalization(momentum=0.9, name="bn1")(x)))
        encoder = keras.Model(image, x, name="encoder")
        first, second = keras.Input((6, 6, 3)), keras.Input((6, 6, 3))
        both = layers.concatenate([encoder(first), encoder(second)])
        return keras.Model([first, second], layers.Dense(CLASSES, name="logits")(both), name="net")
    if case in ("sequential", "mirrored_fit", "mirrored_fit_unfused"):
        return keras.Sequential([
            layers.Conv2D(4, 3, use_bias=False, input_shape=(6, 6, 3), name="conv1"),
            layers.BatchNormalization(momentum=0.9, name="bn1", **options), layers.ReLU(),
            layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv2"),
            layers.BatchNormalization(momentum=0.9, name="bn2", **options), layers.ReLU(),
            layers.GlobalAveragePooling2D(), layers.Dense(CLASSES, name="logits")], name="net")
    inputs = keras.Input((6, 6, 3))
    x = layers.Conv2D(4, 3, use_bias=False, name="conv1")(inputs)
    x = layers.ReLU()(layers.BatchNormalization(momentum=0.9, name="bn1", **options)(x))
    x = layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv2")(x)
    x = layers.ReLU()(layers.BatchNormalization(momentum=0.9, name="bn2", **options)(x))
    x = layers.Dense(CLASSES, name="logits", dtype="float32")(layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, x, name="net")


def _initial(model: keras.Model) -> None:
    """Every weight's value from its name: both sides of the comparison start equal."""
    values = []
    for weight in model.weights:
        name, shape = weight.name.split(":")[0], weight.shape.as_list()
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        role = name.rsplit("/", 1)[-1]
        if role in ("moving_variance", "moving_stddev", "renorm_stddev"):
            value = rng.uniform(0.5, 1.5, shape)
        elif role == "gamma":
            value = rng.uniform(0.8, 1.2, shape)
        elif role in ("beta", "bias", "moving_mean", "renorm_mean"):
            value = rng.normal(0, 0.1, shape)
        else:
            fan_in = int(np.prod(shape[:-1])) or 1
            value = rng.normal(0, (2.0 / fan_in) ** 0.5, shape)
        values.append(value.astype(weight.dtype.as_numpy_dtype))
    model.set_weights(values)


def _data(case: str, total: int, perturb: float) -> tuple[np.ndarray, np.ndarray]:
    image = _image(case)
    images = np.random.RandomState(1).normal(1, 2, (total, image, image, 3)).astype(np.float32)
    targets = np.random.RandomState(2).normal(0, 1, (total, CLASSES)).astype(np.float32)
    return images * np.float32(1 + perturb), targets


def _session(towers: int, case: str = "") -> tf1.Session:
    config = (tf1.ConfigProto(allow_soft_placement=True) if case in SOFT
              else tf1.ConfigProto(device_count={"CPU": max(towers, 1)}))
    session = tf1.Session(config=config)
    backend.set_session(session)
    return session


def _per_tower(case: str, towers: int, batch: int, images: np.ndarray, targets: np.ndarray) -> keras.Model:
    """The model called once per tower, averaged gradients, the towers' updates in the train op."""
    if case == "set_learning_phase":
        keras.backend.set_learning_phase(1)
    model = _model(case)
    session = _session(towers, case)
    image = _image(case)
    rows = None if case == "unfused_any_batch" else towers * batch
    x = tf1.placeholder(tf.float32, [rows, image, image, 3], name="images")
    y = tf1.placeholder(tf.float32, [rows, CLASSES], name="targets")
    optimizer = tf1.train.GradientDescentOptimizer(0.002 if case == "mobilenet" else 0.1)
    grads, updates = [], []
    for i in range(towers):
        with tf.device(f"/{'gpu' if case in SOFT else 'cpu'}:{i}"), tf1.name_scope(f"tower_{i}"):
            part = x[i * batch:(i + 1) * batch]
            out = model(part) if case in ("learning_phase", "cond_v1", *SOFT) else model(part, training=True)
            loss = tf.reduce_mean(tf.square(tf.cast(out, tf.float32) - y[i * batch:(i + 1) * batch]))
            grads.append(optimizer.compute_gradients(loss, model.trainable_weights))
            updates += model.get_updates_for(part)
    averaged = [(tf.add_n([g[j][0] for g in grads]) / towers, grads[0][j][1]) for j in range(len(grads[0]))]
    if case == "update_ops":  # the TF1 habit: updates in the collection, the train op waiting on them
        for update in updates:
            tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train_op = optimizer.apply_gradients(averaged, name="train_op")
    else:
        train_op = tf.group(optimizer.apply_gradients(averaged), *updates, name="train_op")
    session.run(tf1.global_variables_initializer())
    _initial(model)
    feeds = {keras.backend.learning_phase(): 1} if case in ("learning_phase", "cond_v1", *SOFT) else {}
    total = towers * batch
    for step in range(STEPS):
        part = slice(step * total, (step + 1) * total)
        session.run(train_op, {x: images[part], y: targets[part], **feeds})
    return model


def _multi_gpu(model: keras.Model, towers: int, device: str = "cpu") -> keras.Model:
    """keras.utils.multi_gpu_model as Keras 2.2 wrote it: slice, call per device, concatenate."""
    def get_slice(data: tf.Tensor, i: int, parts: int) -> tf.Tensor:
        size = tf.shape(data)[:1] // parts
        return data[i * size[0]:(i + 1) * size[0]]

    inputs = keras.Input(model.input_shape[1:])
    outputs = []
    for i in range(towers):
        with tf.device(f"/{device}:{i}"), tf1.name_scope(f"replica_{i}"):
            part = keras.layers.Lambda(get_slice, arguments={"i": i, "parts": towers})(inputs)
            outputs.append(model(part))
    with tf.device("/cpu:0"):
        merged = keras.layers.concatenate(outputs, axis=0)
    return keras.Model(inputs, merged)


def _fit(case: str, towers: int, batch: int, images: np.ndarray, targets: np.ndarray) -> keras.Model:
    _session(towers, case)
    if case.startswith("mirrored") and towers > 1:
        with tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(towers)]).scope():
            model = _model(case)
            model.compile(keras.optimizers.legacy.SGD(0.1), "mse")
        trained = model
    else:
        model = _model(case)
        trained = _multi_gpu(model, towers, "gpu" if case in SOFT else "cpu") if towers > 1 else model
        trained.compile(keras.optimizers.legacy.SGD(0.1), "mse")
    _initial(model)
    if case == "multi_gpu_refit":
        first = (STEPS - 1) * towers * batch
        trained.fit(images[:first], targets[:first], batch_size=towers * batch, epochs=1, shuffle=False, verbose=0)
        trained.compile(keras.optimizers.legacy.SGD(0.05, momentum=0.5), "mse")  # a new optimizer, a new train op
        trained.fit(images[first:], targets[first:], batch_size=towers * batch, epochs=1, shuffle=False, verbose=0)
        return model
    inputs = [images, images[:, ::-1] * np.float32(0.5)] if case == "mirrored_shared" else images
    trained.fit(inputs, targets, batch_size=towers * batch, epochs=1, shuffle=False, verbose=0)
    if case == "multi_gpu_then_template":  # fine-tuned on one device: the template's own train op
        if trained is not model:
            model.compile(keras.optimizers.legacy.SGD(0.1), "mse")
        model.fit(images, targets, batch_size=towers * batch, epochs=1, shuffle=False, verbose=0)
    return model


def _weights(model: keras.Model) -> dict[str, np.ndarray]:
    return {w.name.split(":")[0]: value for w, value in zip(model.weights, model.get_weights())}


@dataclasses.dataclass(frozen=True)
class _Reader:
    """A graph of its own with a case's model for inference: compiled, called with training=False
    on `images`, a Saver of its weights and `reset`, their initializers."""

    graph: tf.Graph
    session: tf1.Session
    model: keras.Model
    images: tf.Tensor
    called: tf.Tensor
    saver: tf1.train.Saver
    reset: tf.Operation


#: Per case, its reader, built once per process: every checkpoint of the case is restored into it.
_READERS: dict[str, _Reader] = {}


def _reader(case: str, image: tuple[int, ...]) -> _Reader:
    if case not in _READERS:
        tf1.reset_default_graph()
        keras.backend.clear_session()
        session = tf1.Session(config=tf1.ConfigProto(device_count={"CPU": 1}))
        with session.as_default():  # not Keras' session, which the next case's clear_session closes
            model = _model(case)
            model.compile(keras.optimizers.legacy.SGD(0.1), "mse")
            images = tf1.placeholder(tf.float32, [8, *image])
            _READERS[case] = _Reader(session.graph, session, model, images, model(images, training=False),
                                     tf1.train.Saver(model.weights), tf1.variables_initializer(model.weights))
    return _READERS[case]


def _inference(case: str, images: np.ndarray, targets: np.ndarray, directory: str) -> dict[str, np.ndarray]:
    """The case's reader (a graph other than training's) restoring each checkpoint, its weights
    set back to their initializers before each (what a restore misses reads as in a new graph):
    predict, evaluate, the training=False call."""
    reader, out = _reader(case, images.shape[1:]), {}
    with reader.graph.as_default(), reader.session.as_default():
        for how in ("keras", "saver"):
            reader.session.run(reader.reset)
            if how == "keras":
                reader.model.load_weights(os.path.join(directory, "weights"))
            else:
                reader.saver.restore(reader.session, os.path.join(directory, "saver"))
            out[f"predict_{how}"] = reader.model.predict(images[:8], batch_size=8, verbose=0)
            out[f"evaluate_{how}"] = np.array(reader.model.evaluate(images[:8], targets[:8], batch_size=8, verbose=0))
            out[f"inference_{how}"] = reader.session.run(reader.called, {reader.images: images[:8]})
    return out


def train(case: str, towers: int, batch: int, perturb: float = 0.0) -> dict[str, np.ndarray]:
    """Train `case` on `towers` devices with `batch` examples each (in a graph of its own);
    its weights, then the inference graphs' outputs."""
    tf1.reset_default_graph()
    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy("mixed_float16" if case == "float16" else "float32")
    (tf1.disable_control_flow_v2 if case == "cond_v1" else tf1.enable_control_flow_v2)()
    images, targets = _data(case, STEPS * towers * batch, perturb)
    model = (_fit if case in FITTED else _per_tower)(case, towers, batch, images, targets)
    weights = _weights(model)
    if case in ("mobilenet", "mirrored_shared"):  # the others check the checkpoints (MobileNetV2 takes seconds to
        return weights                            # build; the shared encoder's model takes two inputs)
    with tempfile.TemporaryDirectory() as directory:
        model.save_weights(os.path.join(directory, "weights"))
        tf1.train.Saver(model.weights).save(backend.get_session(), os.path.join(directory, "saver"))
        weights.update(_inference(case, images, targets, directory))
    return weights


if __name__ == "__main__":
    oracle_cli.main(CASES, train)
