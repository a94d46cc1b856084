"""The first step's cost of `bnrewrite run --verify` (issue 35): session start-up, first, second
and later steps under `enable()` and `enable(verify=True)`, and the bytes the check fetches.

    python tools/bench_verify_run.py [--models deep,inception] [--reps 3] [--later 3]

Models, K virtual CPUs (`device_count={"CPU": K}`), one tower per device:

  deep       tools/deep_net.py at tools/bench_step.py's default size: 10 conv+BN layers,
             32 channels, 16x16 images, 8 per tower, K=4
  inception  tf_keras.applications.InceptionV3(weights=None, input_shape=(107, 107, 3),
             classes=10), one model called per tower (shared variables) in graph mode with
             training=True, averaged gradients, each tower's moving-average updates in the train
             op; 94 batch-norm layers, 2 per tower, K=2

Each repetition imports the same GraphDef into a fresh tf.Graph (not timed) and, in turn with
and without verify (the order alternates between repetitions, so both share the machine's
load), times the session's creation (the rewrite and the shadow's import: a verified shadow is
imported with Python Operations and gets the check's ops), `init` (not timed), the first
`sess.run("train_op", feeds)` (with verify: the reads before and after it and the evaluation
too), the second step and `--later` further steps. Wall and process CPU time; medians.
The bytes fetched are the sum of `nbytes` of every value the check's evaluation receives
(its before, step and after lists), recorded by wrapping `StepCheck.evaluate`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import bnrewrite  # noqa: E402
import deep_net  # noqa: E402
from bnrewrite.session import first_step, live, stepcheck  # noqa: E402

tf1 = tf.compat.v1
PHASES = ("session", "first", "second", "later")


@dataclass(frozen=True)
class Model:
    name: str
    graph_def: tf1.GraphDef
    towers: int
    batch: int
    image: int
    layers: int


def deep_model() -> Model:
    """tools/bench_step.py's default size."""
    towers, layers, channels, image, batch = 4, 10, 32, 16, 8
    graph_def = deep_net.build_graph_def(towers, layers, channels=channels, image=image, batch=batch)
    return Model(f"deep_net {layers} conv+BN, {channels} ch, {image}x{image}, {batch}/tower, K={towers}",
                 graph_def, towers, batch, image, layers)


def inception_model(towers: int = 2, batch: int = 2, image: int = 107) -> Model:
    """InceptionV3 per tower in graph mode. Keras builds the functional model once on its own
    Input, where batch norm is a cond on the symbolic learning phase (cond_v2 functions); those
    ops never run in the step, and are dropped (extract_sub_graph from train_op, init and the
    loss, and the library cleared once no node calls it): bnrewrite refuses the graph with them."""
    import tf_keras

    graph = tf.Graph()
    with graph.as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = tf1.train.MomentumOptimizer(0.1, 0.9)
        model, tower_grads, losses = None, [], []
        for k in range(towers):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"):
                images = tf1.placeholder(tf.float32, [batch, image, image, 3], name="images")
                labels = tf1.placeholder(tf.int32, [batch], name="labels")
                if model is None:
                    model = tf_keras.applications.InceptionV3(weights=None, input_shape=(image, image, 3), classes=10,
                                                              classifier_activation=None)
                known = set(graph.get_operations())
                logits = model(images, training=True)
                # Keras keeps its updates out of UPDATE_OPS: this call's moving-average assigns.
                for op in graph.get_operations():
                    if op not in known and op.type == "AssignSubVariableOp":
                        tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, op)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
                losses.append(loss)
                tower_grads.append(opt.compute_gradients(loss, var_list=model.trainable_weights))
        with tf.device("/cpu:0"), tf.name_scope("average"):
            averaged = [tf.add_n([g for g, _ in per_var]) / float(towers) for per_var in zip(*tower_grads)]
            tf.identity(tf.add_n(losses) / float(towers), name="loss")
        apply = opt.apply_gradients([(g, v) for g, (_, v) in zip(averaged, tower_grads[0])])
        tf.group(apply, *tf1.get_collection(tf1.GraphKeys.UPDATE_OPS), name="train_op")
        tf1.global_variables_initializer()
        layers = sum(op.type == "FusedBatchNormV3" for op in graph.get_operations()) // towers
        graph_def = tf1.graph_util.extract_sub_graph(graph.as_graph_def(), ["train_op", "init", "average/loss"])
    called = {node.op for node in graph_def.node}
    if not any(f.signature.name in called for f in graph_def.library.function):
        del graph_def.library.function[:]
    return Model(f"InceptionV3 {image}x{image}, {batch}/tower, K={towers}", graph_def, towers, batch, image, layers)


class Recorder:
    """Wraps the check's evaluation (the bytes it fetched) and its reads around the step (time)."""

    def __init__(self) -> None:
        self.fetched: tuple[int, int, int] = (0, 0, 0)  # before, step, after
        self.reads = 0.0
        evaluate, read = stepcheck.StepCheck.evaluate, first_step._read

        def recorded_evaluate(check: stepcheck.StepCheck, before: list, step: list, after: list, *ran: Any) -> Any:
            self.fetched = tuple(sum(np.asarray(v).nbytes for v in values) for values in (before, step, after))
            return evaluate(check, before, step, after, *ran)

        def timed_read(session: tf1.Session, outputs: list) -> list:
            start = time.perf_counter()
            try:
                return read(session, outputs)
            finally:
                self.reads += time.perf_counter() - start

        stepcheck.StepCheck.evaluate, first_step._read = recorded_evaluate, timed_read


