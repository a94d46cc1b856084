"""`bnrewrite run SCRIPT`: real training scripts, unmodified, as subprocesses.

The oracle: each script's own checkpoint, every variable (weights, moving statistics, Momentum
slots, global_step), against examples/multi_gpu_train.py run with one tower fed K*B; the same
script with K towers and no bnrewrite must miss it. The subprocesses of the oracle start
together (their TensorFlow imports and Supervisor waits overlap).
"""

import json
import os
import py_compile
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite.cli import main
from model_files import tree_snapshot
import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
EXAMPLE = os.path.join(ROOT, "examples", "multi_gpu_train.py")
K, B = 2, 2
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}


def _start(args: list[str], cwd: str, fork: bool = False, **kwargs) -> subprocess.Popen:
    """`python ARGS` in `cwd`, output piped; `fork`: by the zygote (for children that import TensorFlow)."""
    return (zygote.spawn if fork else subprocess.Popen)([sys.executable, *args], cwd=cwd, env=ENV, text=True, stdout=subprocess.PIPE,
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
        # one device, the towers as built, and in_place_train.py (rewrite_graph in the script)
        "references": _start([os.path.join(SCRIPTS, "reference_runs.py"), out, str(K), str(B)], out, fork=True),
        "three": _start(["-m", "bnrewrite", "run", "--verify", "--report", "three.json",
                         os.path.join(SCRIPTS, "three_trainers.py"),
                         "--num_gpus", str(K), "--batch_size", str(B), "--train_dir", "three"], out, fork=True),
        "slim": _start(["-m", "bnrewrite", "run", os.path.join(SCRIPTS, "slim_train.py"), "--num_clones", str(K),
                        "--batch_size", str(B), "--train_dir", "slim"], out, fork=True),
        "threads": _start(["-m", "bnrewrite", "run", "--verify", os.path.join(SCRIPTS, "summary_threads.py"),
                           os.path.join(out, "synced"), str(K * B), str(K)], out, fork=True),
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
        assert f"bnrewrite: graph {number}: verified 2 layers x 2 towers on /device:GPU:0..1 (ran on /device:CPU:0): " \
               "worst " in stderr
        assert graphs[number - 1]["verify"]["passed"] and graphs[number - 1]["verify"]["worst"] < 1e-5
    assert "bnrewrite: graph 4 runs unchanged: all 2 batch-norm ops are in inference mode" in stderr
    assert "eval loss" in done["three"].stdout  # the synced checkpoint restores into an un-rewritten graph


def test_verify_checks_the_training_step_not_a_summary_threads_fetch(runs):
    """train.Supervisor and slim.learning.train (model_deploy clones, reference variables) each run a
    forward-only summary thread that fetches the loss before the first step: --verify checks the
    training step (the summary thread runs unchanged)."""
    _, done, _ = runs
    stderr = done["threads"].stderr
    for number in (1, 2):
        assert f"bnrewrite: graph {number}: verified 2 layers x {K} towers on /device:GPU:0..1 (ran on /device:CPU:0): worst " \
            in stderr, stderr
    assert "moving statistics updated once" in stderr and "bnrewrite: error" not in stderr


def test_summary_threads_trainers_under_verify_train_like_one_device(runs):
    out, _, _ = runs
    for name in ("supervisor", "slim"):
        expected = dict(np.load(os.path.join(out, "plain", f"{name}_1.npz")))
        error = _error(dict(np.load(os.path.join(out, "synced", f"{name}_{K}.npz"))), expected)
        unsynced = _error(dict(np.load(os.path.join(out, "plain", f"{name}_{K}.npz"))), expected)
        print(f"{name}: synced {error:.2e}, unsynced {unsynced:.2e}")
        assert error < 1e-5 and unsynced > 1e-2


def test_refused_graph_stops_the_script_before_its_first_step(tmp_path):
    refused = _finish(_start(["-m", "bnrewrite", "run", os.path.join(SCRIPTS, "independent_train.py"), "--train_dir",
                              "refused"], str(tmp_path), fork=True))
    assert refused.returncode == 6, refused.stderr[-2000:]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("bnrewrite:")]
    assert len(lines) == 1 and "train independent models" in lines[0] and "refused" in lines[0]
    assert "step" not in refused.stdout and not os.path.exists(tmp_path / "refused")


def test_ctrl_c_during_training_exits_130(tmp_path):
    with zygote.interruptible():
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


