"""Training step time with synchronized batch norm vs without, on virtual CPU devices.

    python tools/bench_step.py [--towers 4] [--layers 10] [--channels 32] [--image 16]
                               [--batch 8] [--steps 30] [--warmup 5]

Builds the tools/deep_net.py training graph (one tower per virtual CPU device), rewrites it
with bnrewrite (collective backend), and times `train_op` in a tf.compat.v1.Session for both
graphs, alternating blocks of steps so both see the same machine load. Prints the median
step time of each, their ratio, and examples per second. On CPU the all-reduces are memory
copies between devices of one process, so the ratio measures the extra arithmetic and the
synchronization points, not a network.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import deep_net  # noqa: E402


class Trainer:
    """A session over one GraphDef, fed the same random batches as every other Trainer."""

    def __init__(self, graph_def, towers: int, device_kind: str = "CPU") -> None:
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        config = tf.compat.v1.ConfigProto(allow_soft_placement=device_kind != "CPU")
        if device_kind == "CPU":
            config.device_count["CPU"] = towers
        else:
            config.gpu_options.allow_growth = True
        self.session = tf.compat.v1.Session(graph=self.graph, config=config)
        self.session.run("init")
        self.towers = towers
        self.train_op = self.graph.get_operation_by_name("train_op")

    def feeds(self, rng: np.random.Generator) -> dict:
        feeds = {}
        for k in range(self.towers):
            images = self.graph.get_tensor_by_name(f"tower_{k}/images:0")
            labels = self.graph.get_tensor_by_name(f"tower_{k}/labels:0")
            feeds[images] = rng.standard_normal(images.shape.as_list()).astype(np.float32)
            feeds[labels] = rng.integers(0, 10, labels.shape.as_list()).astype(np.int32)
        return feeds

    def time_steps(self, steps: int, seed: int) -> list[float]:
        rng = np.random.default_rng(seed)
        batches = [self.feeds(rng) for _ in range(steps)]
        times = []
        for feeds in batches:
            start = time.perf_counter()
            self.session.run(self.train_op, feeds)
            times.append(time.perf_counter() - start)
        return times


def compare(graph_def, synced_def, towers: int, steps: int, warmup: int, device_kind: str = "CPU") -> dict:
    plain, synced = Trainer(graph_def, towers, device_kind), Trainer(synced_def, towers, device_kind)
    plain.time_steps(warmup, seed=0)
    synced.time_steps(warmup, seed=0)
    times: dict[str, list[float]] = {"unsynced": [], "synced": []}
    block = max(1, steps // 5)
    for i in range(0, steps, block):
        times["unsynced"] += plain.time_steps(block, seed=1 + i)
        times["synced"] += synced.time_steps(block, seed=1 + i)
    return {k: statistics.median(v) for k, v in times.items()} | {"steps": len(times["synced"])}


def step_arguments(doc: str, towers: int, layers: int, channels: int, image: int, batch: int, steps: int,
                   warmup: int, towers_help: str | None = None) -> argparse.ArgumentParser:
    """The command line of a step-time script: the deep_net graph's sizes and how many steps."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", type=int, default=towers, help=towers_help)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--channels", type=int, default=channels)
    parser.add_argument("--image", type=int, default=image)
    parser.add_argument("--batch", type=int, default=batch, help="examples per tower")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = step_arguments(__doc__, towers=4, layers=10, channels=32, image=16, batch=8, steps=30, warmup=5).parse_args(argv)

    from bnrewrite import rewrite_graph

    graph_def = deep_net.build_graph_def(args.towers, args.layers, channels=args.channels, image=args.image, batch=args.batch)
    synced = rewrite_graph(graph_def, backend="collective")
    result = compare(graph_def, synced.graph_def, args.towers, args.steps, args.warmup)
    examples = args.towers * args.batch
    print(f"\n== training step on {args.towers} virtual CPU devices ({os.cpu_count()} cores): "
          f"{args.layers} conv+BN layers, {args.channels} channels, {args.image}x{args.image} images, "
          f"{args.batch} per tower ==")
    print(f"{'graph':<10} {'median step ms':>15} {'examples/s':>11}")
    for key in ("unsynced", "synced"):
        print(f"{key:<10} {result[key] * 1e3:>15.1f} {examples / result[key]:>11.0f}")
    print(f"synced / unsynced step time: {result['synced'] / result['unsynced']:.2f} "
          f"(median of {result['steps']} steps each after {args.warmup} warm-up steps; "
          f"{synced.report.collectives} all-reduces added)")


if __name__ == "__main__":
    main()
