"""A multi-tower trainer that later trains ONE tower with a train op of its own (issue 49, 2 i).

Each case builds K towers (`/cpu:i`, one placeholder each, variables shared), trains STEPS steps of
`train_op` over every tower (averaged gradients, the towers' moving-average updates), then
FINETUNE steps of `finetune_op = GradientDescent.minimize(tower_0_loss)` (with tower 0's updates),
fetching tower 0's loss with it, as python trains it: one device.

* layers: tf.compat.v1.layers conv + batch norm, twice.
* moments: hand-written batch norm from tf.nn.moments (no moving averages).
* keras_phase: a tf_keras functional model called per tower under the learning-phase cond (cond v2).
* late: layers, the fine-tuning op built after the multi-tower steps ran (the session's graph grows).

`partial_steps.py OUT CASE... [--reference]` (tests/scripts/oracle_cli.py) writes every variable
before and after the fine-tuning and the losses of both phases; `partial_steps.py --replay RUN OUT
CASE...` builds the K = 2 towers again under plain python, loads RUN/CASE.npz's values from before
the fine-tuning and runs the fine-tuning steps alone into OUT/CASE.npz: what python does for those
steps from the same weights.
"""

from __future__ import annotations

import os
import sys
import zlib

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import oracle_cli  # noqa: E402
import tf_keras as keras  # noqa: E402
from tf_keras.src import backend  # noqa: E402

tf1 = tf.compat.v1
CASES = ("layers", "moments", "keras_phase", "late")
STEPS, FINETUNE, FINETUNE_BATCH, TOWERS, BATCH = 3, 3, 4, 2, 4
TARGET = np.array([1.0, -1.0, 0.5, 2.0], np.float32)


def _block(x: tf.Tensor, case: str, name: str) -> tf.Tensor:
    """conv -> batch norm (training) -> ReLU in variable scope `name` (reused by every tower)."""
    with tf1.variable_scope(name, reuse=tf1.AUTO_REUSE):
        x = tf1.layers.conv2d(x, 4, 3, padding="same", use_bias=False, name="conv")
        if case in ("layers", "late"):
            return tf.nn.relu(tf1.layers.batch_normalization(x, momentum=0.9, training=True, name="bn"))
        gamma = tf1.get_variable("gamma", [4], initializer=tf1.ones_initializer())
        beta = tf1.get_variable("beta", [4], initializer=tf1.zeros_initializer())
        mean, variance = tf.nn.moments(x, [0, 1, 2])
        return tf.nn.relu(tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-3))


