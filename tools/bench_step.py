"""Step cost: what synchronized batch norm costs per training step, side by side with the alternatives.

    python tools/bench_step.py [--towers 4] [--sizes default,large] [--dtypes float32,float16]
                               [--variants unsynced,bnrewrite,model_sync,keras_sync,floor,floor_gated,
                                           bnrewrite_collective,floor_collective,floor_gated_collective,
                                           bnrewrite_graphdef,bnrewrite_graphdef_collective,bnrewrite_run]
                               [--steps 30] [--warmup 5] [--block 2] [--traces 6] [--quick]

One process, K virtual CPU devices (`device_count={"CPU": K}`), one tower per device, the
tools/deep_net.py model; the variants (tools/step_variants.py: unsynced, bnrewrite with the
backend it picks (local here), model-code sync BN as tensorpack writes it (CollectiveReduceV2:
model code cannot sum every tower's input in one op), tf_keras's synchronized layer under
MirroredStrategy, the floor: the unsynced graph plus bnrewrite's all-reduces with unused
results, the gated floor: the same with each batch-norm op waiting for its all-reduce (the
towers meet at every layer as synced ones must, with no arithmetic added), bnrewrite and both
floors with CollectiveReduceV2, like for like with the model code, bnrewrite given a bare
GraphDef (as `bnrewrite convert x.pb` reads it) rather than a tf.Graph, with either backend,
and bnrewrite_run: the unsynced graph in a session made under `bnrewrite.enable()`, as
`bnrewrite run` makes it, against `bnrewrite` for the per-step cost of running by name)
are fed the same batches and timed in alternating blocks of steps, so they share the
machine's load: median wall time per step, and the process's CPU time per step (the steadier
figure when other processes share the cores). Ratios and differences between variants (the
"× unsynced" columns and the goal lines) are taken block by block and their median reported:
the machine's speed drifts by several per cent within a run, and a block's variants see the
same speed. Then each runs `--traces` steps traced (FULL_TRACE), also alternating, for:

- peak memory per device: the live bytes of the step's allocations on that device, replayed
  from the allocator's per-op records (`node_stats.memory[*].allocation_records`), the lowest
  over the traced steps (transient buffers of concurrent ops make one-step spikes). The
  allocator's own `allocator_bytes_in_use` cannot be used on CPU: the virtual devices share one
  allocator (`mklcpu`), which also holds the other sessions' variables.
- extra time over unsynced by op type: the sum of op durations per op type (as the op ran,
  after Grappler and oneDNN rewrites), synced minus unsynced, on all devices together; also
  bnrewrite minus its floor (for each backend). Op time is the kernels' own: the executor's
  work between ops (scheduling, copies between devices) shows only in the step times. With K devices on fewer cores the ops' durations overlap and
  include waiting for a core; an all-reduce's includes waiting for the slowest tower.

Sizes: `default` (10 conv+BN layers, 32 channels, 16x16, 8 per tower) and `large` (64
channels, 32x32, 16 per tower). float16: images and activations in float16, batch-norm
statistics in float32 as the fused op keeps them. On CPU the all-reduces are copies between
devices of one process: the ratios measure the added arithmetic, copies and synchronization
points, not a network. tools/gpu_step.py prints the same comparison on GPUs (NCCL).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable, Iterable
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from step_variants import VARIANTS, Size, Variant, build_variants, comparable  # noqa: E402

tf1 = tf.compat.v1
SIZES = {"default": Size(10, 32, 16, 8), "large": Size(10, 64, 32, 16), "gpu": Size(20, 64, 32, 32)}
DTYPES = ("float32", "float16")
MIB = 1 << 20
#: bnrewrite with the backend it picks, and with CollectiveReduceV2 (what model code uses on
#: CPUs), from a tf.Graph and from a bare GraphDef, each beside the floor of its own all-reduces.
PAIRS = (("bnrewrite", "floor"), ("bnrewrite_graphdef", "floor"), ("bnrewrite_collective", "floor_collective"),
         ("bnrewrite_graphdef_collective", "floor_collective"))
#: Like for like: bnrewrite and model code on the same transport.
SAME_TRANSPORT = ("bnrewrite_collective", "bnrewrite_graphdef_collective")
#: The default path (backend auto), from a tf.Graph and from a bare GraphDef.
DEFAULT_PATHS = ("bnrewrite", "bnrewrite_graphdef")
#: The same rewrite from a tf.Graph and from a bare GraphDef: their graphs should be identical.
SAME_REWRITE = (("bnrewrite", "bnrewrite_graphdef"), ("bnrewrite_collective", "bnrewrite_graphdef_collective"))
#: Goals of project issues 14 and 29.
FLOOR_SHARE_GOAL, STEP_RATIO_GOAL, PEAK_RATIO_GOAL = 0.5, 1.10, 1.05

#: One global batch: (images, labels) per tower.
Batch = list[tuple[np.ndarray, np.ndarray]]


@dataclass
class StepTrace:
    """What one traced step spent: op time (µs) and bytes allocated per op type, and the peak of
    live allocated bytes per device."""

    op_micros: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    op_count: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    allocated: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak: dict[str, int] = field(default_factory=dict)


@dataclass
class Measured:
    """A variant's figures: median step time (s) and the medians over its traced steps. CPU time
    is the process's (every thread's) during the step: unlike wall time it does not grow while
    other processes hold the cores, so on a shared machine its ratios are the steadier."""

    name: str
    error: str = ""
    step: float = float("nan")
    spread: float = float("nan")  # interquartile range of the step times
    cpu: float = float("nan")  # median process CPU time per step, all threads
    blocks: list[tuple[float, float]] = field(default_factory=list)  # mean (wall, CPU) per block of steps
    traces: list[StepTrace] = field(default_factory=list)

    def median(self, attribute: str) -> dict[str, float]:
        """Per key of a StepTrace dict, the median over the traced steps (0 where one lacks it)."""
        return self._over_traces(attribute, statistics.median)

    def peak(self) -> dict[str, float]:
        """Per device, the lowest peak over the traced steps: the peak the step needs. Two ops of
        one device whose transient buffers happen to overlap add a spike that comes and goes from
        step to step of the same graph (float16 on CPU: un-synced 26.85 MiB on three devices and
        49 MiB on the fourth, another one each step, while its allocation records balance). Three
        traced steps were not always enough to see every device without one: 2026-11-25 four
        variants, the gated floor among them, kept a 49 MiB device (1.84 x); six were."""
        return self._over_traces("peak", min)

    def _over_traces(self, attribute: str, summary: Callable[[Iterable[float]], float]) -> dict[str, float]:
        keys = {key for trace in self.traces for key in getattr(trace, attribute)}
        return {key: summary([getattr(t, attribute).get(key, 0) for t in self.traces]) for key in keys}


def _device_key(device: str) -> str | None:
    """"CPU:0" for a device's own stats; None for GPU stream and memcpy entries, which repeat
    the device's ops."""
    name = device.rsplit("/device:", 1)[-1]
    return name if "/" not in name else None


