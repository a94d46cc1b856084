"""A fork server ("zygote") for the tests' TensorFlow-importing child processes.

What: `spawn(argv, ...)` / `run(argv, ...)` start `python SCRIPT|-m MODULE|-c CODE ARGS...` as
subprocess.Popen / subprocess.run would, but fork the child from a server process that has
already imported TensorFlow (+ tf_keras, bnrewrite), saving ~8 CPU-s and the import's wall time
per child. Why: the suite starts about 60 such children; the import was most of their cost.

Invariants:
- The child is a real separate process (own pid, exit status, signals, cwd, env, fds 0-2) that
  behaves as a cold `python ARGV` with that env: sys.argv, sys.path (path[0], PYTHONPATH, site),
  a fresh __main__, fresh-python signal dispositions (SIGINT ignored if the caller ignores it, as
  an exec'd python keeps it) and an empty signal mask, python's exit
  codes and messages (SystemExit, uncaught exception -> excepthook + 1, KeyboardInterrupt ->
  killed by SIGINT), threads joined, atexit run and stdio flushed at exit. What differs: the
  modules already imported (never use it for a test about import time: a command that must not
  import TensorFlow, `bnrewrite run` patching TensorFlow when the script imports it), the hash
  seed (one per zygote), the parent pid (the zygote's), the preloaded objects frozen out of gc,
  and bnrewrite's command line leaving fd 2 alone (TensorFlow is imported: its native log lines
  under TF_CPP_MIN_LOG_LEVEL < 3 reach stderr); `random` and numpy's global generator are seeded
  afresh, as in a new process.
- A zygote is used only when the child's env agrees with the zygote's on everything read at
  import time (`IMPORT_PREFIXES`, `IMPORT_NAMES` and every variable Python code read during the
  zygote's imports) and the child's sys.path finds the preloaded top-level packages where the
  zygote found them; otherwise, or when BNREWRITE_TEST_ZYGOTE=0, the child is started cold by
  subprocess.Popen (said once on stderr per reason).
- The zygote is a child of the pytest process (so /usr/bin/time counts it and what it forks),
  single-threaded (one select loop), and reaps every child it forked; a child's wait status
  reaches the test over a per-child pipe. It stops at session end (`stop_all`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from importlib.machinery import PathFinder
from typing import Any, Optional

#: Environment variables read while TensorFlow, tf_keras and bnrewrite import, by C++ (TF_*:
#: logging, oneDNN, legacy Keras; CUDA_*; OpenMP/MKL thread pools: OMP_*, KMP_*, MKL_*; gRPC,
#: XLA, NCCL), by the interpreter at start-up (PYTHON*: path, hash seed, io encoding, buffering;
#: LC_* and LANG: the stdio encoding; LD_*: what the loader maps), or by Keras (KERAS_*, HOME: its
#: config folder). A child whose value of any of them differs from the zygote's starts cold.
IMPORT_PREFIXES = ("TF_", "CUDA_", "OMP_", "KMP_", "MKL_", "GRPC_", "XLA_", "NCCL_", "PYTHON", "LC_", "LD_", "KERAS_")
IMPORT_NAMES = frozenset({"LANG", "HOME", "TMPDIR", "TEMP", "TMP"})
#: What the zygote imports: what nearly every converted child imports first.
PRELOAD = ("tensorflow", "bnrewrite", "bnrewrite.cli.app", "bnrewrite.entry", "bnrewrite.session.sessions")
MAX_ZYGOTES = 2
_STATUS = struct.Struct("q")


# ---------------------------------------------------------------------------------------------
# The client (in the pytest process)
# ---------------------------------------------------------------------------------------------

def _import_keys(env: dict) -> set:
    """The names in `env` that matter at import time by their name alone."""
    return {k for k in env if k.startswith(IMPORT_PREFIXES) or k in IMPORT_NAMES}


class _Zygote:
    """One fork server: its process, its control socket, and what it was started with."""

    def __init__(self, env: dict) -> None:
        self.env = dict(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
                                        env=self.env, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        pass_fds=[theirs.fileno()])
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        ready = json.loads(ours.recv(1 << 20) or b"null")
        if not ready:
            self.process.wait()
            raise OSError(f"the zygote did not start (exit {self.process.returncode})")
        self.reads = set(ready["reads"])
        self.base_path = ready["base_path"]
        self.origins = ready["origins"]

    def serves(self, env: dict) -> bool:
        """Whether a child with `env` may be forked here (import-time variables all equal)."""
        keys = _import_keys(env) | _import_keys(self.env) | self.reads
        return all(env.get(k) == self.env.get(k) for k in keys)

    def shadowed(self, path0: str) -> Optional[str]:
        """A preloaded package the child's sys.path would find elsewhere, or None."""
        path = [path0, *self.base_path]
        for name, origin in self.origins.items():
            spec = PathFinder.find_spec(name, path)
            if spec is None or spec.origin != origin:
                return name
        return None

    def request(self, message: dict, fds: list[int]) -> int:
        """Send one spawn request; returns the read end of the child's status pipe."""
        read, write = os.pipe()
        try:
            with self.lock:
                socket.send_fds(self.sock, [json.dumps(message).encode()], [*fds, write])
        except OSError:
            os.close(read)
            raise
        finally:
            os.close(write)
        return read

    def stop(self) -> None:
        """Close the control socket (the zygote then kills and reaps what is left) and reap it."""
        self.sock.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_zygotes: list[_Zygote] = []
