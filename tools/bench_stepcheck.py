"""What the step check (bnrewrite/session/stepcheck.py) costs: first step and later steps with and without
its ops, and the bytes it fetches against fetching every layer's x and y.

    python tools/bench_stepcheck.py [--towers 4] [--size default] [--repeats 3] [--steps 5]

tools/bench_step.py's model (tools/deep_net.py, the size named) rewritten by bnrewrite, on K
virtual CPUs. Each repeat opens two fresh sessions over the same rewritten graph, one with the
check ops built in and one without, and times their first step (the one `bnrewrite verify` and
`run --verify` run: graph optimization and kernel setup included) and `--steps` later steps; the
two sessions take turns, so they share the machine's load. The medians are printed.
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

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import deep_net  # noqa: E402
from bench_step import SIZES, make_batches  # noqa: E402
from step_variants import tower_inputs  # noqa: E402

from bnrewrite import rewrite_graph  # noqa: E402
from bnrewrite.session import stepcheck  # noqa: E402

tf1 = tf.compat.v1


def session(graph_def: tf1.GraphDef, report, towers: int, checked: bool) -> tuple[tf1.Session, stepcheck.StepCheck | None]:
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    check = stepcheck.build(graph, graph_def, report, python_ops=True) if checked else None
    config = tf1.ConfigProto(device_count={"CPU": towers})
    sess = tf1.Session(graph=graph, config=config)
    sess.run("init")
    return sess, check


def steps(sess: tf1.Session, check: stepcheck.StepCheck | None, feeds: list[dict]) -> tuple[list[float], list[float], int, str]:
    """Wall seconds of each step (the train op, with the check's fetches when checked), of the
    reads before and after it and the evaluation (checked only), the bytes the check fetched and
    its verdict's line."""
    times, around, fetched, line = [], [], 0, ""
    for feed in feeds:
        if check is None:
            start = time.perf_counter()
            sess.run("train_op", feed)
            times.append(time.perf_counter() - start)
            continue
        start = time.perf_counter()
        before = sess.run(check.before)
        middle = time.perf_counter()
        values = sess.run(["train_op"] + check.step, {**feed, **check.feed(before)})[1:]
        end = time.perf_counter()
        after = sess.run(check.after)
        line = check.evaluate(before, values, after).line()
        times.append(end - middle)
        around.append(time.perf_counter() - end + middle - start)
        fetched = sum(np.asarray(v).nbytes for v in (*before, *values, *after))
    return times, around, fetched, line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--size", default="default", choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    size = SIZES[args.size]
    plain = deep_net.build_graph_def(args.towers, size.layers, channels=size.channels, image=size.image,
                                     batch=size.batch, device="cpu", dtype="float32", shapes=True)
    result = rewrite_graph(plain)
    names = tower_inputs(args.towers)
    feeds = [{name: value for pair, values in zip(names, batch) for name, value in zip(pair, values)}
             for batch in make_batches(args.towers, size, 1 + args.steps, seed=0)]
    first: dict[bool, list[float]] = {False: [], True: []}
    later: dict[bool, list[float]] = {False: [], True: []}
    around: list[float] = []
    fetched, verdict = 0, ""
    for _ in range(args.repeats):
        for checked in (False, True):
            sess, check = session(result.graph_def, result.report, args.towers, checked)
            times, reads, bytes_fetched, line = steps(sess, check, feeds)
            sess.close()
            fetched, verdict = bytes_fetched or fetched, line or verdict
            first[checked].append(times[0])
            later[checked].extend(times[1:])
            around.extend(reads[:1])
    activations = 2 * 4 * size.batch * size.image**2 * size.channels * len(result.report.layers) * args.towers
    print(f"{size}, {args.towers} towers, {len(result.report.layers)} synced layers, {args.repeats} repeats")
    for checked in (False, True):
        label = "with the check" if checked else "without"
        print(f"  {label:15} first step {statistics.median(first[checked]):.3f} s, "
              f"later steps {statistics.median(later[checked]) * 1e3:.1f} ms")
    print(f"  reads before and after the first step and the evaluation: {statistics.median(around):.3f} s")
    print(f"  {verdict}")
    print(f"  fetched by the check: {fetched} bytes; every layer's x and y in float32 would be {activations} bytes")


if __name__ == "__main__":
    main()
