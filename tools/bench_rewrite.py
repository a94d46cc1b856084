"""Rewrite speed and memory at scale, side by side with TensorFlow's own GraphDef handling.

    python tools/bench_rewrite.py [--towers 2,4,8] [--layers 20,50,100] [--reps 5]
                                  [--no-memory] [--no-cli] [--variables shared|replicated|unnamed]
                                  [--updates per_tower|train_op] [--startup-layers 50,130]

For each training graph (tools/deep_net.py: towers x conv+BN layers, built once and cached
as .pb in a temp dir; by default its train op groups every tower's group of UPDATE_OPS, the
wiring whose edges to removed duplicate updates the rewrite re-points) and in one process,
repetitions interleaved:

  rewrite   bnrewrite.rewrite_graph(graph_def)
  import    tf.graph_util.import_graph_def(graph_def) into a fresh tf.Graph
  proto     GraphDef parse + serialize of the same bytes

Medians are printed with ratios, microseconds per input node, and the scaling exponent of
each column over graph size (least-squares slope of log time on log nodes; 1.0 is linear).
Then the work of one rewrite, counted rather than timed (Python function calls, by cProfile:
the same on every machine), fitted as a cost per node plus a cost per batch-norm site, with
exponents per tower count: whether the rewrite is linear, apart from how this machine's
caches price a bigger graph, and the number of reachability walks (Graph.depends_on,
Graph.ancestors_among calls), which must not grow with the graph.
Then start-up: what `bnrewrite run`'s first session on a graph pays, tf.Graph ->
as_graph_def() -> rewrite_graph -> the result imported into a C graph as the session's shadow
is, against tf.import_graph_def of the input (8 towers x --startup-layers; goal <= 2.0).
Then the CLI end to end on the 8 x 50 .pb, and the peak memory of one rewrite measured in
fresh subprocesses (tracemalloc's peak; and the peak RSS during the rewrite over the RSS just
before it, for rewrite_graph(graph_def) and rewrite_graph(graph_def, in_place=True)), against
the size of the GraphDef (ByteSize, and the RSS that parsing it took).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import deep_net  # noqa: E402

GOAL_CONFIG = (8, 50)
#: Fresh processes per memory figure: the same rewrite's peak varies by a few MiB between runs.
MEMORY_RUNS = 5


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of one call."""
    gc.collect()
    cpu, start = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


#: Graph methods that walk the graph to tell whether nodes run after others.
WALKS = ("depends_on", "ancestors_among")


def count_walks(stats: pstats.Stats) -> int:
    """How many reachability walks (calls of WALKS) a profile of rewrites made."""
    return sum(calls for (path, _, name), (_, calls, *_) in stats.stats.items()  # type: ignore[attr-defined]
               if name in WALKS and path.endswith(os.path.join("bnrewrite", "graph", "order.py")))


def bench_config(towers: int, layers: int, reps: int, wiring: dict[str, str]) -> dict:
    from tensorflow.core.framework import graph_pb2

    from bnrewrite import rewrite_graph

    with open(deep_net.cached_path(towers, layers, **wiring), "rb") as f:
        data = f.read()
    graph_def = graph_pb2.GraphDef.FromString(data)

    def do_proto() -> None:
        graph_pb2.GraphDef.FromString(data).SerializeToString()

    result = rewrite_graph(graph_def)  # warm-up, and the output size
    times: dict[str, list[float]] = {k: [] for k in ("rewrite", "import", "proto")}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    passes: dict[str, list[float]] = {}
    records = []

    def do_rewrite() -> None:
        records.append(rewrite_graph(graph_def).report.passes)

    for _ in range(reps):
        for key, fn in (("rewrite", do_rewrite), ("import", lambda: _import(graph_def)), ("proto", do_proto)):
            wall, used = _timed(fn)
            times[key].append(wall)
            cpu[key].append(used)
    for record in records:
        for p in record:
            passes.setdefault(str(p["name"]), []).append(float(p["seconds"]))
    profile = cProfile.Profile()
    profile.runcall(rewrite_graph, graph_def)
    stats = pstats.Stats(profile)
    return {
        "towers": towers, "layers": layers, "nodes": len(graph_def.node),
        "nodes_out": len(result.graph_def.node), "bytes": len(data),
        "sites": sum(len(row.sites) for row in result.report.layers),
        "calls": stats.total_calls, "walks": count_walks(stats),  # type: ignore[attr-defined]
        **{k: statistics.median(v) for k, v in times.items()},
        "cpu": {k: statistics.median(v) for k, v in cpu.items()},
        "passes": {k: statistics.median(v) for k, v in passes.items()},
    }


