"""Latency of one all-reduce between virtual CPU devices: the local backend's AddN against
CollectiveReduceV2, the two bnrewrite can use for towers of one process on CPUs.

    python tools/bench_all_reduce.py [--towers 4] [--channels 32,64,256] [--chain 40] [--steps 20]

Per channel count C, a float64 [2C+1] vector per tower (a forward all-reduce's payload) goes
through `--chain` all-reduces in a row, each fed by the previous one's result, so every one
waits for the last: the step's wall time over the chain is the time from one all-reduce's
launch to its result on every tower, which a synced layer waits for. "none" is the same chain
without any all-reduce (each tower scales its own vector): the executor's cost per link.
Also the process CPU time per all-reduce (all threads). Median over `--steps` steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1
KINDS = ("none", "local", "collective")


def chain(kind: str, towers: int, size: int, links: int) -> tuple[tf.Graph, list[tf.Tensor], list[tf.Tensor]]:
    """`links` all-reduces of `kind` in a row over `towers` devices: (graph, inputs, outputs)."""
    graph = tf.Graph()
    with graph.as_default():
        inputs = []
        for k in range(towers):
            with tf.device(f"/cpu:{k}"):
                inputs.append(tf1.placeholder(tf.float64, [size], name=f"x{k}"))
        current = inputs
        for link in range(links):
            halves = []
            for k in range(towers):
                with tf.device(f"/cpu:{k}"):
                    halves.append(current[k] * 0.5)
            if kind == "local":
                with tf.device("/cpu:0"):
                    total = tf.add_n(halves)
                current = []
                for k in range(towers):
                    with tf.device(f"/cpu:{k}"):
                        current.append(tf.identity(total))
            elif kind == "collective":
                current = []
                for k in range(towers):
                    with tf.device(f"/cpu:{k}"):
                        current.append(tf.raw_ops.CollectiveReduceV2(
                            input=halves[k], group_size=towers, group_key=1, instance_key=link + 1, ordering_token=[],
                            merge_op="Add", final_op="Id"))
            else:
                current = halves
    return graph, inputs, current


def measure(kind: str, towers: int, size: int, links: int, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per link, medians over `steps` steps after 3 warm-up steps."""
    graph, inputs, outputs = chain(kind, towers, size, links)
    config = tf1.ConfigProto()
    config.device_count["CPU"] = towers
    with tf1.Session(graph=graph, config=config) as session:
        feeds = {x: np.ones(size) for x in inputs}
        for _ in range(3):
            session.run(outputs, feeds)
        wall, cpu = [], []
        for _ in range(steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            session.run(outputs, feeds)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall) / links, statistics.median(cpu) / links


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--channels", default="32,64,256")
    parser.add_argument("--chain", type=int, default=40)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    print(f"K={args.towers} virtual CPU devices ({os.cpu_count()} cores); µs per all-reduce of a float64 [2C+1]"
          f" vector, {args.chain} in a row")
    print(f"{'C':>6} " + " ".join(f"{kind + ' wall':>16} {kind + ' CPU':>15}" for kind in KINDS))
    for channels in (int(c) for c in args.channels.split(",")):
        cells = []
        for kind in KINDS:
            wall, cpu = measure(kind, args.towers, 2 * channels + 1, args.chain, args.steps)
            cells.append(f"{wall * 1e6:>16.1f} {cpu * 1e6:>15.1f}")
        print(f"{channels:>6} " + " ".join(cells))


if __name__ == "__main__":
    main()