def _op_type(node_stats: tf1.NodeExecStats) -> str:
    """The op type as it ran, from "name = Type(inputs)"; the node name for _SOURCE and the like."""
    label = node_stats.timeline_label
    return label.split(" = ", 1)[1].split("(", 1)[0] if " = " in label else node_stats.node_name


def read_trace(metadata: tf1.RunMetadata) -> StepTrace:
    """Op time, op count and bytes allocated per op type; per device, the peak of its main
    allocator (the one peaking highest there: `mklcpu` on CPU, `GPU_k_bfc` on GPU, not the
    host memory a GPU's ops also take)."""
    trace = StepTrace()
    for device_stats in metadata.step_stats.dev_stats:
        device = _device_key(device_stats.device)
        if device is None:
            continue
        records: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for node in device_stats.node_stats:
            kind = _op_type(node)
            trace.op_micros[kind] += node.all_end_rel_nanos / 1e3
            trace.op_count[kind] += 1
            for memory in node.memory:
                records[memory.allocator_name] += [(r.alloc_micros, r.alloc_bytes) for r in memory.allocation_records]
                trace.allocated[kind] += sum(r.alloc_bytes for r in memory.allocation_records if r.alloc_bytes > 0)
        trace.peak[device] = max((_peak(allocations) for allocations in records.values()), default=0)
    return trace


def _peak(records: list[tuple[int, int]]) -> int:
    """The most bytes live at once, replaying (time, ±bytes) records; at one microsecond, frees
    come before allocations."""
    live = peak = 0
    for _, size in sorted(records):
        live += size
        peak = max(peak, live)
    return peak