def _exponent(sizes: list, values: list) -> float:
    """Least-squares slope of log value on log size: k in value ~ size^k."""
    return float(np.polyfit(np.log(sizes), np.log(values), 1)[0])


def print_speed(rows: list[dict]) -> None:
    print("\n== rewrite speed (median of repetitions; ms) ==")
    header = ("towers", "layers", "nodes", "nodes out", "rewrite", "import", "proto",
              "rw/import", "rw/proto", "us/node rw", "us/out node rw", "us/node imp")
    body = []
    for r in rows:
        body.append((
            r["towers"], r["layers"], r["nodes"], r["nodes_out"],
            f"{r['rewrite'] * 1e3:.0f}", f"{r['import'] * 1e3:.0f}", f"{r['proto'] * 1e3:.0f}",
            f"{r['rewrite'] / r['import']:.2f}", f"{r['rewrite'] / r['proto']:.1f}",
            f"{r['rewrite'] / r['nodes'] * 1e6:.1f}", f"{r['rewrite'] / r['nodes_out'] * 1e6:.1f}",
            f"{r['import'] / r['nodes'] * 1e6:.1f}",
        ))
    _table(header, body)
    print("\nthe same in CPU time of this process (time.process_time; less sensitive to other load):")
    header = ("towers", "layers", "rewrite cpu", "import cpu", "rw/import cpu", "us/node rw cpu", "us/node imp cpu")
    _table(header, [(
        r["towers"], r["layers"], f"{r['cpu']['rewrite'] * 1e3:.0f}", f"{r['cpu']['import'] * 1e3:.0f}",
        f"{r['cpu']['rewrite'] / r['cpu']['import']:.2f}", f"{r['cpu']['rewrite'] / r['nodes'] * 1e6:.1f}",
        f"{r['cpu']['import'] / r['nodes'] * 1e6:.1f}",
    ) for r in rows])
    if len(rows) >= 2:
        sizes = [r["nodes"] for r in rows]
        for key in ("rewrite", "import", "proto"):
            print(f"scaling exponent ({key} time ~ input nodes^k): k = {_exponent(sizes, [r[key] for r in rows]):.3f}")
        slope = _exponent([r["nodes_out"] for r in rows], [r["rewrite"] for r in rows])
        print(f"scaling exponent (rewrite time ~ output nodes^k): k = {slope:.3f} "
              "(more towers add more nodes per input node)")
        for key in ("rewrite", "import"):
            slope = _exponent(sizes, [r["cpu"][key] for r in rows])
            print(f"scaling exponent ({key} CPU time ~ input nodes^k): k = {slope:.3f}")
    goal = [r for r in rows if (r["towers"], r["layers"]) == GOAL_CONFIG]
    if goal:
        r = goal[0]
        ratio = r["rewrite"] / r["import"]
        print(f"goal {GOAL_CONFIG[0]}x{GOAL_CONFIG[1]}: rewrite / import_graph_def = {ratio:.2f} "
              f"({'met' if ratio <= 1.0 else 'NOT met'}; goal <= 1.0); in CPU time "
              f"{r['cpu']['rewrite'] / r['cpu']['import']:.2f}")
        print("  passes (median s, validation included): "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["passes"].items()))


