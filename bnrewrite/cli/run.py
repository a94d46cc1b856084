"""`bnrewrite run [OPTIONS] SCRIPT [ARGS...]` (or `-m MODULE`): the script runs as
`python SCRIPT ARGS...` would, with `bnrewrite.enable()` in force, so every session it creates
on a multi-tower training graph runs the synchronized graph.

As under python: SCRIPT may be a file, a directory or zip file with `__main__.py`, or `-`
(stdin); `sys.argv` as given, `__name__ == "__main__"`, `__file__`, `sys.path[0]` (the
script's folder, the directory or zip itself, '' for stdin, the current folder for -m), its
stdin and stdout, its exit code (`sys.exit(n)`), an uncaught exception's traceback from the
script's frame (a SyntaxError without one) with exit 1, Ctrl-C as 130. TensorFlow is not
imported ahead of the script, so what it sets first (TF_USE_LEGACY_KERAS, CUDA_VISIBLE_DEVICES,
logging) applies. bnrewrite's own lines go to stderr, prefixed `bnrewrite:`.

--report follows the output rule of every command (bnrewrite.io.staging): its path is resolved
and checked before the script starts, and the file is committed atomically when the script
ends, also on SIGTERM and SIGHUP, after which the process ends as that signal ends it.
"""

from __future__ import annotations

import argparse
import builtins
import importlib.machinery
import importlib.util
import io
import json
import marshal
import os
import runpy
import signal
import sys
import traceback
import types
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bnrewrite.cli.output import INTERRUPTED, USAGE, print_error, print_note
from bnrewrite.errors import BnRewriteError, OutputError
from bnrewrite.session import children, live, sessions

#: run's options that take a value: what comes after them is not SCRIPT.
VALUE_OPTIONS = frozenset({"--backend", "--tower-by", "--group-size", "--timeout", "--workers", "--task-index",
                           "--start-timeout", "--report"})
#: How python ends when it cannot find or read what to run: its exit status.
NOT_FOUND = 1


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """run's own arguments, and SCRIPT (or -m MODULE) with the script's: everything from the
    first argument that is not an option of run belongs to the script."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "-m":
            return argv[:i + 2], argv[i + 2:]
        if token == "--":
            return argv[:i], argv[i + 1:]
        if not token.startswith("-") or token == "-":
            return argv[:i], argv[i:]
        i += 2 if token in VALUE_OPTIONS else 1
    return argv, []


@dataclass
class _Main:
    """What runs as `__main__`, found as python finds it: `sys.argv[0]`, `sys.path[0]`, its
    code, the module attributes python gives it, and the file its code is (None: stdin)."""

    argv0: str
    path0: str
    code: types.CodeType
    attributes: dict[str, Any]
    file: str | None


class _NotRunnable(Exception):
    """Python would refuse to run this (no such module, no __main__.py): its message, exit 1."""


def cmd_run(args: argparse.Namespace) -> int:
    """Run SCRIPT (or -m MODULE) as python would, with enable() in force: --report checked
    before it starts and written when it ends. Returns the script's exit status."""
    if args.module is None and not args.script_argv:
        print_error("run needs SCRIPT or -m MODULE (see 'bnrewrite run --help')")
        return USAGE
    script = args.script_argv[0] if args.module is None else None
    if script is not None and script != "-" and not os.path.exists(script):
        print_error(f"can't open file {script!r}: no such file (see 'bnrewrite run --help')")
        return USAGE
    main = _find(args) if script is not None else None  # -m imports packages: after the report's check
    if isinstance(main, int):
        return main
    report = _check_report(args.report, args.force, [main.file] if main is not None and main.file else [])
    options = dict(backend=args.backend, tower_by=args.tower_by, group_size=args.group_size,
                   timeout_seconds=args.timeout, num_workers=args.workers, task_index=args.task_index or 0,
                   start_timeout_seconds=args.start_timeout, allow_unsynced=args.allow_unsynced, quiet=args.quiet, verbose=args.verbose, verify=args.verify,
                   exit_on_refusal=True)
    sessions.enable(**options)
    children.follow(options)  # multiprocessing 'spawn' children run with the same options
    write = (lambda: _write_report(report, args.force)) if report else None
    with _report_on_signals(write):
        code = _run(args, main)
    if write is not None and not write() and code == 0:
        return OutputError.exit_code
    return code


def _check_report(path: str | None, force: bool, inputs: list[str]) -> str | None:
    """--report's absolute path (the script may change directory), checked by the rule every
    output follows (OutputError, exit 10) before the script starts."""
    if not path:
        return None
    from bnrewrite.io.staging import FILE, check_output, clear_leftovers

    check_output(path, inputs, force, "--report", FILE)
    for note in clear_leftovers(path, "--report"):
        print_note(note)
    return os.path.abspath(path)


def _find(args: argparse.Namespace) -> _Main | int:
    """SCRIPT or -m MODULE found as python finds it, or the exit status python gives when it
    cannot (with its message)."""
    try:
        if args.module is None:
            return _find_script(args.script_argv[0])
        main = _find_module(args.module)
    except _NotRunnable as exc:
        print_error(str(exc))
        return NOT_FOUND
    except SyntaxError as exc:  # python prints it without a traceback
        _print_exception(exc, None)
        return 1
    except OSError as exc:
        print_error(f"can't open file {args.module or args.script_argv[0]!r}: {exc.strerror or exc}")
        return USAGE
    from bnrewrite.io.staging import same_or_nested

    if args.report and main.file and same_or_nested(args.report, main.file):
        raise OutputError(f"--report {args.report} is the module {main.file} that -m {args.module} runs; "
                          "write to a new path (bnrewrite never overwrites its input)")
    return main


