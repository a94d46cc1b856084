"""`bnrewrite check`: the oracle, run on the user's own machine.

No machine of this project can run TensorFlow on GPUs, so the NCCL backend most users get has
only been checked for structure here. `check` lets a user find out, on the machine they will
train on, whether the rewrite is exact there: it builds a small multi-tower conv+BN training
graph per case (fused and unfused batch norm, NHWC and NCHW), rewrites it with the backend the
user would get, trains it a few steps beside the un-rewritten graph and one device fed the
whole batch, and compares. The cases run in a child process, each under a deadline, so an
all-reduce that never completes (NCCL refusing two logical devices on one GPU, a tower that
never launches) is reported, with the phase it blocked in, instead of hanging; the child is
then stopped and a new one takes the cases after it (one child imports TensorFlow once for
all the cases that answer).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

#: (batch norm, data format) of every case.
CASES = (("fused", "NHWC"), ("fused", "NCHW"), ("unfused", "NHWC"), ("unfused", "NCHW"))
#: A case passes when the rewritten graph is this close to one device (float32 rounding over a
#: few steps is ~1e-6) and the un-rewritten graph is at least UNSYNCED_MIN away (else the check
#: could not have failed).
TOLERANCE, UNSYNCED_MIN = 1e-4, 1e-2
_BATCH, _IMAGE, _CHANNELS, _FILTERS, _CLASSES = 4, 8, 3, 8, 4
_MOMENTUM, _EPSILON = 0.9, 1e-3


@dataclass
class CaseResult:
    case: str
    backend: str
    towers: int
    passed: bool = False
    error: float | None = None  # max relative error of the rewritten graph vs one device
    unsynced_error: float | None = None  # the same for the un-rewritten graph
    all_reduces_per_layer: int | None = None  # per tower and step: forward + backward
    step_ms: float | None = None  # median step time, rewritten graph
    unsynced_step_ms: float | None = None
    message: str | None = None  # why it failed or was skipped


@dataclass
class CheckReport:
    backend: str
    devices: str
    cases: list[CaseResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    def __str__(self) -> str:
        lines = [f"bnrewrite check: backend {self.backend} on {self.devices}"]
        lines += [f"  {s}" for s in self.skipped]
        lines.append("")
        header = ("case", "towers", "synced error", "un-synced error", "all-reduces/layer/tower", "step synced / un-synced", "")
        rows = [header]
        for c in self.cases:
            step = (f"{c.step_ms:.1f} / {c.unsynced_step_ms:.1f} ms ({c.step_ms / c.unsynced_step_ms:.2f}x)"
                    if c.step_ms and c.unsynced_step_ms else "-")
            rows.append((c.case, str(c.towers), _figure(c.error), _figure(c.unsynced_error),
                         "-" if c.all_reduces_per_layer is None else str(c.all_reduces_per_layer), step,
                         "PASS" if c.passed else "FAIL"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines += [f"  {c.case}: {c.message}" for c in self.cases if c.message]
        lines.append("  (step times are those of a tiny model, mostly per-op overhead, not what synchronization costs "
                     "a real model: time your own training step before and after the rewrite)")
        lines.append("")
        lines.append(f"{'PASS' if self.passed else 'FAIL'}: rewritten graph within {TOLERANCE:g} of one device "
                     f"fed the whole batch, un-rewritten graph more than {UNSYNCED_MIN:g} away, in "
                     f"{sum(c.passed for c in self.cases)} of {len(self.cases)} case(s)")
        return "\n".join(lines) + "\n"


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def check(backend: str = "auto", towers: int | None = None, steps: int = 4, timeout_seconds: float = 120.0) -> CheckReport:
    """Run every case with `backend` ("auto": NCCL on 2 or more GPUs, else the local backend on
    virtual CPUs) on `towers` towers (default: every GPU, or 2 virtual CPUs)."""
    from bnrewrite.errors import BackendError
    from bnrewrite.rewrite.arguments import BACKENDS

    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if steps < 2:
        raise BackendError(f"steps={steps}: the check needs at least 2 steps (the first is not timed)")
    if towers is not None and towers < 2:
        raise BackendError(f"towers={towers}: synchronizing needs 2 or more towers")
    gpus = _gpu_count(timeout_seconds)
    skipped = []
    if backend == "auto":
        backend = "nccl" if gpus >= 2 else "local"
        if backend == "local":
            skipped.append(f"nccl: skipped: TensorFlow sees {gpus} GPU(s) here; NCCL needs 2 or more "
                           "(with one GPU, --backend nccl --towers 2 tries two logical GPUs on it)")
    if backend == "nccl" and not gpus:
        raise BackendError('backend="nccl" needs GPUs, and TensorFlow sees none here; use backend="local"')
    device = "gpu" if backend == "nccl" else "cpu"
    towers = towers or max(gpus if backend == "nccl" else 2, 2)
    logical = device == "gpu" and towers > gpus
    devices = (f"{towers} {'logical ' if logical else ''}GPU(s) of {gpus}" if device == "gpu"
               else f"{towers} virtual CPU devices")
    report = CheckReport(backend, devices, skipped=skipped)
    cases = [f"{norm} {data_format}" for norm, data_format in CASES]
    while len(report.cases) < len(cases):
        report.cases += _run_cases(cases[len(report.cases):], backend, towers, steps, timeout_seconds)
    return report


def _gpu_count(timeout_seconds: float) -> int:
    """GPUs TensorFlow sees, asked in a child process: initializing CUDA here would pin this
    process's device setup before the cases choose theirs."""
    code = "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_seconds,
                              env=_child_env())
        return int(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return 0


def _child_env() -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3")}


def _run_cases(cases: list[str], backend: str, towers: int, steps: int, timeout_seconds: float) -> list[CaseResult]:
    """`cases` in turn in one child process, each under its deadline: their results up to and
    including the first that does not answer (out of time, or the child died), which fails
    with the phase it was in."""
    command = [sys.executable, "-m", "bnrewrite.rewrite.selfcheck", "--cases", ",".join(cases), "--backend", backend,
               "--towers", str(towers), "--steps", str(steps), "--timeout", str(timeout_seconds)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env())
    lines: queue.Queue[str | None] = queue.Queue()
    errors: list[str | None] = []
    readers = [threading.Thread(target=_read_lines, args=(proc.stdout, lines.put), daemon=True),
               threading.Thread(target=_read_lines, args=(proc.stderr, errors.append), daemon=True)]
    for reader in readers:
        reader.start()
    results: list[CaseResult] = []
    phase, deadline = "starting", time.monotonic() + timeout_seconds
    try:
        while len(results) < len(cases):
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                hint = (" (NCCL may refuse several logical devices on one GPU, or a tower's all-reduce never started)"
                        if backend == "nccl" else "")
                message = f"no answer within {timeout_seconds:g} s while {phase}{hint}; stopped"
                return results + [CaseResult(cases[len(results)], backend, towers, message=message)]
            if line is None:  # the child ended without answering for this case
                code = proc.wait()
                readers[1].join(timeout=5)
                why = next((e.strip() for e in reversed(errors) if e and e.strip()), "no message")
                message = f"failed while {phase} (exit {code}): {why}"
                return results + [CaseResult(cases[len(results)], backend, towers, message=message)]
            answer = json.loads(line) if line.startswith("{") else {}
            phase = answer.get("phase", phase)
            if "result" in answer:
                results.append(CaseResult(**answer["result"]))
                phase, deadline = "starting", time.monotonic() + timeout_seconds
        return results
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _read_lines(stream: Any, put: Any) -> None:
    """Pass every line of `stream` to `put`, then None (the end)."""
    for line in stream:
        put(line)
    put(None)


# ---------------------------------------------------------------------------
# The child: the cases in turn
# ---------------------------------------------------------------------------


def _phase(name: str) -> None:
    print(json.dumps({"phase": name}), flush=True)


def run_case(case: str, backend: str, towers: int, steps: int, timeout_seconds: float) -> CaseResult:
    """Build, rewrite and train one case in this process."""
    import numpy as np

    from bnrewrite.rewrite.api import rewrite_graph

    norm, data_format = case.split()
    device = "gpu" if backend == "nccl" else "cpu"
    _phase("building the graphs")
    built = _build(norm, data_format, towers, _BATCH, device)
    reference = _build(norm, data_format, 1, towers * _BATCH, device)
    _phase(f"rewriting with backend {backend}")
    rewritten = rewrite_graph(built["graph"], backend=backend, timeout_seconds=timeout_seconds if backend != "nccl" else 0.0)
    per_layer = {row.collectives // towers for row in rewritten.report.layers}
    rng = np.random.default_rng(0)
    shape = (towers * _BATCH, _IMAGE, _IMAGE, _CHANNELS)
    # Each tower's slice scaled and shifted its own way: per-tower statistics are far off.
    spread = np.repeat(np.arange(towers, dtype=np.float32), _BATCH)[:, None, None, None]
    batches = [((rng.normal(size=shape) * (1 + spread) + spread).astype(np.float32),
                rng.integers(0, _CLASSES, towers * _BATCH).astype(np.int32)) for _ in range(steps)]
    config = _session_config(device, towers)
    _phase("training one device")
    expected, _ = _train(reference["graph"].as_graph_def(), reference, batches, _session_config(device, 1))
    _phase(f"training the rewritten graph ({backend} all-reduces)")
    synced, step = _train(rewritten.graph_def, built, batches, config)
    _phase("training the un-rewritten graph")
    unsynced, unsynced_step = _train(built["graph"].as_graph_def(), built, batches, config)
    error, off = _max_rel_error(synced, expected), _max_rel_error(unsynced, expected)
    passed = error <= TOLERANCE and off > UNSYNCED_MIN and len(per_layer) == 1
    message = None
    if off <= UNSYNCED_MIN:
        message = f"the un-rewritten graph is only {off:.1e} from one device: this case cannot tell"
    elif error > TOLERANCE:
        message = f"the rewritten graph is {error:.1e} from one device (tolerance {TOLERANCE:g})"
    return CaseResult(case, backend, towers, passed, error, off, per_layer.pop() if len(per_layer) == 1 else None,
                      step * 1e3, unsynced_step * 1e3, message)


def _session_config(device: str, towers: int) -> Any:
    import tensorflow as tf

    if device == "cpu":
        return tf.compat.v1.ConfigProto(device_count={"CPU": towers}, allow_soft_placement=False,
                                        inter_op_parallelism_threads=max(2, towers), intra_op_parallelism_threads=1)
    config = tf.compat.v1.ConfigProto(allow_soft_placement=False)
    if towers > len(tf.config.list_physical_devices("GPU")):  # `towers` logical GPUs on the first one
        config.gpu_options.visible_device_list = "0"
        config.gpu_options.experimental.virtual_devices.add(memory_limit_mb=[1024] * towers)
    else:
        config.gpu_options.allow_growth = True
    return config


def _build(norm: str, data_format: str, towers: int, batch: int, device: str) -> dict[str, Any]:
    """conv3x3-BN-relu twice, global mean, dense; variables shared by the towers (tower k on
    /device:k, name scope tower_k), gradients averaged, one Momentum update per step."""
    import numpy as np
    import tensorflow as tf

    tf1 = tf.compat.v1
    rng = np.random.default_rng(1)
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(f"/{device}:0"), tf1.variable_scope("net", use_resource=True):
            def variable(name: str, value: Any, trainable: bool = True) -> Any:
                return tf1.get_variable(name, initializer=np.asarray(value, np.float32), trainable=trainable)

            weights = {
                "conv1": variable("conv1", rng.normal(size=(3, 3, _CHANNELS, _FILTERS)) / np.sqrt(9 * _CHANNELS)),
                "conv2": variable("conv2", rng.normal(size=(3, 3, _FILTERS, _FILTERS)) / np.sqrt(9 * _FILTERS)),
                "dense": variable("dense", rng.normal(size=(_FILTERS, _CLASSES)) / np.sqrt(_FILTERS)),
            }
            for i in (1, 2):
                weights[f"gamma{i}"] = variable(f"bn{i}/gamma", 1 + 0.1 * rng.normal(size=_FILTERS))
                weights[f"beta{i}"] = variable(f"bn{i}/beta", 0.1 * rng.normal(size=_FILTERS))
                weights[f"mean{i}"] = variable(f"bn{i}/moving_mean", np.zeros(_FILTERS), trainable=False)
                weights[f"variance{i}"] = variable(f"bn{i}/moving_variance", np.ones(_FILTERS), trainable=False)
        opt = tf1.train.MomentumOptimizer(0.05, 0.9)
        inputs, losses, grads, updates = [], [], [], []
        for k in range(towers):
            with tf.device(f"/{device}:{k}"), tf.name_scope(f"tower_{k}"):
                images = tf1.placeholder(tf.float32, [batch, _IMAGE, _IMAGE, _CHANNELS], name="images")
                labels = tf1.placeholder(tf.int32, [batch], name="labels")
                h = images
                for i in (1, 2):
                    h = tf.nn.conv2d(h, weights[f"conv{i}"], 1, "SAME")
                    h, statistics_ = _batch_norm(h, weights, i, norm, data_format)
                    updates += [weights[f"{s}{i}"].assign_sub((weights[f"{s}{i}"] - value) * (1 - _MOMENTUM))
                                for s, value in zip(("mean", "variance"), statistics_)]
                    h = tf.nn.relu(h)
                logits = tf.matmul(tf.reduce_mean(h, [1, 2]), weights["dense"])
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
                grads.append(opt.compute_gradients(loss))
            inputs.append((images.name, labels.name))
            losses.append(loss)
        with tf.device(f"/{device}:0"):
            averaged = [(tf.add_n([g for g, _ in pairs]) / towers, pairs[0][1]) for pairs in zip(*grads)]
            loss = tf.add_n(losses) / towers
        train_op = tf.group(opt.apply_gradients(averaged), *updates)
        init = tf1.global_variables_initializer()
        reads = {v.op.name: tf.identity(v.value()).name for v in tf1.global_variables()}
    return {"graph": graph, "train_op": train_op.name, "loss": loss.name, "inputs": inputs, "init": init.name,
            "reads": reads}


def _batch_norm(h: Any, weights: dict[str, Any], i: int, norm: str, data_format: str) -> tuple[Any, tuple[Any, Any]]:
    """Batch norm of NHWC `h` in `data_format`: tf.compat.v1.nn.fused_batch_norm or hand-written
    tf.nn.moments + tf.nn.batch_normalization; the output and the statistics the moving averages
    take (fused: the unbiased variance, as the op reports it)."""
    import tensorflow as tf

    nchw = data_format == "NCHW"
    if nchw:
        h = tf.transpose(h, [0, 3, 1, 2])
    gamma, beta = weights[f"gamma{i}"], weights[f"beta{i}"]
    if norm == "fused":
        y, mean, variance = tf.compat.v1.nn.fused_batch_norm(h, gamma, beta, epsilon=_EPSILON, data_format=data_format,
                                                             is_training=True)
    else:
        axes, shape = ([0, 2, 3], [1, -1, 1, 1]) if nchw else ([0, 1, 2], [-1])
        mean, variance = tf.nn.moments(h, axes)
        y = tf.nn.batch_normalization(h, tf.reshape(mean, shape), tf.reshape(variance, shape), tf.reshape(beta, shape),
                                      tf.reshape(gamma, shape), _EPSILON)
    return (tf.transpose(y, [0, 2, 3, 1]) if nchw else y), (mean, variance)


def _train(graph_def: Any, built: dict[str, Any], batches: list, config: Any) -> tuple[dict[str, Any], float]:
    """Losses and final variables after one step per batch, and the median step time (the
    first step, which allocates and compiles, left out)."""
    import numpy as np
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    towers = len(built["inputs"])
    losses, times = [], []
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(built["init"])
        for images, labels in batches:
            per = len(images) // towers
            feed = {}
            for k, (image_name, label_name) in enumerate(built["inputs"]):
                feed[image_name], feed[label_name] = images[k * per:(k + 1) * per], labels[k * per:(k + 1) * per]
            start = time.perf_counter()
            losses.append(sess.run([built["train_op"], built["loss"]], feed)[1])
            times.append(time.perf_counter() - start)
        values = sess.run(built["reads"])
    return {"loss": np.asarray(losses, np.float64), **values}, statistics.median(times[1:])


def _max_rel_error(got: dict[str, Any], expected: dict[str, Any]) -> float:
    """max|a - b| / max(max|b|, 1e-3) over the losses and every variable."""
    import numpy as np

    return max(float(np.max(np.abs(np.asarray(got[k], np.float64) - value)) / max(float(np.max(np.abs(value))), 1e-3))
               for k, value in expected.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["auto", "nccl", "local", "collective"], default="auto",
                        help="auto: NCCL when TensorFlow sees 2 or more GPUs, else the local backend on virtual CPUs")
    parser.add_argument("--towers", type=int, metavar="K", help="towers (default: every GPU, or 2 virtual CPUs)")
    parser.add_argument("--steps", type=int, default=4, metavar="N", help="training steps per graph (default 4)")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="deadline of each case (default 120); a case that has not finished is stopped and fails")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> int:
    """`bnrewrite check`: 0 when every case passes, 1 when one does not."""
    report = check(args.backend, args.towers, args.steps, args.timeout)
    sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n" if args.json else str(report))
    return 0 if report.passed else 1


def _child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bnrewrite.rewrite.selfcheck")
    parser.add_argument("--cases", required=True, help="comma-separated")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--towers", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args(argv)
    for case in args.cases.split(","):
        result = run_case(case, args.backend, args.towers, args.steps, args.timeout)
        print(json.dumps({"result": asdict(result)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
