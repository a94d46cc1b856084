"""A whole training process on the benchmark graphs of tools/bench_rewrite.py (8 towers x 50 or
100 conv+BN layers, tools/deep_net.py), for the time to the first step under `bnrewrite run`
against python alone (issue 42).

    python tools/deep_train.py [--towers 8] [--layers 50] [--steps 1]
    bnrewrite run tools/deep_train.py [same arguments]

Builds the graph in the process (as a script would), opens a session on `--towers` virtual
CPUs, initializes, runs `--steps` steps of the train op; prints the seconds of the build, of
the session with `init` and the first step (the time to the first step, as a user waits for
it), and of the steps after it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import deep_net  # noqa: E402

tf1 = tf.compat.v1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--towers", type=int, default=8)
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    start = time.perf_counter()
    graph = deep_net.build_graph(args.towers, args.layers)
    built = time.perf_counter()
    rng = np.random.default_rng(0)
    feed = {}
    for k in range(args.towers):
        images = graph.get_tensor_by_name(f"tower_{k}/images:0")
        feed[images] = rng.standard_normal(images.shape.as_list()).astype(np.float32)
        feed[graph.get_tensor_by_name(f"tower_{k}/labels:0")] = np.zeros(images.shape[0], np.int32)
    with tf1.Session(graph=graph, config=tf1.ConfigProto(device_count={"CPU": args.towers})) as sess:
        sess.run("init")
        sess.run("train_op", feed)
        first = time.perf_counter()
        for _ in range(args.steps - 1):
            sess.run("train_op", feed)
        done = time.perf_counter()
    later = (done - first) / max(args.steps - 1, 1)
    print(f"build {built - start:.2f} s, session + init + first step {first - built:.2f} s, later steps {later:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