def _run(args: argparse.Namespace, main: _Main | None) -> int:
    """Run the script as python would; its exit status."""
    if main is None:
        found = _find(args)
        if isinstance(found, int):
            return found
        main = found
    sys.argv = [main.argv0, *(args.script_argv[1:] if args.module is None else args.script_argv)]
    sys.path[0] = main.path0
    sys.stdout.flush()
    try:
        _exec_as_main(main)
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt as exc:
        _print_exception(exc, main.code.co_filename)
        return INTERRUPTED
    except BaseException as exc:  # noqa: BLE001 - the script's own exception, reported as python would
        _print_exception(exc, main.code.co_filename)
        return 1
    finally:
        sys.stdout.flush()
    return 0


def _find_script(given: str) -> _Main:
    """SCRIPT as python finds it: `-` reads the program from stdin; a directory or zip file
    runs its `__main__` module; anything else is a source (or .pyc) file."""
    if given == "-":
        return _Main("-", "", compile(sys.stdin.buffer.read(), "<stdin>", "exec"), {"__file__": "<stdin>"}, None)
    path = os.path.abspath(given)
    if os.path.isdir(path) or _is_zip(path):
        spec = importlib.machinery.PathFinder.find_spec("__main__", [path])
        if spec is None or spec.loader is None:
            raise _NotRunnable(f"can't find '__main__' module in {path!r}")
        return _Main(given, path, spec.loader.get_code("__main__"), _spec_attributes(spec), spec.origin)  # type: ignore[attr-defined]
    with io.open_code(path) as handle:
        data = handle.read()
    if data[:4] == importlib.util.MAGIC_NUMBER:  # python runs a .pyc file too
        code = marshal.loads(data[16:])
        loader: Any = importlib.machinery.SourcelessFileLoader("__main__", path)
    else:
        code = compile(data, path, "exec")
        loader = importlib.machinery.SourceFileLoader("__main__", path)
    return _Main(given, os.path.dirname(path), code, {"__file__": path, "__loader__": loader}, path)


def _is_zip(path: str) -> bool:
    return os.path.isfile(path) and zipfile.is_zipfile(path)


def _find_module(name: str) -> _Main:
    """-m MODULE as python finds it, its parent packages imported: runpy's own lookup (what
    python -m calls), whose refusals python prints as one line."""
    try:
        _, spec, code = runpy._get_module_details(name, _NotRunnable)  # type: ignore[attr-defined]
    except _NotRunnable as exc:
        raise _NotRunnable(f"-m {name}: {exc}") from None
    return _Main(spec.origin, os.getcwd(), code, _spec_attributes(spec), spec.origin if spec.has_location else None)


def _spec_attributes(spec: importlib.machinery.ModuleSpec) -> dict[str, Any]:
    """The attributes of a `__main__` run from a module spec (as runpy gives them)."""
    return {"__file__": spec.origin, "__cached__": spec.cached, "__loader__": spec.loader, "__spec__": spec,
            "__package__": spec.parent}


def _exec_as_main(main: _Main) -> None:
    """Run the script's code in a fresh `__main__` module, which is sys.modules' `__main__`
    while it runs (as under python, pickle and multiprocessing find its classes there)."""
    module = types.ModuleType("__main__")
    module.__dict__.update({"__builtins__": builtins, "__cached__": None, "__loader__": None, "__spec__": None,
                            "__package__": None, **main.attributes})
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(main.code, module.__dict__)  # noqa: S102 - the user's script, as python runs it
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _exit_code(code: Any) -> int:
    """What python's exit status is for `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _print_exception(exc: BaseException, filename: str | None) -> None:
    """What python prints: the traceback from the script's first frame on (runpy's and
    bnrewrite's frames left out, the script's frames being those of `filename`); an exception
    raised before the script's first frame (a SyntaxError in it) without a traceback."""
    tb = exc.__traceback__
    while tb is not None and (filename is None or tb.tb_frame.f_code.co_filename != filename):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
    sys.stderr.flush()


@contextmanager
def _report_on_signals(write: Callable[[], bool] | None) -> Iterator[None]:
    """While the script runs, SIGTERM and SIGHUP (how schedulers stop jobs) write the report
    first, then end the process as the signal would have (their default action again). Only
    signals whose action is the default are taken over, and only with a report to write; the
    report is written when the main thread next runs Python code (after a running step)."""
    if write is None:
        yield
        return
    previous: dict[int, Any] = {}

    def handler(signum: int, _frame: Any) -> None:
        for number, action in previous.items():
            signal.signal(number, action)
        write()
        signal.raise_signal(signum)

    for name in ("SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) is signal.SIG_DFL:
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for number, action in previous.items():
            if signal.getsignal(number) is handler:
                signal.signal(number, action)


def _write_report(path: str, force: bool) -> bool:
    """Every graph decided while the script ran, in one JSON file committed atomically by the
    output rule; False (with the error printed) when it could not be written."""
    from bnrewrite import __version__
    from bnrewrite.io.staging import Outputs

    document = {"bnrewrite_version": __version__, "command": "run", "graphs": live.records()}
    try:
        with Outputs(force=force) as outputs:
            outputs.stage_bytes(path, (json.dumps(document, indent=2) + "\n").encode(), "--report")
            outputs.commit()
    except BnRewriteError as exc:
        print_error(f"{exc} (after the script ended)")
        return False
    except KeyboardInterrupt:
        print_error("interrupted while writing --report; nothing was written")
        return False
    return True
