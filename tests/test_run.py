"""`bnrewrite run SCRIPT`: real training scripts, unmodified, as subprocesses.

The oracle: each script's own checkpoint, every variable (weights, moving statistics, Momentum
slots, global_step), against examples/multi_gpu_train.py run with one tower fed K*B; the same
script with K towers and no bnrewrite must miss it. The subprocesses of the oracle start
together (their TensorFlow imports and Supervisor waits overlap).
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
EXAMPLE = os.path.join(ROOT, "examples", "multi_gpu_train.py")
K, B = 2, 2
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}


def _start(args: list[str], cwd: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, **kwargs)


def _finish(process: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, err = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _checkpoint(directory: str) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(directory))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def _error(got: dict, expected: dict) -> float:
    assert sorted(got) == sorted(expected)
    return max(float(np.linalg.norm((got[k] - expected[k]).ravel().astype(np.float64))
                     / max(np.linalg.norm(expected[k].ravel().astype(np.float64)), 1e-3)) for k in expected)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run"))
    started = {
        "references": _start([os.path.join(SCRIPTS, "reference_runs.py"), out, str(K), str(B)], out),
        "three": _start(["-m", "bnrewrite", "run", "--verify", "--report", "three.json",
                         os.path.join(SCRIPTS, "three_trainers.py"),
                         "--num_gpus", str(K), "--batch_size", str(B), "--train_dir", "three"], out),
        "slim": _start(["-m", "bnrewrite", "run", os.path.join(SCRIPTS, "slim_train.py"), "--num_clones", str(K),
                        "--batch_size", str(B), "--train_dir", "slim"], out),
        "in_place": _start([os.path.join(SCRIPTS, "in_place_train.py"), "--num_gpus", str(K), "--batch_size", str(B),
                            "--train_dir", "in_place"], out),
        "threads": _start(["-m", "bnrewrite", "run", "--verify", os.path.join(SCRIPTS, "summary_threads.py"),
                           os.path.join(out, "synced"), str(K * B), str(K)], out),
    }
    done = {name: _finish(process) for name, process in started.items()}
    for name, result in done.items():
        assert result.returncode == 0, (name, result.stderr[-3000:])
    expected = _checkpoint(os.path.join(out, "one_device"))
    unsynced = _error(_checkpoint(os.path.join(out, "towers")), expected)
    assert unsynced > 0.1, unsynced  # the check can fail: towers as built miss one device
    return out, done, expected


@pytest.mark.parametrize("train_dir", ["three/session", "three/supervisor", "three/monitored", "slim", "in_place"])
def test_unmodified_trainers_train_like_one_device(runs, train_dir):
    out, _, expected = runs
    got = _checkpoint(os.path.join(out, train_dir))
    assert got["global_step"] == 3
    error = _error(got, expected)
    print(f"{train_dir}: {error:.2e}")
    assert error < 1e-5


def test_run_reports_every_graph_and_runs_the_eval_graph_unchanged(runs):
    out, done, _ = runs
    with open(os.path.join(out, "three.json"), encoding="utf-8") as handle:
        graphs = json.load(handle)["graphs"]
    assert [g["outcome"] for g in graphs] == ["synchronized"] * 3 + ["unchanged"]
    # towers on /gpu:0 and /gpu:1 on a machine without GPUs: auto takes the local sum
    assert {g["report"]["backend"] for g in graphs[:3]} == {"local"}
    assert "inference mode" in graphs[3]["why"]
    stderr = done["three"].stderr
    assert "bnrewrite: graph 1: 2 batch-norm layer(s) synchronized across 2 towers" in stderr
    for number in (1, 2, 3):  # --verify: each first step checked (and trained once: the checkpoints match)
        assert f"bnrewrite: graph {number}: verified 2 layers x 2 towers on /device:GPU:0..1: worst " in stderr
        assert graphs[number - 1]["verify"]["passed"] and graphs[number - 1]["verify"]["worst"] < 1e-5
    assert "bnrewrite: graph 4 runs unchanged: all 2 batch-norm ops are in inference mode" in stderr
    assert "eval loss" in done["three"].stdout  # the synced checkpoint restores into an un-rewritten graph


def test_verify_checks_the_training_step_not_a_summary_threads_fetch(runs):
    """train.Supervisor and slim.learning.train (model_deploy clones, reference variables) each run a
    forward-only summary thread that fetches the loss before the first step: --verify checks the
    training step, and the towers train like one device (the summary thread runs unchanged)."""
    out, done, _ = runs
    stderr = done["threads"].stderr
    for number in (1, 2):
        assert f"bnrewrite: graph {number}: verified 2 layers x {K} towers on /device:GPU:0..1: worst " in stderr, stderr
    assert "moving statistics updated once" in stderr and "bnrewrite: error" not in stderr
    for name in ("supervisor", "slim"):
        expected = dict(np.load(os.path.join(out, "plain", f"{name}_1.npz")))
        error = _error(dict(np.load(os.path.join(out, "synced", f"{name}_{K}.npz"))), expected)
        unsynced = _error(dict(np.load(os.path.join(out, "plain", f"{name}_{K}.npz"))), expected)
        print(f"{name}: synced {error:.2e}, unsynced {unsynced:.2e}")
        assert error < 1e-5 and unsynced > 1e-2


def test_refused_graph_stops_the_script_before_its_first_step(tmp_path):
    refused = _finish(_start(["-m", "bnrewrite", "run", os.path.join(SCRIPTS, "independent_train.py"), "--train_dir",
                              "refused"], str(tmp_path)))
    assert refused.returncode == 6, refused.stderr[-2000:]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("bnrewrite:")]
    assert len(lines) == 1 and "train independent models" in lines[0] and "refused" in lines[0]
    assert "step" not in refused.stdout and not os.path.exists(tmp_path / "refused")


def test_ctrl_c_during_training_exits_130(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "bnrewrite", "run", EXAMPLE, "--num_gpus", "2", "--steps", "300", "--train_dir", "t"],
        cwd=str(tmp_path), env={**ENV, "PYTHONUNBUFFERED": "1"}, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    line = ""
    while "step 1:" not in line and time.monotonic() < deadline:
        line = process.stdout.readline()
    assert "step 1:" in line
    process.send_signal(signal.SIGINT)
    result = _finish(process, timeout=60)
    assert result.returncode == 130
    assert "KeyboardInterrupt" in result.stderr


def _probe(tmp_path, *args: str, stdin: str = "") -> tuple[subprocess.CompletedProcess, dict]:
    result = subprocess.run([sys.executable, "-m", "bnrewrite", "run", *args], cwd=str(tmp_path), env=ENV, text=True,
                            capture_output=True, input=stdin, timeout=120)
    seen = json.loads(result.stdout.splitlines()[0]) if result.stdout else {}
    return result, seen


def test_script_runs_as_python_would(tmp_path):
    script = os.path.join(SCRIPTS, "probe.py")
    result, seen = _probe(tmp_path, "--backend", "local", script, "--backend", "x", "-q", stdin="fed")
    assert result.returncode == 0, result.stderr
    assert seen == {"argv": [script, "--backend", "x", "-q"], "name": "__main__", "path0": SCRIPTS,
                    "cwd": str(tmp_path), "stdin": "fed", "tensorflow_imported": False}
    assert result.stderr == ""


def test_module_and_exit_codes(tmp_path):
    (tmp_path / "probe.py").write_text(open(os.path.join(SCRIPTS, "probe.py"), encoding="utf-8").read())
    result, seen = _probe(tmp_path, "-m", "probe", "exit:3")
    assert result.returncode == 3 and seen["name"] == "__main__" and seen["path0"] == str(tmp_path)
    assert seen["argv"] == [str(tmp_path / "probe.py"), "exit:3"]
    result, _ = _probe(tmp_path, "probe.py", "raise")
    assert result.returncode == 1
    assert result.stderr.startswith("Traceback (most recent call last):\n  File \"" + str(tmp_path / "probe.py"))
    assert result.stderr.rstrip().endswith("ValueError: the script's own error")
    assert "runpy" not in result.stderr and "bnrewrite" not in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["run"], "run needs SCRIPT or -m MODULE"),
    (["run", "missing.py"], "can't open file 'missing.py'"),
    (["run", "--no-such-option", "x.py"], "unrecognized arguments: --no-such-option"),
    (["run", "--backend", "gpu", "x.py"], "invalid choice: 'gpu'"),
])
def test_command_line_mistakes_are_usage_errors(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_existing_report_is_not_replaced_without_force(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.json").write_text("mine")
    (tmp_path / "s.py").write_text("print('ran')\n")
    assert main(["run", "--report", "r.json", "s.py"]) == 10
    assert (tmp_path / "r.json").read_text() == "mine"
    assert "--report r.json exists" in capsys.readouterr().err
