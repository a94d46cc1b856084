"""Batch norm with 2 images per device, on real data: scikit-learn's bundled digits.

Trains the same small conv net with batch norm three ways, from the same initial
values on the same sequence of 16-image batches:

* unsynced: 8 towers x 2 images on 8 virtual CPU devices, each tower's batch norm
  normalizing with the statistics of its own 2 images (the usual replicated graph;
  every tower's moving-average updates run);
* synced:   the same graph rewritten by bnrewrite (``rewrite_graph``): every tower
  normalizes with the statistics of all 16 images, one moving-average update;
* 1 device: one tower fed the 16 images.

Held-out accuracy is measured in inference mode (batch norm with the moving
statistics), by an eval tower built with ``training=False`` on the shared
variables. Writes a PNG of the training loss and held-out accuracy curves and
prints the final numbers.

    pip install -e '.[examples]'
    python examples/digits_demo.py [--steps 300] [--out examples/digits_demo.png]

The data are the 1,797 8x8 images of ``sklearn.datasets.load_digits`` (shipped
with scikit-learn; nothing is downloaded): 1,297 for training, 500 held out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

TOWERS = 8
PER_TOWER = 2
GLOBAL_BATCH = TOWERS * PER_TOWER
HELD_OUT = 500
CLASSES = 10
#: (filters, stride) of the conv layers; each is followed by batch norm and relu.
CONVS = ((16, 1), (32, 2), (64, 2))  # 8x8 -> 8x8 -> 4x4 -> 2x2
LEARNING_RATE = 0.05
MOMENTUM = 0.9
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-3
EVAL_EVERY = 10
SEED = 0


def load_data(seed: int = SEED):
    """(train_x, train_y, test_x, test_y): NHWC float32 images standardized with the training set."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = digits.images.astype(np.float32)[..., None]  # (1797, 8, 8, 1), values 0..16
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    test, train = order[:HELD_OUT], order[HELD_OUT:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


def batch_order(n_train: int, steps: int, seed: int = SEED) -> np.ndarray:
    """(steps, 16) training indices: shuffled epochs, the same for every variant."""
    rng = np.random.default_rng(seed + 1)
    need = steps * GLOBAL_BATCH
    idx = np.concatenate([rng.permutation(n_train) for _ in range(need // n_train + 1)])
    return idx[:need].reshape(steps, GLOBAL_BATCH)


def initial_values(seed: int = SEED) -> dict:
    """He-normal kernels, gamma 1, beta 0: constant initializers, so all graphs start identical."""
    rng = np.random.default_rng(seed + 2)
    values, cin = {}, 1
    for i, (filters, _) in enumerate(CONVS):
        values[f"conv{i}/kernel"] = (rng.standard_normal((3, 3, cin, filters)) * np.sqrt(2.0 / (9 * cin))).astype(np.float32)
        cin = filters
    values["dense/kernel"] = (rng.standard_normal((cin, CLASSES)) * np.sqrt(1.0 / cin)).astype(np.float32)
    values["dense/bias"] = np.zeros(CLASSES, np.float32)
    return values


def model(images, training: bool, init: dict):
    """conv-BN-relu x 3 -> global average pool -> dense; tf_keras legacy (fused) batch norm."""
    import tensorflow as tf
    from tf_keras.src.legacy_tf_layers import normalization as legacy_norm

    with tf.compat.v1.variable_scope("net", reuse=tf.compat.v1.AUTO_REUSE):
        x = images
        for i, (filters, stride) in enumerate(CONVS):
            with tf.compat.v1.variable_scope(f"conv{i}"):
                kernel = tf.compat.v1.get_variable(
                    "kernel", initializer=tf.constant(init[f"conv{i}/kernel"]))
            x = tf.nn.conv2d(x, kernel, strides=stride, padding="SAME")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                x = legacy_norm.batch_normalization(
                    x, axis=3, momentum=BN_MOMENTUM, epsilon=BN_EPSILON, training=training,
                    fused=True, name=f"bn{i}")
            x = tf.nn.relu(x)
        x = tf.reduce_mean(x, axis=[1, 2])
        with tf.compat.v1.variable_scope("dense"):
            kernel = tf.compat.v1.get_variable("kernel", initializer=tf.constant(init["dense/kernel"]))
            bias = tf.compat.v1.get_variable("bias", initializer=tf.constant(init["dense/bias"]))
        return tf.nn.bias_add(tf.matmul(x, kernel), bias)


def build(towers: int, per_tower: int, init: dict):
    """Training graph with `towers` towers on /cpu:0.. and an inference-mode eval tower on /cpu:0.

    Returns (graph, names) where names holds the tensor/op names the trainer feeds and fetches.
    """
    import tensorflow as tf

    graph = tf.Graph()
    names = {"inputs": []}
    with graph.as_default():
        opt = tf.compat.v1.train.MomentumOptimizer(LEARNING_RATE, MOMENTUM)
        losses, grads = [], []
        for k in range(towers):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"):
                images = tf.compat.v1.placeholder(tf.float32, [per_tower, 8, 8, 1], name="images")
                labels = tf.compat.v1.placeholder(tf.int32, [per_tower], name="labels")
                logits = model(images, True, init)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
                grads.append(opt.compute_gradients(loss))
                losses.append(loss)
            names["inputs"].append((images.name, labels.name))
        with tf.device("/cpu:0"), tf.name_scope("average"):
            average = [(tf.add_n([g for g, _ in per_var]) / float(towers), per_var[0][1]) for per_var in zip(*grads)]
            names["loss"] = tf.identity(tf.add_n(losses) / float(towers), name="loss").name
        apply_op = opt.apply_gradients(average)
        names["train_op"] = tf.group(apply_op, *tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS),
                                     name="train_op").name
        with tf.device("/cpu:0"), tf.name_scope("eval"):
            images = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 1], name="images")
            labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
            logits = model(images, False, init)
            correct = tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels)
            names["eval"] = (images.name, labels.name)
            names["accuracy"] = tf.reduce_mean(tf.cast(correct, tf.float32), name="accuracy").name
            names["eval_loss"] = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=logits), name="loss").name
        names["init"] = tf.compat.v1.global_variables_initializer().name
    return graph, names