def print_work(rows: list[dict]) -> None:
    """The work of a rewrite, counted: is it linear in the graph, whatever the caches do?"""
    print("\n== work of one rewrite (Python function calls, counted by cProfile: the same on any machine) ==")
    matrix = np.array([[r["nodes"], r["sites"]] for r in rows], dtype=float)
    calls = np.array([r["calls"] for r in rows], dtype=float)
    _table(("towers", "layers", "nodes", "BN sites", "calls", "calls/node", "reachability walks"), [
        (r["towers"], r["layers"], r["nodes"], r["sites"], r["calls"], f"{r['calls'] / r['nodes']:.1f}", r["walks"])
        for r in rows])
    if len(rows) >= 3 and np.linalg.matrix_rank(matrix) == 2:  # else nodes and sites cannot be told apart
        (per_node, per_site), *_ = np.linalg.lstsq(matrix, calls, rcond=None)
        fitted = matrix @ [per_node, per_site]
        print(f"calls = {per_node:.1f} x nodes + {per_site:.0f} x BN sites fits every graph within "
              f"{np.max(np.abs(calls - fitted) / fitted):.1%}: the work is linear in nodes and sites; "
              f"{per_site * matrix[:, 1].sum() / fitted.sum():.0%} of it is per site")
    by_towers: dict[int, list[dict]] = {}
    for r in rows:
        by_towers.setdefault(r["towers"], []).append(r)
    series = {t: rs for t, rs in sorted(by_towers.items()) if len(rs) >= 2}
    if series:
        def slopes(key: str) -> str:
            return ", ".join(f"{t} towers {_exponent([r['nodes'] for r in rs], [r[key] for r in rs]):.3f}"
                             for t, rs in series.items())
        print(f"exponent over input nodes at a fixed tower count (sites per node fixed): calls: {slopes('calls')}; "
              f"time: {slopes('rewrite')}")
    if len(rows) >= 2:
        print(f"sites ~ input nodes^{_exponent(matrix[:, 0], matrix[:, 1]):.3f} over these graphs (more towers, "
              f"more sites per node): a cost per site alone would scale so; calls ~ input nodes^"
              f"{_exponent(matrix[:, 0], calls):.3f}")


def bench_startup(towers: int, layers: int, reps: int, wiring: dict[str, str]) -> dict:
    """What the first session on a training graph pays under `bnrewrite run` / `enable()`,
    against tf.import_graph_def of the graph: export (as_graph_def) + rewrite + the shadow's
    import of the rewritten GraphDef into TensorFlow's C graph (bnrewrite.graph.c_graph), repetitions
    interleaved with the plain import."""
    import tensorflow as tf

    from bnrewrite import rewrite_graph
    from bnrewrite.graph.c_graph import import_fragment as shadow_import

    def _shadow(graph_def) -> None:  # noqa: ANN001
        shadow_import(tf.Graph(), graph_def.SerializeToString(), {}, {})

    graph_def = deep_net.cached_graph_def(towers, layers, **wiring)
    built = tf.Graph()
    with built.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    _shadow(rewrite_graph(built.as_graph_def()).graph_def)  # warm-up: lazy imports, TensorFlow's op registry
    parts: dict[str, list[float]] = {k: [] for k in ("export", "rewrite", "import out", "import")}
    for _ in range(reps):
        gc.collect()
        start = time.perf_counter()
        exported = built.as_graph_def()
        exported_at = time.perf_counter()
        rewritten = rewrite_graph(exported).graph_def
        rewritten_at = time.perf_counter()
        _shadow(rewritten)
        parts["export"].append(exported_at - start)
        parts["rewrite"].append(rewritten_at - exported_at)
        parts["import out"].append(time.perf_counter() - rewritten_at)
        parts["import"].append(_timed(lambda: _import(graph_def))[0])
    totals = [a + b + c for a, b, c in zip(parts["export"], parts["rewrite"], parts["import out"])]
    return {"towers": towers, "layers": layers, "nodes": len(graph_def.node), "total": statistics.median(totals),
            **{k: statistics.median(v) for k, v in parts.items()}}


def _import(graph_def) -> None:  # noqa: ANN001 - a GraphDef (TensorFlow is imported lazily)
    import tensorflow as tf

    with tf.Graph().as_default():
        tf.graph_util.import_graph_def(graph_def, name="")


def print_startup(rows: list[dict]) -> None:
    print("\n== start-up of bnrewrite run's first session: tf.Graph -> as_graph_def() -> rewrite_graph -> the shadow's "
          "C import of the result (median of repetitions; ms) ==")
    _table(("towers", "layers", "nodes", "export", "rewrite", "import out", "total", "import in", "total / import in"), [(
        r["towers"], r["layers"], r["nodes"], *(f"{r[k] * 1e3:.0f}" for k in ("export", "rewrite", "import out", "total",
                                                                               "import")),
        f"{r['total'] / r['import']:.2f}") for r in rows])
    worst = max(r["total"] / r["import"] for r in rows)
    print(f"goal: start-up <= 2.0 x import_graph_def of the input: {'met' if worst <= 2.0 else 'NOT met'} "
          f"(worst {worst:.2f})")


