"""How reliably a parameter-server cluster trains, with and without bnrewrite (issue 40).

    python tools/ps_reliability.py [--runs 10] [--steps 100] [--layouts ps,replicated]

Each run starts 1 ps + 2 workers on localhost (tests/scripts/ps_cluster.py: variables on the
ps under SyncReplicasOptimizer, or per-worker copies with ps shadows), the workers under
`bnrewrite run --workers 2 --task-index I --timeout 60` ("synced") or plain python ("as
built"), alternating, and counts the runs in which both workers finished every step; a
failed run prints its workers' last lines. Ends with one line per layout and way, and the
wall time per run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "scripts"))

from ps_cluster import launch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--layouts", default="ps,replicated")
    args = parser.parse_args()
    tally: dict[tuple[str, str], list[tuple[bool, float]]] = {}
    for layout in args.layouts.split(","):
        for run in range(args.runs):
            for way, synced in (("synced", True), ("as built", False)):
                with tempfile.TemporaryDirectory() as out:
                    start = time.monotonic()
                    workers = launch(out, layout, args.steps, synced)
                    ok = all(w.returncode == 0 and f"{args.steps} steps" in w.stdout for w in workers.values())
                    tally.setdefault((layout, way), []).append((ok, time.monotonic() - start))
                if not ok:
                    for task, w in workers.items():
                        print(f"{layout} {way} run {run} worker {task} exit {w.returncode}: "
                              + " | ".join(w.stdout.strip().splitlines()[-3:]), flush=True)
    for (layout, way), runs in tally.items():
        passed = sum(ok for ok, _ in runs)
        print(f"{layout:10s} {way:8s} {passed}/{len(runs)} runs finished {args.steps} steps, "
              f"{len(runs) - passed} failed; median {statistics.median(t for _, t in runs):.1f} s a run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