def train(graph_or_def, names: dict, data, order: np.ndarray, devices: int) -> dict:
    """Run len(order) steps; returns per-step losses, eval curve (step, accuracy, loss) and seconds."""
    import tensorflow as tf

    if isinstance(graph_or_def, tf.Graph):
        graph = graph_or_def
    else:
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.train.import_meta_graph(graph_or_def, clear_devices=False)
    train_x, train_y, test_x, test_y = data
    config = tf.compat.v1.ConfigProto(device_count={"CPU": devices}, allow_soft_placement=False,
                                      intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)
    towers = len(names["inputs"])
    losses, curve, train_seconds = [], [], 0.0
    start = time.perf_counter()
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(names["init"])
        eval_feed = {names["eval"][0]: test_x, names["eval"][1]: test_y}

        def evaluate(step):
            accuracy, loss = sess.run([names["accuracy"], names["eval_loss"]], eval_feed)
            curve.append((step, float(accuracy), float(loss)))

        evaluate(0)
        for step, idx in enumerate(order, 1):
            feed = {}
            for k, (img, lbl) in enumerate(names["inputs"]):
                part = np.array_split(idx, towers)[k]
                feed[img], feed[lbl] = train_x[part], train_y[part]
            t = time.perf_counter()
            _, loss = sess.run([names["train_op"], names["loss"]], feed)
            train_seconds += time.perf_counter() - t
            losses.append(float(loss))
            if step % EVAL_EVERY == 0 or step == len(order):
                evaluate(step)
    return {"losses": np.asarray(losses), "curve": np.asarray(curve), "train_seconds": train_seconds,
            "seconds": time.perf_counter() - start}


VARIANTS = ("unsynced", "synced", "1 device")