class Trainer:
    """A session over one variant's graph on `towers` devices."""

    def __init__(self, variant: Variant, towers: int, device_kind: str) -> None:
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.graph_util.import_graph_def(variant.graph_def, name="")
        config = tf1.ConfigProto(allow_soft_placement=device_kind != "CPU")
        if device_kind == "CPU":
            config.device_count["CPU"] = towers
        else:
            config.gpu_options.allow_growth = True
        if variant.live:
            import bnrewrite

            with bnrewrite.enabled(quiet=True):
                self.session = tf1.Session(graph=self.graph, config=config)
        else:
            self.session = tf1.Session(graph=self.graph, config=config)
        self.session.run("init")
        self.train_op = self.graph.get_operation_by_name(variant.train_op)
        self.inputs = [(self.graph.get_tensor_by_name(i), self.graph.get_tensor_by_name(l)) for i, l in variant.inputs]

    def feeds(self, batch: Batch) -> dict:
        return {t: value.astype(t.dtype.as_numpy_dtype) for pair, values in zip(self.inputs, batch)
                for t, value in zip(pair, values)}

    def time_steps(self, batches: list[Batch]) -> list[tuple[float, float]]:
        """(wall, process CPU) seconds of each step."""
        times = []
        for batch in batches:
            feeds = self.feeds(batch)
            start, start_cpu = time.perf_counter(), time.process_time()
            self.session.run(self.train_op, feeds)
            times.append((time.perf_counter() - start, time.process_time() - start_cpu))
        return times

    def trace(self, batch: Batch) -> StepTrace:
        metadata = tf1.RunMetadata()
        options = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE)
        self.session.run(self.train_op, self.feeds(batch), options=options, run_metadata=metadata)
        return read_trace(metadata)


def make_batches(towers: int, size: Size, count: int, seed: int) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal([size.batch, size.image, size.image, 3], np.float32),
              rng.integers(0, 10, [size.batch]).astype(np.int32)) for _ in range(towers)] for _ in range(count)]


def measure(variants: list[Variant], towers: int, size: Size, steps: int, warmup: int, traces: int, block: int,
            device_kind: str = "CPU") -> dict[str, Measured]:
    """Median step time and traces of every variant, fed the same batches in alternating blocks
    of `block` steps (short blocks: load from other processes falls on every variant alike).
    A variant whose session cannot start or step is kept with the error."""
    measured = {v.name: Measured(v.name, error=v.error) for v in variants}
    trainers: dict[str, Trainer] = {}
    for variant in variants:
        if variant.error:
            continue
        try:
            trainers[variant.name] = trainer = Trainer(variant, towers, device_kind)
            trainer.time_steps(make_batches(towers, size, warmup, seed=0))
        except tf.errors.OpError as error:
            measured[variant.name].error = f"cannot run: {type(error).__name__}: {error.message.splitlines()[0]}"
            trainers.pop(variant.name, None)
    times: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for start in range(0, steps, block):
        batches = make_batches(towers, size, min(block, steps - start), seed=1 + start)
        for name, trainer in trainers.items():
            timed = trainer.time_steps(batches)
            times[name] += timed
            measured[name].blocks.append(tuple(statistics.fmean(t[i] for t in timed) for i in (0, 1)))
    for i in range(traces):
        batch = make_batches(towers, size, 1, seed=10_000 + i)[0]
        for name, trainer in trainers.items():
            measured[name].traces.append(trainer.trace(batch))
    for name, trainer in trainers.items():
        wall = [w for w, _ in times[name]]
        quartiles = statistics.quantiles(wall, n=4) if len(wall) > 1 else [wall[0]] * 3
        measured[name].step, measured[name].spread = statistics.median(wall), quartiles[2] - quartiles[0]
        measured[name].cpu = statistics.median(c for _, c in times[name])
        trainer.session.close()
    return measured


def paired(a: Measured, b: Measured, clock: str, ratio: bool) -> float:
    """a over b (or a minus b), block by block, the median over the blocks: each block runs
    every variant on the same batches back to back, so a drift of the machine's speed, which
    on a shared machine moves every variant by several per cent within a run, cancels."""
    i = 0 if clock == "wall" else 1
    pairs = [(x[i], y[i]) for x, y in zip(a.blocks, b.blocks)]
    return statistics.median(x / y if ratio else x - y for x, y in pairs) if pairs else float("nan")