def _together(cases: dict[str, tuple[list[str], str, str]], timeout: float = 60) -> dict[str, subprocess.CompletedProcess]:
    """Run `python ARGS` for every case (name -> (args, cwd, stdin)) at once: a few short
    processes that do not import TensorFlow, so the batch takes about as long as one."""
    started = {name: subprocess.Popen([sys.executable, *args], cwd=cwd, env=ENV, text=True, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for name, (args, cwd, _) in cases.items()}
    done = {}
    try:
        for name, process in started.items():
            out, err = process.communicate(cases[name][2], timeout=timeout)
            done[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    finally:  # one that hangs (a FIFO report opened) fails the test, not the run
        for process in started.values():
            process.kill()
    return done


def test_script_runs_as_python_would(tmp_path):
    """Each way python runs a program, under python and under bnrewrite run side by side: the
    same argv (as given), __name__, __file__, sys.path[0], stdin, stdout, stderr (tracebacks
    without bnrewrite's or runpy's frames, a SyntaxError as python shows it) and exit code."""
    probe = open(os.path.join(SCRIPTS, "probe.py"), encoding="utf-8").read()
    (tmp_path / "probe.py").write_text(probe)
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text(probe)
    with zipfile.ZipFile(tmp_path / "app.zip", "w") as archive:
        archive.writestr("__main__.py", probe)
    (tmp_path / "bad.py").write_text("x = 1\ndef (\n")
    py_compile.compile(str(tmp_path / "probe.py"), str(tmp_path / "compiled.pyc"), doraise=True)
    (tmp_path / "nomain").mkdir()
    ways = {
        "relative": (["probe.py", "--backend", "x", "-q"], "fed"), "directory": (["app", "exit:3"], ""),
        "zip": (["app.zip"], ""), "stdin": (["-", "a"], probe), "syntax error": (["bad.py"], ""),
        "raises": (["probe.py", "raise"], ""), "module": (["-m", "probe", "exit:4"], ""), "pyc": (["compiled.pyc"], ""),
        "no module": (["-m", "nosuch"], ""), "no __main__": (["nomain"], ""),
    }
    cwd = str(tmp_path)
    cases = {}
    for way, (args, stdin) in ways.items():
        cases[f"python {way}"] = (args, cwd, stdin)
        options = ["--backend", "local"] if way == "relative" else []  # run's own, before SCRIPT
        cases[way] = (["-m", "bnrewrite", "run", *options, *args], cwd, stdin)
    done = _together(cases)
    for way in ways:
        python, run = done[f"python {way}"], done[way]
        assert run.returncode == python.returncode, (way, run.stderr)
        if way in ("no module", "no __main__"):  # the message python gives, as bnrewrite's one line
            assert python.stderr.startswith(sys.executable + ": ")
            message = python.stderr[len(sys.executable) + 2:].strip()
            assert run.stderr == f"bnrewrite: error: {'-m nosuch: ' if way == 'no module' else ''}{message}\n", way
            continue
        assert (run.stdout, run.stderr) == (python.stdout, python.stderr), way
    seen = json.loads(done["relative"].stdout)
    assert seen == {"argv": ["probe.py", "--backend", "x", "-q"], "name": "__main__", "file": str(tmp_path / "probe.py"),
                    "path0": cwd, "cwd": cwd, "stdin": "fed", "tensorflow_imported": False}
    assert json.loads(done["stdin"].stdout)["file"] == "<stdin>" and json.loads(done["zip"].stdout)["argv"] == ["app.zip"]
    assert done["raises"].stderr.startswith('Traceback (most recent call last):\n  File "' + str(tmp_path / "probe.py"))
    assert done["syntax error"].stderr.startswith(f'  File "{tmp_path / "bad.py"}", line 2') and done["relative"].stderr == ""


def _scene(path, *, script: str = "", files: dict[str, str] | None = None) -> str:
    """A directory holding script s.py and `files`; returns it."""
    path.mkdir()
    (path / "s.py").write_text(script)
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_text(text)
    return str(path)


def test_report_is_checked_before_the_script_starts(tmp_path):
    """An output problem is exit 10, one line, before the script runs (it would write `ran`),
    with nothing written: through a link, over the script itself, a FIFO (which would block),
    a directory, a device, a missing directory, all with --force."""
    ran = "open('ran', 'w').close()\n"
    scenes = {name: _scene(tmp_path / name.replace(" ", "_"), script=ran, files={"mine.json": "mine"})
              for name in ("link", "script", "fifo", "directory", "device", "missing directory")}
    os.symlink("mine.json", os.path.join(scenes["link"], "link.json"))
    os.mkfifo(os.path.join(scenes["fifo"], "fifo"))
    os.mkdir(os.path.join(scenes["directory"], "out"))
    report = {"link": "link.json", "script": "s.py", "fifo": "fifo", "directory": "out", "device": "/dev/full",
              "missing directory": "nowhere/r.json"}
    before = {name: tree_snapshot(scene) for name, scene in scenes.items()}
    done = _together({name: (["-m", "bnrewrite", "run", "--report", report[name], "--force", "s.py"], scene, "")
                      for name, scene in scenes.items()})
    for name, result in done.items():
        assert result.returncode == 10, (name, result.stderr)
        assert result.stderr.startswith(f"bnrewrite: error: ") and result.stderr.count("\n") == 1, (name, result.stderr)
        assert tree_snapshot(scenes[name]) == before[name], name  # the script did not run; nothing written
    assert "is the input" in done["script"].stderr and "a symbolic link to mine.json" in done["link"].stderr
    assert "a FIFO" in done["fifo"].stderr and "a character device" in done["device"].stderr


def test_report_is_written_where_and_however_the_script_ends(tmp_path):
    """The report's path is taken before the script changes directory; an existing report is
    replaced with --force; a report the script made itself meanwhile is kept, and the script's
    exit code with it (10 if it exited 0); SIGTERM and SIGHUP write it, then end the process
    as the signal does."""
    scenes = {
        "chdir": _scene(tmp_path / "chdir", script="import os\nos.chdir('sub')\n", files={"sub/r.json": "mine"}),
        "force": _scene(tmp_path / "force", files={"r.json": "old"}),
        "taken, exit 3": _scene(tmp_path / "taken3", script="open('r.json', 'w').write('its')\nraise SystemExit(3)\n"),
        "taken, exit 0": _scene(tmp_path / "taken0", script="open('r.json', 'w').write('its')\n"),
        "SIGTERM": _scene(tmp_path / "term", script="import time\nprint('ready', flush=True)\ntime.sleep(60)\n"),
        "SIGHUP": _scene(tmp_path / "hup", script="import time\nprint('ready', flush=True)\ntime.sleep(60)\n"),
    }
    started = {}
    for name, scene in scenes.items():
        force = ["--force"] if name == "force" else []
        started[name] = _start(["-m", "bnrewrite", "run", "--report", "r.json", *force, "s.py"], scene)
    for name in ("SIGTERM", "SIGHUP"):
        assert started[name].stdout.readline() == "ready\n"
        started[name].send_signal(getattr(signal, name))
    done = {name: _finish(process, timeout=60) for name, process in started.items()}

    def report(name: str) -> dict:
        with open(os.path.join(scenes[name], "r.json"), encoding="utf-8") as handle:
            return json.load(handle)

    assert done["chdir"].returncode == 0 and report("chdir")["command"] == "run"
    assert open(os.path.join(scenes["chdir"], "sub", "r.json"), encoding="utf-8").read() == "mine"
    assert done["force"].returncode == 0 and report("force")["graphs"] == []
    for name, code in (("taken, exit 3", 3), ("taken, exit 0", 10)):
        assert done[name].returncode == code, done[name].stderr
        assert "r.json already exists" in done[name].stderr and done[name].stderr.count("\n") == 1
        assert open(os.path.join(scenes[name], "r.json"), encoding="utf-8").read() == "its"
    for name in ("SIGTERM", "SIGHUP"):
        assert done[name].returncode == -getattr(signal, name), done[name].stderr
        assert report(name)["command"] == "run"
    for scene in scenes.values():
        assert not [n for n in os.listdir(scene) if n.startswith(".bnrewrite-")]


@pytest.mark.parametrize("argv, message", [
    (["run"], "run needs SCRIPT or -m MODULE"),
    (["run", "missing.py"], "can't open file 'missing.py'"),
    (["run", "--no-such-option", "x.py"], "unrecognized arguments: --no-such-option"),
    (["run", "--backend", "gpu", "x.py"], "invalid choice: 'gpu'"),
    (["run", "--report", "", "x.py"], "argument --report: '' is an empty path (an unset variable?)"),
    (["convert", "a.pb", "b.pb", "--report", ""], "argument --report: '' is an empty path"),
    (["convert", "a.pb", "b.pb", "--tensorboard", ""], "argument --tensorboard: '' is an empty path"),
    (["verify", "a.pb", "--report", ""], "argument --report: '' is an empty path"),
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
    assert "--report r.json already exists" in capsys.readouterr().err
