"""What `convert`'s loader check costs: the rewritten MetaGraph's C++ import and the names
import_meta_graph would look up in it, before anything is written (bnrewrite.io.verify.check_result).

    python tools/bench_load_check.py [--configs 8x50,8x100] [--runs 3]

For each tools/deep_net.py graph (towers x conv+BN layers, shared variables), written once as a
.meta (with its Saver) and a SavedModel tagged [train], and for each run, two fresh processes
run `bnrewrite convert IN OUT -q` in process: one as shipped, one with the check taken out.
Printed per case: the check's own time, convert's wall time, and the peak RSS (VmHWM) of each.
"""

from __future__ import annotations

import argparse
import json
import os
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


def write_inputs(directory: str, towers: int, layers: int) -> dict[str, str]:
    """The deep net as `model.meta` and SavedModel `saved/` (variables at their initial values)."""
    import tensorflow as tf

    import deep_net

    graph = deep_net.build_graph(towers, layers)
    meta_path, saved = os.path.join(directory, "model.meta"), os.path.join(directory, "saved")
    with graph.as_default():
        saver = tf.compat.v1.train.Saver()
        tf.compat.v1.train.export_meta_graph(meta_path, graph=graph, saver_def=saver.as_saver_def(), clear_devices=False)
        builder = tf.compat.v1.saved_model.Builder(saved)
        config = tf.compat.v1.ConfigProto(device_count={"CPU": towers})
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run("init")
            builder.add_meta_graph_and_variables(sess, ["train"], clear_devices=False)
        builder.save()
    return {"meta": meta_path, "saved": saved}


def child(source: str, out: str, checked: str) -> None:
    """Fresh process: convert SOURCE OUT in process; prints the times and the peak RSS."""
    from bnrewrite.cli import main
    from bnrewrite.io import convert

    spent: list[float] = []
    check = convert.check_result

    def timed(*args: object) -> None:
        start = time.perf_counter()
        if checked == "checked":
            check(*args)
        spent.append(time.perf_counter() - start)

    convert.check_result = timed
    start = time.perf_counter()
    code = main(["convert", source, out, "-q"])
    wall = time.perf_counter() - start
    with open("/proc/self/status") as f:
        peak = int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024
    print(json.dumps({"code": code, "wall": wall, "check": sum(spent), "peak": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="8x50,8x100")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for config in args.configs.split(","):
        towers, layers = map(int, config.split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            inputs = write_inputs(tmp, towers, layers)
            for fmt, source in inputs.items():
                rows: dict[str, list[dict]] = {"checked": [], "unchecked": []}
                for run in range(args.runs):
                    for checked in rows:
                        out = os.path.join(tmp, f"out-{fmt}-{checked}-{run}")
                        proc = subprocess.run([sys.executable, __file__, "--child", source, out, checked],
                                              env=env, capture_output=True, text=True, check=True)
                        rows[checked].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                med = {k: {f: statistics.median(r[f] for r in v) for f in ("wall", "check", "peak")} for k, v in rows.items()}
                codes = {r["code"] for v in rows.values() for r in v}
                print(f"{config} {fmt}: check {med['checked']['check']:.2f} s; convert {med['checked']['wall']:.2f} s "
                      f"vs {med['unchecked']['wall']:.2f} s without; peak {med['checked']['peak']:.0f} vs "
                      f"{med['unchecked']['peak']:.0f} MiB (medians of {args.runs}; exit codes {sorted(codes)})", flush=True)


if __name__ == "__main__":
    main()
