"""Multi-tower trainers whose towers apply one batch-norm network twice, as people write them.

* gan: per tower (/cpu:k) a generator and a discriminator applied to real and to generated
  images; discriminator and generator steps in turn, each its own averaged gradients and its
  own network's moving-average updates (both applications' for the discriminator); gan_tape:
  the same differentiated by one persistent tf.GradientTape per tower (TF2 style).
* siamese: per tower one embedding net applied to both images of each pair, a contrastive loss;
  siamese_moments: the same with `fused=False` batch norm (tf.nn.moments).
* two_stream: per tower two nets of their own (no variable shared) on two inputs.
* gan_real: the gan whose discriminator step keeps the moving statistics of its application to
  real images only (its train op under control_dependencies of that application's UPDATE_OPS,
  common practice); siamese_second: the siamese net keeping its second application's only.

`python applied_twice.py OUT CASE ... [--towers 2] [--batch 4] [--reference]`, in the form
tests/script_oracle.py runs: OUT/CASE.npz holds every variable (weights, moving statistics) and
every step's losses, trained 3 steps of tf.compat.v1.layers with momentum; with --reference,
CASE.one.npz (one device fed every tower's examples), CASE.perturbed.npz (inputs scaled by
1 + 1e-7) and CASE.towers.npz (the towers as built).
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Callable

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.compat.v1.layers on TF >= 2.16

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import oracle_cli  # noqa: E402

tf1 = tf.compat.v1
layers = tf1.layers
CASES = ("gan", "gan_tape", "siamese", "siamese_moments", "two_stream", "gan_real", "siamese_second")
STEPS = 3


def _block(x: tf.Tensor, filters: int, name: str, fused: bool = True) -> tf.Tensor:
    x = layers.conv2d(x, filters, 3, padding="same", use_bias=False, name=f"{name}_conv")
    return tf.nn.relu(layers.batch_normalization(x, training=True, fused=fused, name=f"{name}_bn"))


def _discriminator(x: tf.Tensor) -> tf.Tensor:
    with tf1.variable_scope("D", reuse=tf1.AUTO_REUSE):
        h = _block(_block(x, 4, "d1"), 4, "d2")
        return layers.dense(tf.reduce_mean(h, [1, 2]), 1, name="d_out")


def _generator(z: tf.Tensor) -> tf.Tensor:
    with tf1.variable_scope("G", reuse=tf1.AUTO_REUSE):
        h = tf.reshape(layers.dense(z, 6 * 6 * 4, name="g_in"), [-1, 6, 6, 4])
        h = _block(tf.nn.relu(layers.batch_normalization(h, training=True, name="g_bn0")), 4, "g1")
        return tf.tanh(layers.conv2d(h, 3, 3, padding="same", name="g_out"))


def _embed(x: tf.Tensor, scope: str, fused: bool = True) -> tf.Tensor:
    with tf1.variable_scope(scope, reuse=tf1.AUTO_REUSE):
        h = _block(_block(x, 4, "e1", fused), 4, "e2", fused)
        return layers.dense(tf.reduce_mean(h, [1, 2]), 3, name="e_out")


def _averaged(grads: list[list[tuple[tf.Tensor, tf.Variable]]]) -> list[tuple[tf.Tensor, tf.Variable]]:
    return [(tf.add_n([g for g, _ in per_var]) / len(grads), per_var[0][1]) for per_var in zip(*grads)]


def _updates_of(scope: str) -> list[tf.Operation]:
    """The moving-average updates of the variables under `scope` (every tower's, every application's)."""
    ops = [u.op if isinstance(u, tf.Tensor) else u for u in tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)]
    return [op for op in ops if any(i.op.type == "VarHandleOp" and i.op.name.startswith(f"{scope}/") for i in op.inputs)]


def _made_updates(build: Callable[[], tf.Tensor], kept: list[tf.Operation]) -> tf.Tensor:
    """`build()`, the UPDATE_OPS it adds appended to `kept`."""
    before = len(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
    out = build()
    kept += tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)[before:]
    return out


def _build(case: str, towers: int, batch: int) -> tuple[list[tf.Tensor], list[tf.Operation], list[tf.Tensor]]:
    """Placeholders (a, b, z, same), the train ops to run in turn each step, the losses."""
    rows = towers * batch
    feeds = [tf1.placeholder(tf.float32, [rows, 6, 6, 3], name="a"), tf1.placeholder(tf.float32, [rows, 6, 6, 3], name="b"),
             tf1.placeholder(tf.float32, [rows, 8], name="z"), tf1.placeholder(tf.float32, [rows], name="same")]
    opt = tf1.train.MomentumOptimizer(0.05, 0.9)
    grads: dict[str, list] = {"D": [], "G": []}
    losses: dict[str, list] = {"D": [], "G": []}
    kept: list[tf.Operation] = []  # gan_real, siamese_second: the one application's updates the step keeps
    for k in range(towers):
        with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"):
            a, b, z, same = (t[k * batch:(k + 1) * batch] for t in feeds)
            if case.startswith("gan"):
                with tf.GradientTape(persistent=True) if case == "gan_tape" else contextlib.nullcontext() as tape:
                    real = _made_updates(lambda: _discriminator(a), kept)
                    fake = _discriminator(_generator(z))
                    xent = tf.nn.sigmoid_cross_entropy_with_logits
                    d_loss = (tf.reduce_mean(xent(labels=tf.ones_like(real), logits=real))
                              + tf.reduce_mean(xent(labels=tf.zeros_like(fake), logits=fake)))
                    g_loss = tf.reduce_mean(xent(labels=tf.ones_like(fake), logits=fake))
                for scope, loss in (("D", d_loss), ("G", g_loss)):
                    losses[scope].append(loss)
                    variables = tf1.trainable_variables(scope)
                    grads[scope].append(list(zip(tape.gradient(loss, variables), variables)) if tape else
                                        opt.compute_gradients(loss, variables))
            else:
                fused = case != "siamese_moments"
                second = "F" if case == "two_stream" else "E"
                first = _embed(a, "E", fused)
                distance = tf.reduce_sum(tf.square(first - _made_updates(lambda: _embed(b, second, fused), kept)), 1)
                losses["D"].append(tf.reduce_mean(same * distance + (1 - same) * tf.nn.relu(1.0 - distance)))
                grads["D"].append(opt.compute_gradients(losses["D"][-1]))
    with tf.device("/cpu:0"):
        if case == "gan_real":
            with tf.control_dependencies(kept):
                trains = [opt.apply_gradients(_averaged(grads["D"]))]
            trains.append(tf.group(opt.apply_gradients(_averaged(grads["G"])), *_updates_of("G")))
        elif case.startswith("gan"):
            trains = [tf.group(opt.apply_gradients(_averaged(grads[s])), *_updates_of(s)) for s in ("D", "G")]
        elif case == "siamese_second":
            with tf.control_dependencies(kept):
                trains = [opt.apply_gradients(_averaged(grads["D"]))]
        else:
            trains = [tf.group(opt.apply_gradients(_averaged(grads["D"])), *tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))]
        return feeds, trains, [tf.add_n(v) / towers for v in losses.values() if v]


def _initial(session: tf1.Session) -> None:
    """Every weight set from its tower-less name (the same in every run), gammas near 1."""
    for v in tf1.trainable_variables():
        value = np.random.RandomState(zlib.crc32(v.op.name.encode())).normal(0, 0.3, v.shape.as_list())
        v.load((value + ("gamma" in v.op.name)).astype(np.float32), session)


def train(case: str, towers: int, batch: int, perturb: float = 0.0) -> dict[str, np.ndarray]:
    """`case` trained on `towers` devices with `batch` examples each: every variable, every loss."""
    tf1.reset_default_graph()
    rows = towers * batch
    rng = np.random.RandomState(0)
    data = [rng.normal(1, 2, (STEPS, rows, 6, 6, 3)) * (1 + perturb), rng.normal(-1, 1.5, (STEPS, rows, 6, 6, 3)),
            rng.normal(0, 1, (STEPS, rows, 8)), rng.randint(0, 2, (STEPS, rows))]
    feeds, trains, losses = _build(case, towers, batch)
    out = {}
    with tf1.Session(config=tf1.ConfigProto(device_count={"CPU": towers})) as session:
        session.run(tf1.global_variables_initializer())
        _initial(session)
        for step in range(STEPS):
            fed = {p: value[step].astype(np.float32) for p, value in zip(feeds, data)}
            for i, train_op in enumerate(trains):
                out[f"loss/{step}/{i}"] = np.array(session.run([train_op, *losses], fed)[1:])
        out.update({v.op.name: session.run(v) for v in tf1.global_variables() if "Momentum" not in v.op.name})
    return out


if __name__ == "__main__":
    oracle_cli.main(CASES, train)
