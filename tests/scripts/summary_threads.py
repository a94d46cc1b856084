"""Two trainers whose session runs a summary thread beside the training loop, each trained on one
global batch of N examples split over T towers, in graphs of their own:

- `supervisor`: a plain loop under train.Supervisor with its default summary service (a thread
  that runs the merged summaries, here the loss, as the session starts and every 120 s);
- `slim`: TF-Slim's model_deploy clones (clone_i scopes, variables on the CPU, losses divided by
  the number of clones, gradients summed, clone 0's UPDATE_OPS) under slim.learning.train, whose
  Supervisor runs the summaries likewise.

The summary thread's run is forward-only: the inputs are constants, so it takes no batch from the
training loop, and whenever it runs, the variables after the steps are the same. Each loop waits
SETUP seconds before its first step (as a trainer setting up its input would), so that the
summary thread's run and the first steps overlap on a loaded machine. With reference variables
that overlap once let the optimizer's update of gamma land before the synchronized backward read
it (1.1e-3 from one device in 1 of 3 runs, under load, with or without --verify): the rewrite
now orders those reads by data (tests/test_variable_reads.py).
`python summary_threads.py OUT N T...` writes OUT/<trainer>_<T>.npz for each T, every global variable.
"""

import os
import sys
import time

os.environ["TF_USE_LEGACY_KERAS"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_slim as slim  # noqa: E402

import multi_gpu_train as trainer  # noqa: E402

tf1 = tf.compat.v1
STEPS, SIZE = 3, 4
SETUP = 0.5


def _data(examples: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    return rng.randn(examples, SIZE, SIZE, 3).astype(np.float32) * 2.0 + 0.5, rng.randint(0, 5, examples)


def _towers(towers: int, batch: int, clones: bool) -> tuple:
    """(train op or tensor, loss, global step) of `towers` towers on /device:GPU:k, each fed its
    slice of one constant batch; `clones`: model_deploy's way, else the tower loop of
    examples/multi_gpu_train.py."""
    images, labels = _data(towers * batch)
    global_step = tf1.train.get_or_create_global_step()
    optimizer = tf1.train.MomentumOptimizer(0.1, 0.9)
    grads, losses, updates = [], [], []
    for k in range(towers):
        with tf1.variable_scope(tf1.get_variable_scope(), reuse=k > 0), \
                tf.name_scope(f"clone_{k}" if clones else f"tower_{k}") as scope, tf.device(f"/device:GPU:{k}"):
            x, y = tf.constant(images[k * batch:(k + 1) * batch]), tf.constant(labels[k * batch:(k + 1) * batch])
            if clones:
                with slim.arg_scope([slim.model_variable, slim.variable], device="/device:CPU:0"):
                    loss = trainer.tower_loss(x, y) / towers
            else:
                loss = trainer.tower_loss(x, y)
            updates += tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope) if k == 0 or not clones else []
            grads.append(optimizer.compute_gradients(loss))
            losses.append(loss)
    if clones:
        summed = [(tf.add_n([g for g, _ in pairs]), pairs[0][1]) for pairs in zip(*grads)]
        update = tf.group(optimizer.apply_gradients(summed, global_step=global_step), *updates)
        with tf.control_dependencies([update]):
            train = tf.identity(tf.add_n(losses), name="train_op")
        loss = tf.add_n(losses)
    else:
        train = tf.group(optimizer.apply_gradients(trainer.average_gradients(grads), global_step=global_step), *updates)
        loss = tf.add_n(losses) / towers
    tf1.summary.scalar("loss", loss)
    return train, loss, global_step


def supervisor(out: str, towers: int, batch: int) -> dict:
    train, loss, global_step = _towers(towers, batch, clones=False)
    sv = tf1.train.Supervisor(logdir=os.path.join(out, f"supervisor_{towers}"), save_model_secs=0,
                              global_step=global_step)
    with sv.managed_session(config=tf1.ConfigProto(allow_soft_placement=True)) as sess:
        time.sleep(SETUP)
        for step in range(STEPS):
            print(f"supervisor step {step}: loss {sess.run([train, loss])[1]:.6f}")
        return sess.run({v.op.name: v for v in tf1.global_variables()})


def slim_clones(out: str, towers: int, batch: int) -> dict:
    train, _, _ = _towers(towers, batch, clones=True)
    logdir = os.path.join(out, f"slim_{towers}")

    def train_step(*args: object) -> tuple:
        time.sleep(SETUP if not train_step.started else 0.0)
        train_step.started = True
        return slim.learning.train_step(*args)

    train_step.started = False
    slim.learning.train(train, logdir, train_step_fn=train_step, number_of_steps=STEPS, save_interval_secs=0,
                        log_every_n_steps=1, session_config=tf1.ConfigProto(allow_soft_placement=True))
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(logdir))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def main() -> None:
    out, examples, counts = sys.argv[1], int(sys.argv[2]), [int(t) for t in sys.argv[3:]]
    tf1.disable_v2_behavior()  # reference variables, v1 control flow: a TF1 script's graph
    os.makedirs(out, exist_ok=True)
    for name, run in (("supervisor", supervisor), ("slim", slim_clones)):
        for towers in counts:
            with tf.Graph().as_default():
                np.savez(os.path.join(out, f"{name}_{towers}.npz"), **run(out, towers, examples // towers))


if __name__ == "__main__":
    main()
