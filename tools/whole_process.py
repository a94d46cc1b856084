"""A whole training process under `bnrewrite run` against the same script under python alone.

    python tools/whole_process.py [--pairs 5] [--scripts inception,deep] [-- extra script arguments]

For each script (tools/inception_train.py; tools/deep_train.py, 8 towers x 50 layers), runs
`python SCRIPT` and `python -m bnrewrite run SCRIPT` in turn, pair after pair (the order swapped
every other pair, so a drift of the machine's speed falls on both), each a fresh process timed
from start to exit. Prints every pair's seconds and ratio, then the median ratio and its range:
the figure issue 50 judges (goal <= 1.10). A machine shared with other work moves the seconds a
lot and the paired ratios much less; the load average is printed with them. The package's
bytecode is compiled first, as `pip install .` does: a source checkout run with
PYTHONDONTWRITEBYTECODE set would otherwise compile bnrewrite in every `run` (about 0.25 s).
"""

from __future__ import annotations

import argparse
import compileall
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPTS = {"inception": "inception_train.py", "deep": "deep_train.py"}


def timed(command: list[str]) -> tuple[float, str]:
    """Wall seconds of one process run to its end, and the last line it printed (deep_train's
    split: build, session + init + first step); a failed run stops the tool with its output."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}")
    return seconds, (proc.stdout.strip().splitlines() or [""])[-1]


def pairs(script: str, count: int, extra: list[str]) -> list[tuple[float, float]]:
    """(python seconds, bnrewrite run seconds) for `count` pairs, alternating which goes first."""
    plain = [sys.executable, os.path.join(HERE, script), *extra]
    run = [sys.executable, "-m", "bnrewrite", "run", os.path.join(HERE, script), *extra]
    found = []
    for i in range(count):
        if i % 2:
            ran, ran_said = timed(run)
            python, python_said = timed(plain)
        else:
            python, python_said = timed(plain)
            ran, ran_said = timed(run)
        found.append((python, ran))
        print(f"  {script} pair {i + 1}: python {python:.2f} s, run {ran:.2f} s, ratio {ran / python:.3f} "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        for way, said in (("python", python_said), ("run", ran_said)):
            if said:
                print(f"    {way}: {said}", flush=True)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--scripts", default="inception,deep", help="comma-separated: " + ", ".join(SCRIPTS))
    parser.add_argument("extra", nargs="*", help="arguments given to each script (after --)")
    args = parser.parse_args(argv)
    compileall.compile_dir(os.path.join(ROOT, "bnrewrite"), quiet=1)
    for key in args.scripts.split(","):
        found = pairs(SCRIPTS[key], args.pairs, args.extra)
        ratios = sorted(r / p for p, r in found)
        print(f"{SCRIPTS[key]}: bnrewrite run / python = {statistics.median(ratios):.3f} (median of {len(found)} "
              f"pairs; {ratios[0]:.3f}-{ratios[-1]:.3f}); python {statistics.median(p for p, _ in found):.1f} s, "
              f"run {statistics.median(r for _, r in found):.1f} s (medians); goal <= 1.10", flush=True)


if __name__ == "__main__":
    main()
