"""tests/zygote.py: a child forked by the zygote behaves as a cold `python ARGV` does.

Each form (script, -m, -c) runs a probe under both and the two transcripts (argv, sys.path[0],
cwd, __main__, env, stdin/stdout/stderr, atexit, a non-daemon thread, exit status, signals) are
compared; the forked one must also find TensorFlow already imported (the fork happened).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The environment most converted call sites give their children: one zygote serves them all.
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT, "PROBE": "seen"}

PROBE = r'''
import atexit, os, signal, sys, threading, time
print("argv", sys.argv, "path0", repr(sys.path[0]), "cwd", os.getcwd())
print("main", __name__, globals().get("__file__"), __spec__ and __spec__.name, sorted(globals()))
print("env", os.environ.get("PROBE"), os.environ.get("PYTHONPATH"), len(os.environ))
print("stdio", sys.stdout.line_buffering, sys.stderr.line_buffering, sys.stdout.encoding, sys.stdin.read())
print("signals", signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGPIPE), signal.getsignal(signal.SIGTERM),
      signal.getsignal(signal.SIGCHLD), sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
print("session leader", os.getsid(0) == os.getpid())
print("to stderr", file=sys.stderr)
atexit.register(print, "atexit ran")
threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
print("tensorflow imported", "tensorflow" in sys.modules, file=sys.stderr)
mode = sys.argv[-1]
if mode == "exit3":
    sys.exit(3)
if mode == "message":
    sys.exit("a message")
if mode == "raise":
    raise ValueError("uncaught")
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "wait":
    print("waiting", flush=True)
    time.sleep(60)
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    """The probe as a script, as a module in the working folder, and as -c code."""
    folder = tmp_path_factory.mktemp("probe")
    (folder / "probe.py").write_text(PROBE)
    (folder / "probe_module.py").write_text(PROBE)
    return {"cwd": str(folder), "script": [sys.executable, "probe.py"],
            "module": [sys.executable, "-m", "probe_module"], "code": [sys.executable, "-c", PROBE]}


def _both(argv: list[str], cwd: str, **options) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """The same command forked by the zygote and started cold."""
    common = dict(cwd=cwd, env=ENV, capture_output=True, text=True, input="from stdin", timeout=120, **options)
    forked, cold = zygote.run(argv, **common), subprocess.run(argv, **common)
    assert "tensorflow imported True" in forked.stderr and "tensorflow imported False" in cold.stderr
    return forked, cold


def _same(forked: subprocess.CompletedProcess, cold: subprocess.CompletedProcess) -> None:
    """The two transcripts agree but for the line saying whether TensorFlow was imported."""
    assert forked.returncode == cold.returncode
    assert forked.stdout == cold.stdout
    assert forked.stderr.replace("imported True", "imported False") == cold.stderr


@pytest.mark.parametrize("form", ["script", "module", "code"])
def test_each_form_runs_as_cold_python(probe, form):
    forked, cold = _both([*probe[form], "arg", "--option"], probe["cwd"])
    _same(forked, cold)
    assert forked.returncode == 0 and "from stdin" in forked.stdout and "seen" in forked.stdout
    assert forked.stdout.rstrip().endswith("thread finished\natexit ran")
    assert "to stderr" in forked.stderr


@pytest.mark.parametrize("mode, status", [("exit3", 3), ("message", 1), ("raise", 1), ("interrupt", -signal.SIGINT)])
def test_exit_statuses_as_cold_python(probe, mode, status):
    forked, cold = _both([*probe["script"], mode], probe["cwd"])
    _same(forked, cold)
    assert forked.returncode == status
    expected = {"message": "a message\n", "raise": "ValueError: uncaught\n", "interrupt": "KeyboardInterrupt\n"}
    assert forked.stderr.endswith(expected.get(mode, "imported True\n"))
    if mode == "raise":  # the traceback starts at the script, as python's does
        assert forked.stderr.split("Traceback (most recent call last):\n")[1].startswith('  File "' + probe["cwd"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_reach_the_forked_child(probe, sig):
    process = zygote.spawn([*probe["module"], "wait"], cwd=probe["cwd"], env=ENV, text=True, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert isinstance(process, zygote.ForkedPopen)
    assert process.stdout.readline().startswith("argv")
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.1)
    while process.stdout.readline() not in ("waiting\n", ""):
        pass
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == -sig  # SIGINT: KeyboardInterrupt, then ended by SIGINT as python 3.11 does
    assert stderr.endswith("KeyboardInterrupt\n") == (sig == signal.SIGINT)


def test_a_new_session(probe):
    forked, cold = _both(probe["code"], probe["cwd"], start_new_session=True)
    _same(forked, cold)
    assert "session leader True" in forked.stdout


def test_import_time_variables_and_shadowed_packages_start_cold(probe, tmp_path):
    server = zygote._zygote_for(ENV)
    assert server.serves({**ENV, "PROBE": "other", "UNREAD_AT_IMPORT": "1"})
    assert not server.serves({**ENV, "TF_ENABLE_ONEDNN_OPTS": "0" if ENV.get("TF_ENABLE_ONEDNN_OPTS") == "1" else "1"})
    assert not server.serves({k: v for k, v in ENV.items() if k != "PYTHONPATH"})
    assert "TF_USE_LEGACY_KERAS" in server.reads and "PATH" in server.reads  # read by Python code at import
    assert not server.serves({**ENV, "PATH": "/nowhere"})
    (tmp_path / "bnrewrite").mkdir()
    (tmp_path / "bnrewrite" / "__init__.py").write_text("print('the shadowing bnrewrite')\n")
    code = "import sys, bnrewrite; print('tensorflow' in sys.modules)"
    process = zygote.spawn([sys.executable, "-c", code], cwd=str(tmp_path), env=ENV, stdout=subprocess.PIPE, text=True)
    assert not isinstance(process, zygote.ForkedPopen)
    assert process.communicate(timeout=60)[0] == "the shadowing bnrewrite\nFalse\n"