def feeds(model: Model, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{name: value for k in range(model.towers) for name, value in (
        (f"tower_{k}/images:0", rng.standard_normal([model.batch, model.image, model.image, 3], np.float32)),
        (f"tower_{k}/labels:0", rng.integers(0, 10, [model.batch]).astype(np.int32)))} for _ in range(count)]


def timed(run: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def one(model: Model, verify: bool, batches: list[dict], recorder: Recorder) -> dict[str, tuple[float, float]]:
    """Wall and CPU seconds of each phase in a fresh graph and session."""
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(model.graph_def, name="")
    config = tf1.ConfigProto(device_count={"CPU": model.towers})
    holder: list[tf1.Session] = []
    with bnrewrite.enabled(quiet=True, verify=verify):
        out = {"session": timed(lambda: holder.append(tf1.Session(graph=graph, config=config)))}
    sess = holder[0]
    try:
        sess.run("init")
        recorder.reads = 0.0
        out["first"] = timed(lambda: sess.run("train_op", batches[0]))
        out["reads"] = (recorder.reads, float("nan"))
        out["second"] = timed(lambda: sess.run("train_op", batches[1]))
        later = [timed(lambda: sess.run("train_op", feed)) for feed in batches[2:]]
        out["later"] = tuple(statistics.median(t[i] for t in later) for i in (0, 1))
    finally:
        sess.close()
    record = live.records()[-1]
    if verify and not record.get("verify", {}).get("passed"):
        raise SystemExit(f"{model.name}: the first step was not verified: {record}")
    return out


def measure(model: Model, reps: int, later: int, recorder: Recorder) -> dict[bool, dict[str, list[tuple[float, float]]]]:
    times: dict[bool, dict[str, list[tuple[float, float]]]] = {False: defaultdict(list), True: defaultdict(list)}
    batches = feeds(model, 2 + later, seed=0)
    for rep in range(reps):
        for verify in ((False, True) if rep % 2 == 0 else (True, False)):
            for phase, value in one(model, verify, batches, recorder).items():
                times[verify][phase].append(value)
    return times


def report(model: Model, times: dict[bool, dict[str, list[tuple[float, float]]]], fetched: tuple[int, int, int],
           reps: int) -> None:
    med = {v: {p: tuple(statistics.median(t[i] for t in times[v][p]) for i in (0, 1)) for p in times[v]}
           for v in times}
    verdict = live.records()[-1].get("verify", {})
    print(f"\n== {model.name}: {model.layers} BN layers; median of {reps} repetitions (wall s / CPU s) ==")
    print(f"{'phase':<8} {'enable()':>17} {'verify=True':>17} {'× wall':>7} {'+ wall s':>9} {'× CPU':>7}")
    for phase in PHASES:
        (w0, c0), (w1, c1) = med[False][phase], med[True][phase]
        print(f"{phase:<8} {w0:>8.3f} /{c0:>7.3f} {w1:>8.3f} /{c1:>7.3f} {w1 / w0:>7.2f} {w1 - w0:>+9.3f} {c1 / c0:>7.2f}")
    first_plus_session = [sum(med[v][p][0] for p in ("session", "first")) for v in (False, True)]
    print(f"session + first step: {first_plus_session[0]:.3f} s -> {first_plus_session[1]:.3f} s "
          f"(x {first_plus_session[1] / first_plus_session[0]:.2f})")
    print(f"verify's first step: reads before and after + their own setup {med[True]['reads'][0]:.3f} s of "
          f"{med[True]['first'][0]:.3f} s; worst figure {verdict.get('worst', float('nan')):.1e} "
          f"({verdict.get('worst_at', '')})")
    images = 4 * model.batch * model.image**2 * 3 * model.towers
    print(f"fetched by the check: {sum(fetched)} bytes ({sum(fetched) / 1024:.1f} KiB: before {fetched[0]}, "
          f"with the step {fetched[1]}, after {fetched[2]}; the step's float32 input images, all towers: "
          f"{images / 1024:.0f} KiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="deep,inception", help="comma-separated, of deep, inception")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each (verify, no verify) pair")
    parser.add_argument("--later", type=int, default=3, help="steps after the second whose median is 'later'")
    args = parser.parse_args()
    builders = {"deep": deep_model, "inception": inception_model}
    recorder = Recorder()
    print(f"load average {os.getloadavg()[0]:.2f} at start, {os.cpu_count()} cores")
    for name in args.models.split(","):
        start = time.perf_counter()
        model = builders[name]()
        print(f"{model.name}: built in {time.perf_counter() - start:.1f} s, {len(model.graph_def.node)} nodes")
        times = measure(model, args.reps, args.later, recorder)
        report(model, times, recorder.fetched, args.reps)
        sys.stdout.flush()
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
