"""Under `bnrewrite run` no synchronized step waits forever (issue 49, §2 iii).

Each test runs real scripts in their own processes under a deadline: a one-process collective
graph whose script fetches one tower's loss alone (its all-reduce waits for a member that never
runs), 2-worker collective clusters on localhost with a worker missing or given another's
--task-index, and a healthy cluster whose second worker starts seconds after the first, which
must train like one device although its first meeting waits longer than --timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from models import Result, Spec, build_reference, make_batches, max_rel_error, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
sys.path.insert(0, SCRIPTS)
import collective_worker as cw  # noqa: E402
import zygote  # noqa: E402

STOPPED = 13  # StepTimeoutError


def _stop_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("bnrewrite: error:")]


def _worker(task: int, index: int | None = None, *more: str) -> list[str]:
    return ["--workers", "2", "--task-index", str(task if index is None else index), "--backend", "collective", *more]


def test_a_tower_whose_member_never_runs_stops_the_script_with_one_line():
    """Two steps train; then tower 0's loss is fetched alone: stopped at --timeout, named."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    start = time.monotonic()
    run = zygote.run([sys.executable, "-m", "bnrewrite", "run", "--backend", "collective", "--timeout", "5",
                      os.path.join(SCRIPTS, "dead_member.py")], env=env, capture_output=True, text=True, timeout=150)
    assert run.returncode == STOPPED, run.stderr[-3000:]
    assert "step 1 " in run.stdout and "returned after" not in run.stdout, run.stdout
    [line] = _stop_lines(run.stderr)
    assert ("a step waited 5 s at the all-reduce of batch-norm layer net/bn1 across towers /device:CPU:0, /device:CPU:1"
            in line and "some tower's member did not run" in line), line
    assert "Traceback" not in run.stderr
    assert time.monotonic() - start < 120


def _assert_stopped_alone(run: subprocess.CompletedProcess, task: int) -> None:
    """Worker `task`, whose peer never joined, stopped at its start bound (8 s) with one line."""
    assert run.returncode == STOPPED, run.stdout[-3000:]
    [line] = _stop_lines(run.stdout)
    assert "a step waited 8 s at the all-reduce of batch-norm layer" in line and f"of worker {task} and" in line, line
    assert "another worker never joined: it died, has not started, or was given the same --task-index" in line
    assert "Traceback" not in run.stdout
    assert run.seconds < 100


def test_a_lone_follower_stops_at_its_start_bound_with_one_line(tmp_path):
    """Only worker 1 starts: TensorFlow would retry the leader forever."""
    runs = cw.launch(str(tmp_path), {1: _worker(1, None, "--timeout", "3", "--start-timeout", "8")}, popen=zygote.spawn)
    _assert_stopped_alone(runs[1], 1)


def test_a_worker_given_another_workers_task_index_is_named_and_the_lone_leader_stops(tmp_path):
    """Both workers told --task-index 0: worker 1's is refused before its first step, naming it;
    worker 0, the leader left alone, stops at its start bound with one line."""
    runs = cw.launch(str(tmp_path), {t: _worker(t, 0, "--timeout", "3", "--start-timeout", "8") for t in (0, 1)},
                     popen=zygote.spawn)
    assert runs[1].returncode == 1, runs[1].stdout[-3000:]
    [line] = _stop_lines(runs[1].stdout)
    assert "task_index=0 does not fit this worker: its towers run on /job:worker/replica:0/task:1/device:CPU:0" in line
    _assert_stopped_alone(runs[0], 0)


def test_workers_started_apart_wait_for_each_other_and_train_like_one_device(tmp_path):
    """Worker 1 starts 8 s after worker 0, under --timeout 3: the first meeting waits for it."""
    steps = 5
    runs = cw.launch(str(tmp_path), {t: _worker(t, None, "--timeout", "3") for t in (0, 1)}, delays={1: 8.0},
                     popen=zygote.spawn)
    for run in runs.values():
        assert run.returncode == 0, run.stdout[-3000:]
    got = [dict(np.load(tmp_path / f"worker{t}.npz")) for t in (0, 1)]
    results = [Result(losses=g.pop("losses").astype(np.float64), variables=g) for g in got]
    ref = build_reference(cw.SPEC)
    expected = train(ref.graph, ref, make_batches(cw.SPEC, steps), num_devices=1)
    assert max_rel_error(results[0], expected) < 2e-4  # measured 2-worker error: ~8e-7 (test_multi_worker)
    assert max_rel_error(results[1], results[0]) < 1e-6
