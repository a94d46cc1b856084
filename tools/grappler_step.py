"""Grappler's time on the training step, and the step it leaves, as built against rewritten.

    python tools/grappler_step.py [--towers 8] [--layers 50] [--backend local] [--repeats 3] [--top 14]

Takes tools/deep_net.py's T towers x L fused conv+BN layers (its cached GraphDef), rewrites it,
and gives each graph's train step (the fetch `train_op`) to Grappler with TensorFlow's default
options (`tf_optimizer.OptimizeGraph`, what a session runs before the first step, here without
the session's placement); prints the median seconds of `--repeats`, the optimized step's nodes, data
edges and control edges, and the ops whose node or data-edge counts differ most (rewritten less as
built). Why: Grappler's extra time is most of the first step's under `bnrewrite run` (issue 50),
and it follows the optimized step's size, not the GraphDef's. Per optimizer, run a session with
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=meta_optimizer=1.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import config_pb2  # noqa: E402
from tensorflow.python.grappler import tf_optimizer  # noqa: E402

import deep_net  # noqa: E402
from bnrewrite import rewrite_graph  # noqa: E402


def optimized_step(graph_def: tf.compat.v1.GraphDef, repeats: int) -> tuple[float, tf.compat.v1.GraphDef]:
    """Median seconds of Grappler on the step that runs `train_op`, and the graph it leaves."""
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
        meta = tf.compat.v1.train.export_meta_graph(graph=graph)
    meta.collection_def["train_op"].node_list.value.append("train_op")
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), meta)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


def census(graph_def: tf.compat.v1.GraphDef) -> tuple[collections.Counter, collections.Counter, int]:
    """Nodes per op, data edges per consuming op, and control edges."""
    nodes, edges, controls = collections.Counter(), collections.Counter(), 0
    for node in graph_def.node:
        nodes[node.op] += 1
        data = sum(1 for name in node.input if not name.startswith("^"))
        edges[node.op] += data
        controls += len(node.input) - data
    return nodes, edges, controls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", type=int, default=8)
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--backend", default="local")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    built = deep_net.cached_graph_def(args.towers, args.layers)
    rewritten = rewrite_graph(built, backend=args.backend, available_cpus=args.towers, available_gpus=0).graph_def
    sites = args.towers * args.layers
    found = {}
    for name, graph_def in (("as built", built), ("rewritten", rewritten)):
        seconds, out = optimized_step(graph_def, args.repeats)
        nodes, edges, controls = census(out)
        found[name] = (nodes, edges)
        print(f"{name:10s} Grappler {seconds:6.2f} s  step nodes {sum(nodes.values()):6d}  data edges "
              f"{sum(edges.values()):6d}  control edges {controls:5d}  (GraphDef {len(graph_def.node)} nodes)")
    (old_nodes, old_edges), (new_nodes, new_edges) = found["as built"], found["rewritten"]
    print(f"per op, rewritten less as built (per site: {sites} sites, {args.towers} x {args.layers}, {args.backend}):")
    delta = {op: (new_nodes[op] - old_nodes[op], new_edges[op] - old_edges[op]) for op in new_nodes | old_nodes}
    for op, (more_nodes, more_edges) in sorted(delta.items(), key=lambda kv: -abs(kv[1][1]))[:args.top]:
        print(f"  {op:22s} nodes {more_nodes:+6d} ({more_nodes / sites:+5.2f})  data edges {more_edges:+6d} "
              f"({more_edges / sites:+5.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