def _table(header: tuple, body: list[tuple]) -> None:
    widths = [max(len(str(h)), *(len(str(row[i])) for row in body)) for i, h in enumerate(header)]
    for row in (header, *body):
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))


def bench_cli(towers: int, layers: int, reps: int, wiring: dict[str, str]) -> None:
    """`python -m bnrewrite convert IN OUT` on the big .pb, and on the smallest one for the
    fixed cost (interpreter, TensorFlow import, I/O setup) that does not grow with the graph."""
    print(f"\n== CLI end to end ({towers} towers x {layers} layers .pb) ==")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pb")

        def convert(path: str) -> subprocess.CompletedProcess:
            if os.path.exists(out):
                os.remove(out)
            return subprocess.run([sys.executable, "-m", "bnrewrite", "convert", path, out],
                                  env=env, capture_output=True, text=True)

        big, small = (deep_net.cached_path(t, n, **wiring) for t, n in ((towers, layers), (2, 20)))
        probe = convert(big)
        if probe.returncode != 0 or not os.path.exists(out):
            why = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
            print(f"skipped: `python -m bnrewrite convert IN OUT` did not run here (exit {probe.returncode}: {why})")
            return
        times: dict[str, list[float]] = {"big": [], "small": []}
        for _ in range(reps):
            for key, path in (("big", big), ("small", small)):
                start = time.perf_counter()
                convert(path)
                times[key].append(time.perf_counter() - start)
    b, sm = statistics.median(times["big"]), statistics.median(times["small"])
    print(f"python -m bnrewrite convert IN OUT: {b:.2f} s (median of {reps}); on the 2 x 20 graph: {sm:.2f} s, "
          f"so {b - sm:.2f} s of it grows with the graph (reading, checking, rewriting, writing)")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_child(path: str) -> None:
    """Fresh process: tracemalloc's peak over one rewrite (its bookkeeping would skew RSS)."""
    import tracemalloc

    from tensorflow.core.framework import graph_pb2

    from bnrewrite import rewrite_graph

    rewrite_graph(deep_net.cached_graph_def(2, 20))  # load everything the rewrite imports lazily
    with open(path, "rb") as f:
        data = f.read()
    tracemalloc.start()
    graph_def = graph_pb2.GraphDef.FromString(data)
    parse_traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    gc.collect()
    tracemalloc.start()
    result = rewrite_graph(graph_def)
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(json.dumps({
        "byte_size": graph_def.ByteSize() / 2**20, "out_byte_size": result.graph_def.ByteSize() / 2**20,
        "parse_traced": parse_traced / 2**20, "traced_peak": traced_peak / 2**20,
    }))


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024


def memory_rss_child(path: str, out_path: str, in_place: str) -> None:
    """Fresh process, no tracemalloc: the RSS peak of one rewrite over the RSS just before it.

    The kernel's peak (VmHWM) is reset through /proc/self/clear_refs right before the rewrite,
    so TensorFlow's import peak does not hide it. Writes the output GraphDef to `out_path`.
    """
    from tensorflow.core.framework import graph_pb2

    from bnrewrite import rewrite_graph

    rewrite_graph(deep_net.cached_graph_def(2, 20))
    with open(path, "rb") as f:
        graph_def = graph_pb2.GraphDef.FromString(f.read())
    gc.collect()
    rss_before = _rss_mib()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    result = rewrite_graph(graph_def, in_place=in_place == "in_place")
    peak = _peak_rss_mib() - rss_before
    with open(out_path, "wb") as f:
        f.write(result.graph_def.SerializeToString())
    print(json.dumps({"rss_peak_delta": peak}))


def memory_size_child(path: str) -> None:
    """Fresh process: what one parsed copy of the GraphDef at `path` adds to RSS (mean of 4)."""
    from tensorflow.core.framework import graph_pb2

    with open(path, "rb") as f:
        data = f.read()
    graph_pb2.GraphDef.FromString(data)  # warm up the parser
    gc.collect()
    rss0 = _rss_mib()
    copies = [graph_pb2.GraphDef.FromString(data) for _ in range(4)]
    print(json.dumps({"parse_rss": (_rss_mib() - rss0) / len(copies)}))