def plot(runs: dict, path: str, steps: int) -> None:
    """runs: variant -> [result per seed]. Mean over seeds, shaded min..max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    look = {"unsynced": dict(color="tab:red", linewidth=2.0),
            "synced": dict(color="tab:blue", linewidth=3.2, alpha=0.8),
            "1 device": dict(color="black", linewidth=1.2, linestyle="--")}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    ax_loss, ax_acc, ax_eval = axes
    window = 20
    seeds = len(next(iter(runs.values())))
    for label in VARIANTS:
        results = runs[label]
        losses = np.mean([r["losses"] for r in results], axis=0)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax_loss.plot(np.arange(window, len(losses) + 1), smooth, label=label, **look[label])
        curves = np.stack([r["curve"] for r in results])  # (seeds, points, [step, accuracy, loss])
        x = curves[0, :, 0]
        final = 100 * curves[:, -1, 1]
        for ax, column, scale, name in ((ax_acc, 1, 100.0, f"{label}: {final.mean():.1f}% final"),
                                        (ax_eval, 2, 1.0, label)):
            values = scale * curves[:, :, column]
            ax.plot(x, values.mean(axis=0), label=name, **look[label])
            if label != "1 device":
                ax.fill_between(x, values.min(axis=0), values.max(axis=0), color=look[label]["color"], alpha=0.12,
                                linewidth=0)
    ax_loss.set(title="training loss (training-mode BN; 20-step average)", xlabel="step", ylabel="cross entropy",
                xlim=(0, steps), ylim=(0, 2.5))
    ax_acc.set(title="held-out accuracy (BN with moving statistics)", xlabel="step", ylabel="accuracy (%)",
               xlim=(0, steps), ylim=(80, 100))
    ax_eval.set(title="held-out loss (BN with moving statistics)", xlabel="step", ylabel="cross entropy",
                xlim=(0, steps), yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    fig.suptitle(f"sklearn digits (1,297 train / 500 held-out), conv net with 3 batch-norm layers: "
                 f"8 towers x 2 images vs 1 device x 16 images; mean of {seeds} seeds, band = min..max",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="8 towers x 2 images: unsynced, synced (bnrewrite), 1 device")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=5, help="runs with seeds 0..N-1 (initial values, batch order)")
    parser.add_argument("--out", default=os.path.join(HERE, "digits_demo.png"), help="PNG to write")
    args = parser.parse_args(argv)

    import tensorflow as tf

    from bnrewrite import rewrite_graph

    tf.get_logger().setLevel("ERROR")
    data = load_data()
    print(f"digits: {len(data[0])} training / {len(data[2])} held-out 8x8 images; {args.steps} steps of "
          f"{GLOBAL_BATCH} images; seeds 0..{args.seeds - 1}", flush=True)
    runs = {label: [] for label in VARIANTS}
    for seed in range(args.seeds):
        order = batch_order(len(data[0]), args.steps, seed)
        init = initial_values(seed)
        towers_graph, names = build(TOWERS, PER_TOWER, init)
        start = time.perf_counter()
        with towers_graph.as_default():
            meta = tf.compat.v1.train.export_meta_graph(graph=towers_graph, clear_devices=False)
        rewritten = rewrite_graph(meta)
        if seed == 0:
            print(f"bnrewrite: {len(rewritten.report.layers)} batch-norm layers x {len(rewritten.report.towers)} "
                  f"towers synced in {time.perf_counter() - start:.2f} s (backend {rewritten.report.backend})",
                  flush=True)
        one_graph, one_names = build(1, GLOBAL_BATCH, init)
        line = []
        for label, graph, graph_names, devices in (
            ("unsynced", meta, names, TOWERS),
            ("synced", rewritten.meta_graph_def, names, TOWERS),
            ("1 device", one_graph, one_names, 1),
        ):
            r = train(graph, graph_names, data, order, devices)
            runs[label].append(r)
            line.append(f"{label} {100 * r['curve'][-1, 1]:.1f}%")
        print(f"  seed {seed}: held-out accuracy " + ", ".join(line), flush=True)

    print()
    print(f"{'':<9} {'held-out accuracy':>22} {'held-out':>9} {'acc. at':>8} {'acc. at':>8} {'train loss':>11} "
          f"{'ms/step':>8}")
    print(f"{'':<9} {'final, mean (min..max)':>22} {'loss':>9} {'step 50':>8} {'step 100':>8} {'last 20':>11} "
          f"{'':>8}")
    for label in VARIANTS:
        results = runs[label]
        final = np.array([100 * r["curve"][-1, 1] for r in results])
        at = {s: np.mean([100 * r["curve"][r["curve"][:, 0] == s, 1][0] for r in results]) for s in (50, 100)
              if all((r["curve"][:, 0] == s).any() for r in results)}
        print(f"{label:<9} {final.mean():>9.1f}% ({final.min():.1f}..{final.max():.1f})"
              f" {np.mean([r['curve'][-1, 2] for r in results]):>9.3f}"
              f" {at.get(50, float('nan')):>7.1f}% {at.get(100, float('nan')):>7.1f}%"
              f" {np.mean([r['losses'][-20:].mean() for r in results]):>11.3f}"
              f" {1000 * np.mean([r['train_seconds'] for r in results]) / args.steps:>8.1f}")
    plot(runs, args.out, args.steps)
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