def _keras_model() -> keras.Model:
    layers = keras.layers
    inputs = keras.Input((6, 6, 3))
    x = layers.ReLU()(layers.BatchNormalization(momentum=0.9, name="bn1")(
        layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv1")(inputs)))
    x = layers.ReLU()(layers.BatchNormalization(momentum=0.9, name="bn2")(
        layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv2")(x)))
    return keras.Model(inputs, layers.Dense(3, name="logits")(layers.GlobalAveragePooling2D()(x)), name="net")


def _graph(case: str, towers: int) -> tuple[list[tf.Tensor], list[tf.Tensor], tf.Operation, tf.Operation | None, dict]:
    """The towers' placeholders and losses, the train op over all, the fine-tuning op on tower 0
    (None for "late": _finetune_op), and the feeds every run takes (the learning phase)."""
    tf1.reset_default_graph()
    keras.backend.clear_session()
    tf1.enable_control_flow_v2()
    model = _keras_model() if case == "keras_phase" else None
    optimizer = tf1.train.GradientDescentOptimizer(0.1)
    inputs, losses, grads, updates = [], [], [], []
    for i in range(towers):
        with tf.device(f"/cpu:{i}"), tf1.name_scope(f"tower_{i}"):
            x = tf1.placeholder(tf.float32, [None, 6, 6, 3], name="images")
            if model is not None:
                out = model(x)
                tower_updates = model.get_updates_for(x)
            else:
                before = set(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
                out = tf.reduce_mean(_block(_block(x, case, "a"), case, "b"), [1, 2])
                tower_updates = [u for u in tf1.get_collection(tf1.GraphKeys.UPDATE_OPS) if u not in before]
            loss = tf.reduce_mean(tf.square(out - TARGET[:out.shape[-1]]))
            inputs.append(x)
            losses.append(loss)
            updates.append(tower_updates)
            grads.append(optimizer.compute_gradients(loss))
    averaged = [(tf.add_n([g[j][0] for g in grads]) / towers, grads[0][j][1]) for j in range(len(grads[0]))]
    with tf.control_dependencies([u for tower in updates for u in tower]):
        train_op = optimizer.apply_gradients(averaged, name="train_op")
    feeds = {keras.backend.learning_phase(): 1} if model is not None else {}
    return inputs, losses, train_op, None if case == "late" else _finetune_op(losses[0], updates[0]), feeds


def _finetune_op(loss: tf.Tensor, updates: list[tf.Operation]) -> tf.Operation:
    with tf.control_dependencies(updates):
        return tf1.train.GradientDescentOptimizer(0.05).minimize(loss, name="finetune_op")


def _initial(session: tf1.Session) -> None:
    """Every variable's value from its name: both sides of the comparison start equal."""
    for variable in tf1.global_variables():
        name, shape = variable.op.name, variable.shape.as_list()
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        role = name.rsplit("/", 1)[-1]
        value = (rng.uniform(0.5, 1.5, shape) if role in ("moving_variance", "gamma")
                 else rng.normal(0, 0.1, shape) if role in ("beta", "bias", "moving_mean")
                 else np.zeros(shape) if "Momentum" in role
                 else rng.normal(0, (2.0 / (int(np.prod(shape[:-1])) or 1)) ** 0.5, shape))
        variable.load(value.astype(np.float32), session)


def _values(session: tf1.Session, prefix: str) -> dict[str, np.ndarray]:
    variables = tf1.global_variables()
    return {f"{prefix}/{v.op.name}": value for v, value in zip(variables, session.run(variables))}


def _finetune(session: tf1.Session, built: tuple, images: np.ndarray) -> dict[str, np.ndarray]:
    """The fine-tuning steps on tower 0, its loss fetched with the step: the losses, every variable after."""
    inputs, losses, _, finetune_op, feeds = built
    if finetune_op is None:
        finetune_op = _finetune_op(losses[0], [u for u in tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
                                               if u.name.startswith("tower_0/")])
    fetched = [session.run([finetune_op, losses[0]], {inputs[0]: images[step], **feeds})[1] for step in range(FINETUNE)]
    return {"finetune_loss": np.array(fetched), **_values(session, "after")}


def _finetune_images(perturb: float) -> np.ndarray:
    images = np.random.RandomState(7).normal(1, 2, (FINETUNE, FINETUNE_BATCH, 6, 6, 3)).astype(np.float32)
    return images * np.float32(1 + perturb)


def train(case: str, towers: int, batch: int, perturb: float = 0.0) -> dict[str, np.ndarray]:
    """STEPS steps of every tower, then the fine-tuning steps of tower 0 alone."""
    built = _graph(case, towers)
    inputs, losses, train_op, _, feeds = built
    images = np.random.RandomState(1).normal(1, 2, (STEPS, towers * batch, 6, 6, 3)).astype(np.float32)
    images *= np.float32(1 + perturb)
    total = tf.add_n(losses) / towers
    with tf1.Session(config=tf1.ConfigProto(device_count={"CPU": towers})) as session:
        backend.set_session(session)
        session.run(tf1.global_variables_initializer())
        _initial(session)
        trained = []
        for step in range(STEPS):
            feed = {x: images[step, i * batch:(i + 1) * batch] for i, x in enumerate(inputs)}
            trained.append(session.run([train_op, total], {**feed, **feeds})[1])
        out = {"train_loss": np.array(trained), **_values(session, "before")}
        out.update(_finetune(session, built, _finetune_images(perturb)))
    return out


def replay(run: str, out: str, cases: list[str]) -> None:
    """The fine-tuning steps alone under plain python, from the values before them in RUN/CASE.npz:
    OUT/CASE.npz."""
    tf1.disable_eager_execution()
    for case in cases:
        built = _graph(case, TOWERS)
        config = tf1.ConfigProto(device_count={"CPU": TOWERS})
        with np.load(os.path.join(run, f"{case}.npz")) as values, tf1.Session(config=config) as session:
            backend.set_session(session)
            session.run(tf1.global_variables_initializer())
            for variable in tf1.global_variables():
                variable.load(values[f"before/{variable.op.name}"], session)
            np.savez(os.path.join(out, f"{case}.npz"), **_finetune(session, built, _finetune_images(0.0)))


if __name__ == "__main__":
    if sys.argv[1] == "--replay":
        replay(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        oracle_cli.main(CASES, train)
