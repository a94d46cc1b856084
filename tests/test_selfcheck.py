"""`bnrewrite check` / `bnrewrite.check()`: the oracle a user runs on their own machine.

Here (no GPU) it runs the local backend on virtual CPUs and says NCCL was skipped; a
case that does not finish in time is stopped and named with the phase it was in, never hung,
and one that kills the child process running the cases fails with its error while the cases
after it still run.
"""

import json
import os
import subprocess
import sys

import pytest

import bnrewrite
from bnrewrite import BackendError
from bnrewrite.rewrite import selfcheck
from bnrewrite.rewrite.selfcheck import CASES
import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-m", "bnrewrite", "check", *args], capture_output=True, text=True,
                      timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})


def test_check_passes_on_virtual_cpus_and_skips_nccl():
    proc = _cli("--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["passed"] and report["backend"] == "local"
    assert report["devices"] == "2 virtual CPU devices"
    assert any(s.startswith("nccl: skipped") for s in report["skipped"])
    assert [c["case"] for c in report["cases"]] == [f"{norm} {fmt}" for norm, fmt in CASES]
    for case in report["cases"]:
        print(f"{case['case']}: synced {case['error']:.2e}, unsynced {case['unsynced_error']:.2e}, "
              f"step {case['step_ms']:.1f} / {case['unsynced_step_ms']:.1f} ms")
        assert case["passed"] and case["error"] <= 1e-4 and case["unsynced_error"] > 1e-2
        assert case["all_reduces_per_layer"] == 2  # one forward, one backward per tower


def test_a_case_out_of_time_is_stopped_and_named():
    report = bnrewrite.check(towers=3, steps=2, timeout_seconds=1.5)
    assert not report.passed and len(report.cases) == len(CASES)
    assert all(not c.passed and c.message.startswith("no answer within 1.5 s while ") for c in report.cases)
    text = str(report)
    assert "FAIL" in text and "0 of 4 case(s)" in text


def test_a_case_that_kills_its_child_fails_and_the_cases_after_it_still_run(monkeypatch):
    """A malformed case name makes the child process die (ValueError): that case fails with the
    exit code and the error's last line, and a new child runs the case after it."""
    monkeypatch.setattr(selfcheck, "CASES", (("broken", "X Y"), ("unfused", "NCHW")))
    report = bnrewrite.check(steps=2)
    assert [(c.case, c.passed) for c in report.cases] == [("broken X Y", False), ("unfused NCHW", True)]
    assert report.cases[0].message.startswith("failed while starting (exit 1): ValueError: too many values to unpack")
    assert not report.passed


def test_text_output_and_exit_code_of_a_failed_check():
    proc = _cli("--timeout", "1", "--steps", "2")
    assert proc.returncode == 1
    assert "FAIL: " in proc.stdout and "no answer within 1 s while" in proc.stdout


@pytest.mark.parametrize("kwargs, message", [  # backend nccl without GPUs: test_cli_error_is_one_line
    ({"towers": 1}, "needs 2 or more towers"),
    ({"steps": 1}, "at least 2 steps"),
    ({"backend": "ring"}, "unknown backend"),
])
def test_what_cannot_be_checked_says_why(kwargs, message):
    with pytest.raises(BackendError, match=message):
        bnrewrite.check(**kwargs)


def test_cli_error_is_one_line():
    """check(backend="nccl") where TensorFlow sees no GPU (a GPU count in a child process) raises
    BackendError: through the command line, its exit code and one line."""
    proc = _cli("--backend", "nccl")
    assert proc.returncode == BackendError.exit_code
    assert proc.stderr.count("\n") == 1 and "needs GPUs, and TensorFlow sees none here" in proc.stderr