def bench_memory(configs: list[tuple[int, int]], wiring: dict[str, str]) -> None:
    print("\n== peak memory of one rewrite (fresh subprocess each; MiB) ==")
    header = ("towers", "layers", "ByteSize", "out ByteSize", "parse RSS", "out parse RSS", "traced peak",
              "RSS peak", "/ parse RSS", "in place: RSS peak", "/ parse RSS")
    body = []
    for towers, layers in configs:
        path = deep_net.cached_path(towers, layers, **wiring)
        traced = json.loads(_child("--memory-child", path))
        with tempfile.TemporaryDirectory() as tmp:
            out_path = os.path.join(tmp, "out.pb")
            runs = {mode: sorted(json.loads(_child("--memory-rss-child", path, out_path, mode))["rss_peak_delta"]
                                 for _ in range(MEMORY_RUNS)) for mode in ("copy", "in_place")}
            peak = {mode: statistics.median(values) for mode, values in runs.items()}
            parse_rss = json.loads(_child("--memory-size-child", path))["parse_rss"]
            out_parse_rss = json.loads(_child("--memory-size-child", out_path))["parse_rss"]
        body.append((
            towers, layers, f"{traced['byte_size']:.1f}", f"{traced['out_byte_size']:.1f}", f"{parse_rss:.1f}",
            f"{out_parse_rss:.1f}", f"{traced['traced_peak']:.1f}",
            *(text for mode in ("copy", "in_place") for text in (
                f"{peak[mode]:.1f} ({runs[mode][0]:.0f}-{runs[mode][-1]:.0f})", f"{peak[mode] / parse_rss:.2f}")),
        ))
    _table(header, body)
    print("traced peak: tracemalloc (Python objects; protobuf's upb arenas are not traced, parsing traces ~0 MiB).")
    print(f"RSS peak: median (range) over {MEMORY_RUNS} fresh processes of the peak RSS during rewrite_graph(graph_def) "
          "(VmHWM, reset just before) minus the RSS before; includes the output GraphDef, which is a copy. in place: rewrite_graph(graph_def, in_place=True), "
          "whose output is the input GraphDef itself. parse RSS: what parsing the GraphDef adds to RSS (mean of 4 "
          "parses in a fresh process).")
    print("goal: peak <= 3 x the GraphDef in memory (parse RSS)")


def _child(flag: str, *paths: str) -> str:
    proc = subprocess.run([sys.executable, __file__, flag, *paths], capture_output=True, text=True, check=True)
    return proc.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", type=_ints, default=[2, 4, 8])
    parser.add_argument("--layers", type=_ints, default=[20, 50, 100])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-cli", action="store_true")
    parser.add_argument("--variables", choices=deep_net.VARIABLES, default="shared",
                        help="how the towers hold their variables (tools/deep_net.py); replicated and unnamed "
                             "graphs have their layers lined up by variable roles and by structure")
    parser.add_argument("--updates", choices=deep_net.UPDATES, default="per_tower",
                        help="how the train op runs the moving-average updates (tools/deep_net.py)")
    parser.add_argument("--startup-layers", type=_ints, default=[50, 130],
                        help="layer counts of the 8-tower graphs the start-up figure is taken on (0: none)")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--memory-rss-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--memory-size-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        return memory_child(args.memory_child)
    if args.memory_rss_child:
        return memory_rss_child(*args.memory_rss_child)
    if args.memory_size_child:
        return memory_size_child(args.memory_size_child)

    wiring = {"variables": args.variables, "updates": args.updates}
    configs = [(t, n) for t in args.towers for n in args.layers]
    startup = [(GOAL_CONFIG[0], n) for n in args.startup_layers if n]
    for t, n in configs + startup:
        deep_net.cached_path(t, n, **wiring)  # build what is not cached yet, before timing anything
    rows = []
    for t, n in configs:
        rows.append(bench_config(t, n, args.reps, wiring))
        r = rows[-1]
        print(f"{t} towers x {n} layers: {r['nodes']} nodes, rewrite {r['rewrite'] * 1e3:.0f} ms, "
              f"import {r['import'] * 1e3:.0f} ms, proto {r['proto'] * 1e3:.0f} ms", flush=True)
    print_speed(rows)
    print_work(rows)
    if startup:
        print_startup([bench_startup(t, n, args.reps, wiring) for t, n in startup])
    if not args.no_cli:
        bench_cli(*GOAL_CONFIG, reps=3, wiring=wiring)
    if not args.no_memory:
        bench_memory([c for c in configs if c[0] == GOAL_CONFIG[0]] or configs[-1:], wiring)


if __name__ == "__main__":
    main()