_failed: list[dict] = []  # the environments a zygote failed to start with
_said: set = set()


def _say_cold(reason: str) -> None:
    """Tell once per reason that children start cold."""
    if reason not in _said:
        _said.add(reason)
        print(f"zygote: starting children cold: {reason}", file=sys.stderr)


def _zygote_for(env: dict) -> Optional[_Zygote]:
    """The running zygote serving `env`, or a new one, or None (then: cold)."""
    for zygote in _zygotes:
        if zygote.serves(env):
            return zygote
    if env in _failed:
        return None
    if len(_zygotes) >= MAX_ZYGOTES:
        _say_cold(f"already {MAX_ZYGOTES} zygotes, none for this environment")
        return None
    try:
        zygote = _Zygote(env)
        _log("zygote", [sys.executable, str(zygote.process.pid)])
    except OSError as error:
        _failed.append(env)
        _say_cold(str(error))
        return None
    _zygotes.append(zygote)
    return zygote


def stop_all() -> None:
    """Stop every zygote of this process (session end)."""
    while _zygotes:
        _zygotes.pop().stop()


atexit.register(stop_all)


def _path0(argv: list[str], cwd: str) -> Optional[str]:
    """sys.path[0] as python sets it for `argv` run in `cwd` (absolute), or None: not a form
    the zygote runs (options before the script, a directory or zip file, stdin)."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] in ("-m", "-c"):
        return cwd if len(argv) > 2 else None
    if argv[1].startswith("-"):
        return None
    script = os.path.join(cwd, argv[1])
    return os.path.dirname(os.path.realpath(script)) if os.path.isfile(script) else None


class ForkedPopen(subprocess.Popen):
    """subprocess.Popen whose child is forked by a zygote: Popen's own pipes, text mode,
    communicate and timeouts; the exit status is read from the zygote's status pipe."""

    def __init__(self, zygote: _Zygote, args: list[str], **kwargs: Any) -> None:
        self._zygote = zygote
        self._status: Optional[int] = None
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids,
                       uid, umask, start_new_session, *rest):
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        message = {"argv": [os.fsdecode(a) for a in args], "cwd": os.fsdecode(cwd) if cwd else os.getcwd(),
                   "env": {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()},
                   "setsid": bool(start_new_session),
                   # an exec'd python inherits an ignored SIGINT (a suite started in the background) and keeps it
                   "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}
        try:
            self._status = self._zygote.request(message, fds)
            data = os.read(self._status, _STATUS.size)
            if len(data) != _STATUS.size:
                raise OSError("the zygote stopped before forking")
            self.pid = _STATUS.unpack(data)[0]
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _read_status(self, timeout: Optional[float]) -> None:
        """Wait up to `timeout` for the child's wait status; set returncode when it came."""
        if self._status is None or not select.select([self._status], [], [], timeout)[0]:
            return
        data = os.read(self._status, _STATUS.size)
        os.close(self._status)
        self._status = None
        if len(data) == _STATUS.size:
            self._handle_exitstatus(_STATUS.unpack(data)[0])
        else:  # the zygote died first: the status is lost
            self.returncode = -signal.SIGKILL

    def _internal_poll(self, _deadstate=None, **_: Any) -> Optional[int]:
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                self._read_status(0)
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _wait(self, timeout: Optional[float]) -> int:
        with self._waitpid_lock:
            if self.returncode is None:
                self._read_status(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


_POPEN_OK = frozenset({"cwd", "env", "stdin", "stdout", "stderr", "text", "universal_newlines", "encoding", "errors",
                       "bufsize", "start_new_session"})


def spawn(args: list, **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen(args, **kwargs), the child forked by a zygote when it can be (see the
    module docstring), else started cold."""
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    argv = [os.fsdecode(a) for a in args]
    cwd = os.path.abspath(os.fsdecode(kwargs["cwd"])) if kwargs.get("cwd") else os.getcwd()
    path0 = _path0(argv, cwd)
    if os.environ.get("BNREWRITE_TEST_ZYGOTE") == "0":
        _say_cold("BNREWRITE_TEST_ZYGOTE=0")
    elif path0 is None or set(kwargs) - _POPEN_OK:
        _say_cold(f"not a python SCRIPT / -m / -c command line: {argv[:2]} {sorted(set(kwargs) - _POPEN_OK)}")
    elif any(not os.path.isabs(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p):
        _say_cold("a relative PYTHONPATH entry")
    else:
        zygote = _zygote_for(env)
        shadow = zygote and zygote.shadowed(path0)
        if shadow:
            _say_cold(f"{shadow} would be imported from elsewhere")
        elif zygote:
            try:
                process = ForkedPopen(zygote, argv, **kwargs)
                _log("forked", argv)
                return process
            except OSError as error:
                _zygotes.remove(zygote)
                _say_cold(f"the zygote failed: {error}")
    _log("cold", argv)
    return subprocess.Popen(args, **kwargs)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Children started within get SIGINT at its default, as at a terminal, also when this process
    ignores it (a suite started in the background, `pytest &`): an exec keeps an ignored signal but
    resets a handled one. Main thread only."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _log(how: str, argv: list[str]) -> None:
    """One line per child to $BNREWRITE_TEST_ZYGOTE_LOG when set (counting forks and imports)."""
    if os.environ.get("BNREWRITE_TEST_ZYGOTE_LOG"):
        with open(os.environ["BNREWRITE_TEST_ZYGOTE_LOG"], "a", encoding="utf-8") as log:
            print(how, os.getpid(), *(arg[:80].replace("\n", " ") for arg in argv[1:4]), file=log)


def run(args: list, *, input: Any = None, capture_output: bool = False, timeout: Optional[float] = None,
        check: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
    """subprocess.run(args, ...), the child started by `spawn`."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with spawn(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            process.kill()
            error.stdout, error.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
    if check and process.returncode:
        raise subprocess.CalledProcessError(process.returncode, process.args, stdout, stderr)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


# ---------------------------------------------------------------------------------------------
# The server (`python tests/zygote.py FD`): imports, then forks children on request
# ---------------------------------------------------------------------------------------------

def _record_environ_reads() -> set:
    """Record every os.environ key Python code reads from now on (the import's env reads)."""
    reads: set = set()
    environ_class = type(os.environ)

    class Recording(environ_class):  # type: ignore[misc, valid-type]
        def __getitem__(self, key):
            if isinstance(key, str):
                reads.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            if isinstance(key, str):
                reads.add(key)
            return super().__contains__(key)

    os.environ.__class__ = Recording
    return reads


def _preload() -> tuple[set, dict]:
    """Import PRELOAD (tf_keras too under TF_USE_LEGACY_KERAS); the env keys read, and each
    top-level package not from the standard library or site-packages with where it was found."""
    import importlib
    import sysconfig

    reads = _record_environ_reads()
    names = [*PRELOAD, *(["tf_keras"] if os.environ.get("TF_USE_LEGACY_KERAS") in ("1", "true", "True") else [])]
    for name in names:
        importlib.import_module(name)
    os.environ.__class__ = type(os.environ).__mro__[1]
    installed = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    origins = {}
    for name, module in list(sys.modules.items()):
        origin = getattr(getattr(module, "__spec__", None), "origin", None)
        if "." not in name and origin and os.path.isabs(origin) and name != "__main__" \
                and not any(os.path.realpath(origin).startswith(p + os.sep) for p in installed):
            origins[name] = origin
    return reads, origins


class _Server:
    """The zygote's select loop: requests on the control socket, SIGCHLD through a wakeup pipe."""

    def __init__(self, sock: socket.socket, base_path: list[str]) -> None:
        self.sock = sock
        self.base_path = base_path
        self.children: dict[int, int] = {}  # pid -> write end of its status pipe
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C ends pytest, which closes our socket
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)

    def serve(self) -> None:
        """Fork on requests until the control socket closes; then kill and reap what is left."""
        while True:
            ready = select.select([self.sock, self.wake_r], [], [])[0]
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
                self.reap()
            if self.sock in ready:
                message, fds, _, _ = socket.recv_fds(self.sock, 1 << 20, 4)
                if not message:
                    break
                self.fork(json.loads(message), fds)
        for pid in self.children:
            os.kill(pid, signal.SIGKILL)
        while self.children:
            self.reap(block=True)

    def reap(self, block: bool = False) -> None:
        """Pass every exited child's wait status to its status pipe."""
        while self.children:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            if pid == 0:
                return
            write = self.children.pop(pid, None)
            if write is not None:
                try:
                    os.write(write, _STATUS.pack(status))
                except OSError:  # the test dropped its handle
                    pass
                os.close(write)
            if block:
                return

    def fork(self, request: dict, fds: list[int]) -> None:
        """Fork one child for `request` (stdin, stdout, stderr, status pipe in `fds`)."""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _become_child(request, fds, [self.sock.fileno(), self.wake_r, self.wake_w, *self.children.values()],
                              self.base_path)
            finally:
                os._exit(code)  # only reached if setting the child up failed
        for fd in fds[:3]:
            os.close(fd)
        self.children[pid] = fds[3]
        os.write(fds[3], _STATUS.pack(pid))


def _become_child(request: dict, fds: list[int], server_fds: list[int], base_path: list[str]) -> None:
    """In the forked child: become `python ARGV` with the request's env, cwd and fds; never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN if request["sigint_ignored"] else signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    if request["setsid"]:
        os.setsid()
    for fd in [*server_fds, fds[3]]:
        os.close(fd)
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in set(fds[:3]):
        os.close(fd)
    for stream, fd in ((sys.__stdout__, 1), (sys.__stderr__, 2)):
        if stream is not None and not stream.write_through:
            stream.reconfigure(line_buffering=fd == 2 or os.isatty(fd))
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _reseed()
    _run_main(request["argv"][1:], base_path)


def _reseed() -> None:
    """Fresh random states, as a cold process has (a fork copies the zygote's)."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _run_main(argv: list[str], base_path: list[str]) -> None:
    """Run `SCRIPT|-m MODULE|-c CODE ARGS` in a fresh __main__ as python's main does, then exit
    as python exits (threads joined, atexit, stdio flushed, the status python would give)."""
    import builtins
    import types
    from importlib.machinery import BuiltinImporter

    main = types.ModuleType("__main__")
    main.__dict__.update(__annotations__={}, __builtins__=builtins, __loader__=BuiltinImporter)
    sys.modules["__main__"] = main
    sys.orig_argv = [sys.executable, *argv]
    status, interrupted = 1, False
    try:
        status, interrupted = _execute(argv, base_path, main)
        status = _finalize(status)
    finally:
        if interrupted:  # python 3.11 ends by SIGINT after its finalization
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(status)


def _execute(argv: list[str], base_path: list[str], main: Any) -> tuple[int, bool]:
    """Set sys.argv and sys.path as python does for `argv` and run it in `main`; the exit
    status and whether it ended by an uncaught KeyboardInterrupt."""
    import importlib
    from importlib.machinery import SourceFileLoader

    try:
        if argv[0] == "-c":
            sys.argv, sys.path[:] = ["-c", *argv[2:]], ["", *base_path]
            importlib.invalidate_caches()
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            import runpy

            sys.argv, sys.path[:] = ["-m", *argv[2:]], [os.getcwd(), *base_path]
            importlib.invalidate_caches()
            runpy._run_module_as_main(argv[1], alter_argv=True)
        else:
            filename = os.path.abspath(argv[0])
            sys.argv, sys.path[:] = list(argv), [os.path.dirname(os.path.realpath(filename)), *base_path]
            importlib.invalidate_caches()
            main.__dict__.update(__file__=filename, __cached__=None, __loader__=SourceFileLoader("__main__", filename))
            with open(filename, "rb") as source:
                code = compile(source.read(), filename, "exec")
            exec(code, main.__dict__)
        return 0, False
    except SystemExit as exit_:
        return _exit_status(exit_), False
    except BaseException as error:  # noqa: B902 - python's main prints every uncaught one
        traceback = error.__traceback__
        while traceback is not None and traceback.tb_frame.f_code.co_filename == __file__:
            traceback = traceback.tb_next
        sys.excepthook(type(error), error.with_traceback(traceback), traceback)
        return 1, isinstance(error, KeyboardInterrupt)


def _exit_status(exit_: SystemExit) -> int:
    """The exit status python gives a SystemExit (a non-int code printed to stderr, status 1)."""
    code = exit_.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001 - python ignores it too
        pass
    return 1


def _finalize(status: int) -> int:
    """Python's exit: wait for non-daemon threads, atexit handlers, flush stdio, then free the
    script's objects (files it left open are flushed by their finalizers)."""
    import atexit as atexit_module
    import gc

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except SystemExit as exit_:
        status = _exit_status(exit_)
    atexit_module._run_exitfuncs()
    _flush()
    sys.modules["__main__"].__dict__.clear()
    gc.collect()
    _flush()
    return status


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream, as python ignores
            pass


def _serve(fd: int) -> None:
    """The zygote's main: import, say ready (what it read and found), serve until EOF."""
    base_path = sys.path[1:] if not sys.flags.safe_path else list(sys.path)
    sock = socket.socket(fileno=fd)
    saved = os.dup(2)  # TensorFlow's import-time log lines (a cold child's, captured) off the terminal
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        reads, origins = _preload()
    except BaseException as error:  # noqa: B902 - reported to the client, which goes cold
        os.dup2(saved, 2)
        print(f"zygote: import failed: {error!r}", file=sys.stderr)
        sock.send(b"null")
        return
    os.dup2(saved, 2)
    os.close(saved)
    import gc

    gc.collect()
    gc.freeze()  # the preloaded objects: never scanned (nor copied on write) by a child's collections
    sock.send(json.dumps({"reads": sorted(reads), "base_path": base_path, "origins": origins}).encode())
    _Server(sock, base_path).serve()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
