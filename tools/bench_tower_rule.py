"""What the tower rule (bnrewrite/match/data_parallel.py, issue 38) costs, beside the whole rewrite
and TensorFlow's import of the same graph, repetitions interleaved in one process.

    python tools/bench_tower_rule.py [--towers 8] [--layers 50,100] [--reps 3]

For each tools/deep_net.py graph (towers on /cpu:k): the chain check every graph gets, the
chain and gradient-seed checks together (what towers told apart by scope alone get), the whole
`rewrite_graph` and `tf.graph_util.import_graph_def`; minima, and rewrite / import (goal <= 1.0).
"""

from __future__ import annotations

import argparse
import time

import tensorflow as tf

import deep_net
from bnrewrite import rewrite_graph
from bnrewrite.graph.index import Graph
from bnrewrite.match.data_parallel import not_replicas
from bnrewrite.match.towers import choose_tower_by, tower_of
from bnrewrite.rewrite.api import take_census


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _import(graph_def: tf.compat.v1.GraphDef) -> None:
    with tf.Graph().as_default():
        tf.graph_util.import_graph_def(graph_def, name="")


def measure(towers: int, layers: int, reps: int) -> str:
    graph_def = deep_net.cached_graph_def(towers, layers)
    model = Graph.from_graph_def(graph_def)
    sites = take_census(model)[2].sites
    tower = {s.name: tower_of(s, choose_tower_by(sites, "auto")) for s in sites}
    ids = sorted(set(tower.values()))
    times: dict[str, list[float]] = {"chain": [], "both": [], "rewrite": [], "import": []}
    for _ in range(reps):
        model = Graph.from_graph_def(graph_def)
        model.topological_order()  # the rewrite has it from its validation
        times["chain"].append(_timed(lambda: not_replicas(model, sites, tower, ids, one_device=False)))
        times["both"].append(_timed(lambda: not_replicas(model, sites, tower, ids, one_device=True)))
        times["rewrite"].append(_timed(lambda: rewrite_graph(graph_def)))
        times["import"].append(_timed(lambda: _import(graph_def)))
    best = {k: min(v) for k, v in times.items()}
    return (f"{towers}x{layers}: {len(graph_def.node)} nodes; chain check {best['chain'] * 1e3:.0f} ms "
            f"({best['chain'] / best['rewrite']:.1%} of the rewrite), with the gradient-seed check "
            f"{best['both'] * 1e3:.0f} ms; rewrite {best['rewrite']:.2f} s, import {best['import']:.2f} s, "
            f"rewrite/import {best['rewrite'] / best['import']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--towers", type=int, default=8)
    parser.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[50, 100])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    for layers in args.layers:
        print(measure(args.towers, layers, args.reps), flush=True)


if __name__ == "__main__":
    main()
