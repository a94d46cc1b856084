"""The oracle for scripts run whole: a script under `bnrewrite run` against its own one-device
run, judged by the noise floor.

A script here takes `OUT CASE ... [--reference]`: it writes OUT/CASE.npz of every quantity it
trained (weights, moving statistics, losses, outputs), and with --reference CASE.one.npz (one
device fed every tower's examples), CASE.perturbed.npz (the same with its inputs scaled by
1 + 1e-7: the noise floor) and CASE.towers.npz (the towers as built, unsynchronized).
"""

import os
import subprocess
import sys
from collections.abc import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
from oracle_cli import CASE  # noqa: E402
import zygote
#: Below these a difference is rounding whatever the floor (float32: tens of ulps; float16: ten ulps).
ROUNDING = {"float16": 1e-2}


def errors(got, expected) -> dict[str, float]:
    """Per quantity, max |got - expected| / max(max |expected|, 1e-3)."""
    assert sorted(got.files) == sorted(expected.files)
    return {k: float(np.abs(got[k].astype(np.float64) - expected[k]).max() / max(np.abs(expected[k]).max(), 1e-3))
            for k in expected.files}


def judge(case: str, directory: str, racing: Callable[[str], bool] = lambda key: False) -> str:
    """Assert the synchronized run lies within the noise floor of the one-device run, quantity by
    quantity (5 floors) and over all (2), and that the towers as built lie far outside (5).

    `racing`: quantities left out, which the program writes in an order it leaves open (a
    moving statistic two applications of one network update in one step: which one reads it
    first moves the result by (1 - momentum)^2 of the statistic's distance), so that two runs
    may differ by more than the floor; the caller vouches for them otherwise (`run --verify`
    checks each update exactly)."""
    out, ref = os.path.join(directory, "run"), os.path.join(directory, "ref")
    with np.load(os.path.join(ref, f"{case}.one.npz")) as one:
        with np.load(os.path.join(out, f"{case}.npz")) as run:
            synced = errors(run, one)
        with np.load(os.path.join(ref, f"{case}.perturbed.npz")) as perturbed:
            floor = errors(perturbed, one)
        with np.load(os.path.join(ref, f"{case}.towers.npz")) as towers:
            apart = errors(towers, one)
    for values in (synced, floor, apart):
        for key in [k for k in values if racing(k)]:
            del values[key]
    rounding = ROUNDING.get(case, 1e-6)
    over = {k: (synced[k], floor[k]) for k in floor if synced[k] > 5 * max(floor[k], rounding)}
    assert not over, f"{case}: beyond 5 noise floors: {over}"
    total = {name: float(np.linalg.norm(list(values.values()))) for name, values in
             (("synced", synced), ("floor", floor), ("apart", apart))}
    bound = max(total["floor"], rounding)
    assert total["synced"] <= 2 * bound and total["apart"] >= 5 * bound, (case, total)
    return (f"{case}: {max(synced.values()):.1e} from one device (noise floor {max(floor.values()):.1e}), "
            f"towers as built {max(apart.values()):.2g}")


def lines_by_case(err: str) -> dict[str, list[str]]:
    """A script's `bnrewrite:` lines on stderr, per case (its cases run one after another in one process)."""
    out, case = {}, None
    for line in err.splitlines():
        if line.startswith(CASE):
            case = line[len(CASE):]
            out[case] = []
        elif line.startswith("bnrewrite:") and case is not None:
            out[case].append(line)
    return out


def run_both(script: str, directory, cases: tuple[str, ...], run_options: tuple[str, ...] = ()) -> str:
    """The script under `bnrewrite run [run_options]` and its references under python, side by
    side; run's stderr."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}
    for name in ("run", "ref"):
        os.makedirs(os.path.join(directory, name))
    common = dict(cwd=str(directory), env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                  stdin=subprocess.DEVNULL)
    run = zygote.spawn([sys.executable, "-m", "bnrewrite", "run", *run_options, script, "run", *cases], **common)
    ref = zygote.spawn([sys.executable, script, "ref", *cases, "--reference"], **common)
    _, run_err = run.communicate(timeout=900)
    _, ref_err = ref.communicate(timeout=900)
    assert ref.returncode == 0, ref_err[-3000:]
    assert run.returncode == 0, run_err[-3000:]
    return run_err