def print_config(title: str, measured: dict[str, Measured], top: int) -> None:
    """The step-time/memory table; per variant, its extra op time over unsynced by op type, and
    bnrewrite's over the floor (what it adds besides the all-reduces themselves)."""
    base = measured.get("unsynced")
    devices = sorted(base.peak()) if base and base.traces else []
    print(f"\n== {title} ==")
    print(f"{'variant':<11} {'step ms':>8} {'IQR':>6} {'× unsynced':>10} {'CPU ms':>8} {'× unsynced':>10}   "
          f"peak MiB per device ({' '.join(devices)})   {'worst device × unsynced':>23}")
    for m in measured.values():
        if m.error:
            print(f"{m.name:<11} {m.error}")
            continue
        peak = m.peak()
        ratio, cpu_ratio = ((paired(m, base, "wall", True), paired(m, base, "CPU", True)) if base and not base.error
                            else (float("nan"),) * 2)
        worst = max((peak[d] / base.peak()[d] for d in devices), default=float("nan"))
        cells = " ".join(f"{peak.get(d, 0) / MIB:.2f}" for d in devices)
        print(f"{m.name:<11} {m.step * 1e3:>8.1f} {m.spread * 1e3:>6.1f} {ratio:>10.3f} {m.cpu * 1e3:>8.1f} "
              f"{cpu_ratio:>10.3f}   {cells:<{24 + 6 * len(devices)}} {worst:>9.3f}")
    if not base or base.error or not base.traces:
        return
    for m in measured.values():
        if m.name != "unsynced" and not m.error and m.traces:
            print_extra(m, base, top)
    for ours, floor in PAIRS:
        if all(name in measured and not measured[name].error and measured[name].traces for name in (ours, floor)):
            print_extra(measured[ours], measured[floor], top)


def print_extra(m: Measured, base: Measured, top: int) -> None:
    """`m`'s op time and allocations minus `base`'s, by op type, largest |Δ time| first; share:
    of the op time added (the sum of the positive Δ). "KiB per op" tells input-sized temporaries
    (an activation of the default size is 256 KiB) from per-channel vectors."""
    micros, count, alloc = m.median("op_micros"), m.median("op_count"), m.median("allocated")
    base_micros, base_count, base_alloc = base.median("op_micros"), base.median("op_count"), base.median("allocated")
    extra = {k: micros.get(k, 0) - base_micros.get(k, 0) for k in set(micros) | set(base_micros)}
    total = sum(extra.values())
    added = sum(v for v in extra.values() if v > 0)
    print(f"  {m.name} − {base.name}: op time {total / 1e3:+.1f} ms per step (all devices; wall "
          f"{1e3 * (m.step - base.step):+.1f} ms), by op type:")
    print(f"    {'op type':<34} {'Δ ms':>8} {'share':>6} {'Δ ops':>6} {'Δ MiB allocated':>16} {'KiB per op':>11}")
    for kind in sorted(extra, key=lambda k: -abs(extra[k]))[:top]:
        delta_alloc = alloc.get(kind, 0) - base_alloc.get(kind, 0)
        delta_count = count.get(kind, 0) - base_count.get(kind, 0)
        share = extra[kind] / added if added else float("nan")
        per_op = f"{delta_alloc / delta_count / 1024:.1f}" if delta_count > 0 and delta_alloc > 0 else ""
        print(f"    {kind:<34} {extra[kind] / 1e3:>8.2f} {share:>6.0%} {delta_count:>6.0f} {delta_alloc / MIB:>16.2f} "
              f"{per_op:>11}")


