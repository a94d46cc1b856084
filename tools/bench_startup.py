"""Start-up cost of `bnrewrite run` / `enable()`: what creating the first session on a training
graph costs, side by side with TensorFlow's own import of the same graph.

    python tools/bench_startup.py [--configs 8x50,8x130] [--reps 3]

For each tools/deep_net.py graph (towers x conv+BN layers), repetitions interleaved, in one process:

  import    tf.graph_util.import_graph_def(graph_def) into a fresh tf.Graph
  session   tf.compat.v1.Session(graph=g) under bnrewrite.enable(), g a fresh import of the
            graph (not timed): the export of g, the rewrite and the shadow's import
  plain     tf.compat.v1.Session(graph=g) without bnrewrite

Prints medians and session / import (the goal: 2.0 or less).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

import bnrewrite  # noqa: E402
import deep_net  # noqa: E402

tf1 = tf.compat.v1


def _imported(graph_def: tf1.GraphDef) -> tuple[tf.Graph, float]:
    graph = tf.Graph()
    start = time.perf_counter()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return graph, time.perf_counter() - start


def _session(graph: tf.Graph, live: bool) -> float:
    start = time.perf_counter()
    if live:
        with bnrewrite.enabled(quiet=True):
            sess = tf1.Session(graph=graph)
    else:
        sess = tf1.Session(graph=graph)
    seconds = time.perf_counter() - start
    sess.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="8x50,8x130")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(f"{'graph':>8} {'nodes':>7} {'import s':>9} {'session s':>10} {'plain s':>8} {'session/import':>15}")
    for config in args.configs.split(","):
        towers, layers = (int(v) for v in config.split("x"))
        graph_def = deep_net.cached_graph_def(towers, layers)
        imports, sessions, plains = [], [], []
        for _ in range(args.reps):
            imports.append(_imported(graph_def)[1])
            sessions.append(_session(_imported(graph_def)[0], live=True))
            plains.append(_session(_imported(graph_def)[0], live=False))
        i, s, p = statistics.median(imports), statistics.median(sessions), statistics.median(plains)
        print(f"{config:>8} {len(graph_def.node):>7} {i:>9.2f} {s:>10.2f} {p:>8.3f} {s / i:>15.2f}")


if __name__ == "__main__":
    main()