def goal_lines(label: str, measured: dict[str, Measured], default_size: bool) -> list[str]:
    """The issue's goals for one configuration, each with its figures and met / NOT met; the
    time goals in wall time and in CPU time (steadier on a shared machine)."""
    def ok(met: bool) -> str:
        return "met" if met else "NOT met"

    lines = []
    for clock in ("wall", "CPU"):
        ok_names = {name for name, m in measured.items() if not m.error}
        for mine, floor in PAIRS:
            if {mine, "model_sync", floor} <= ok_names:
                ours = paired(measured[mine], measured[floor], clock, False)
                theirs = paired(measured["model_sync"], measured[floor], clock, False)
                lines.append(f"{label}, {clock} time: {mine} − {floor} = {ours * 1e3:.1f} ms ≤ ½ (model-code − {floor}) = "
                             f"{theirs * 500:.1f} ms: {ok(ours <= FLOOR_SHARE_GOAL * theirs)}")
        for mine in SAME_TRANSPORT:
            if {mine, "model_sync", "unsynced"} <= ok_names:
                ours, theirs = (paired(measured[n], measured["unsynced"], clock, True) for n in (mine, "model_sync"))
                gated = (f" (floor_gated_collective, meeting at every layer with no arithmetic: "
                         f"{paired(measured['floor_gated_collective'], measured['unsynced'], clock, True):.3f})"
                         if "floor_gated_collective" in ok_names else "")
                lines.append(f"{label}, {clock} time: {mine} / unsynced = {ours:.3f} ≤ model-code / unsynced = "
                             f"{theirs:.3f}: {ok(ours <= theirs)}{gated}")
        for mine in DEFAULT_PATHS:
            if default_size and {mine, "unsynced"} <= ok_names:
                ratio = paired(measured[mine], measured["unsynced"], clock, True)
                gated = (f" (floor_gated, the towers meeting at every layer with no arithmetic: "
                         f"{paired(measured['floor_gated'], measured['unsynced'], clock, True):.3f})"
                         if "floor_gated" in ok_names else "")
                lines.append(f"{label}, {clock} time: {mine} / unsynced = {ratio:.3f} ≤ {STEP_RATIO_GOAL}: "
                             f"{ok(ratio <= STEP_RATIO_GOAL)}{gated}")
    synced, base = measured.get("bnrewrite"), measured.get("unsynced")
    if synced and base and synced.traces and base.traces:
        peak, base_peak = synced.peak(), base.peak()
        ratio = max(peak[d] / base_peak[d] for d in base_peak)
        lines.append(f"{label}: peak memory synced / unsynced (worst device) = {ratio:.3f} ≤ {PEAK_RATIO_GOAL}: "
                     f"{ok(ratio <= PEAK_RATIO_GOAL)}")
    return lines


def arguments(doc: str, towers: int, towers_help: str, sizes: str) -> argparse.ArgumentParser:
    """The command line of a step-cost script."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", type=int, default=towers, help=towers_help)
    parser.add_argument("--sizes", default=sizes, help=f"comma-separated, of {', '.join(SIZES)}: "
                        + "; ".join(f"{name}: {size}" for name, size in SIZES.items()))
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of float32, float16")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; unsynced is always run")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant and configuration")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=2, help="steps per variant before the next one's turn")
    parser.add_argument("--traces", type=int, default=6,
                        help="traced steps per variant (op times: medians; peak memory: the lowest, see Measured.peak)")
    parser.add_argument("--top", type=int, default=10, help="op types listed per synced variant (largest |Δ|)")
    parser.add_argument("--quick", action="store_true",
                        help="default size only, 6 steps, 1 warm-up, 1 trace: a smoke run, too noisy to judge a goal by")
    return parser


def run(args: argparse.Namespace, device: str, towers: int, where: str) -> None:
    """Measures and prints every size × dtype with its goal lines, then all the goal lines together."""
    if args.quick:
        args.sizes, args.steps, args.warmup, args.traces = "default", 6, 1, 1
    names = ["unsynced"] + [n for n in args.variants.split(",") if n != "unsynced"]
    unknown = sorted(set(names) - set(VARIANTS)) + sorted(set(args.sizes.split(",")) - set(SIZES)) \
        + sorted(set(args.dtypes.split(",")) - set(DTYPES))
    if unknown:
        raise SystemExit(f"unknown: {', '.join(unknown)}")
    goals = []
    for size_name in args.sizes.split(","):
        size = SIZES[size_name]
        for dtype in args.dtypes.split(","):
            variants = build_variants(names, towers, size, dtype, device)
            built = {v.name: comparable(v.graph_def) for v in variants if v.graph_def is not None}
            for a, b in SAME_REWRITE:
                if a in built and b in built:
                    print(f"{b}: {'the same graph as' if built[a] == built[b] else 'NOT the same graph as'} {a}")
            measured = measure(variants, towers, size, args.steps, args.warmup, args.traces, args.block, device.upper())
            title = (f"{where}, {dtype}: {size}; median of {args.steps} steps after {args.warmup} warm-up, "
                     f"{args.traces} traced")
            print_config(title, measured, args.top)
            lines = goal_lines(f"{size_name} {dtype}", measured, size_name == "default")
            print("\n".join(f"  goal: {line}" for line in lines))  # kept should a long run be cut short
            goals += lines
            sys.stdout.flush()
    print("\n== goals ==")
    print("\n".join(goals))
    if args.quick:
        print("(--quick: 6 steps in one block, a smoke run whose ratios move by 15 % or more between runs; "
              "judge the goals on the default 30 steps)")


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, towers=4, towers_help="virtual CPU devices, one tower each", sizes="default,large")
    args = parser.parse_args(argv)
    run(args, "cpu", args.towers, f"K={args.towers} virtual CPU devices ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
