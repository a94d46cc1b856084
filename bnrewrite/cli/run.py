"""`bnrewrite run [OPTIONS] SCRIPT [ARGS...]` (or `-m MODULE`): the script runs as
`python SCRIPT ARGS...` would, with `bnrewrite.enable()` in force, so every session it creates
on a multi-tower training graph runs the synchronized graph.

As under python: `sys.argv`, `__name__ == "__main__"`, `sys.path[0]` (the script's folder, or
the current one for -m), its stdin and stdout, its exit code (`sys.exit(n)`), an uncaught
exception's traceback with exit 1, Ctrl-C as 130. TensorFlow is not imported ahead of the
script, so what it sets first (TF_USE_LEGACY_KERAS, CUDA_VISIBLE_DEVICES, logging) applies.
bnrewrite's own lines go to stderr, prefixed `bnrewrite:`.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from bnrewrite import children, live
from bnrewrite.cli.output import INTERRUPTED, USAGE, print_error
from bnrewrite.errors import BnRewriteError, OutputError

#: run's options that take a value: what comes after them is not SCRIPT.
VALUE_OPTIONS = frozenset({"--backend", "--tower-by", "--group-size", "--timeout", "--workers", "--task-index",
                           "--report"})


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


def cmd_run(args: argparse.Namespace) -> int:
    if args.module is None and not args.script_argv:
        print_error("run needs SCRIPT or -m MODULE (see 'bnrewrite run --help')")
        return USAGE
    if args.module is None and not os.path.isfile(args.script_argv[0]):
        print_error(f"can't open file {args.script_argv[0]!r}: no such file (see 'bnrewrite run --help')")
        return USAGE
    if args.report and os.path.lexists(args.report) and not args.force:
        raise OutputError(f"--report {args.report} exists; choose another path or add --force to replace it")
    options = dict(backend=args.backend, tower_by=args.tower_by, group_size=args.group_size,
                   timeout_seconds=args.timeout, num_workers=args.workers, task_index=args.task_index or 0,
                   allow_unsynced=args.allow_unsynced, quiet=args.quiet, verbose=args.verbose, verify=args.verify,
                   exit_on_refusal=True)
    live.enable(**options)
    children.follow(options)  # multiprocessing 'spawn' children run with the same options
    try:
        return _run_script(args)
    finally:
        if args.report:
            _write_report(args.report)


def _run_script(args: argparse.Namespace) -> int:
    sys.stdout.flush()
    if args.module is not None:
        sys.argv = [args.module, *args.script_argv]
        sys.path[0] = os.getcwd()
        entry = args.module
        run = lambda: runpy.run_module(args.module, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script = os.path.abspath(args.script_argv[0])
        sys.argv = list(args.script_argv)
        sys.path[0] = os.path.dirname(script)
        entry = script
        run = lambda: runpy.run_path(script, run_name="__main__")  # noqa: E731
    try:
        run()
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt as exc:
        _print_traceback(exc, entry)
        return INTERRUPTED
    except BaseException as exc:  # noqa: BLE001 - the script's own exception, reported as python would
        _print_traceback(exc, entry)
        return 1
    finally:
        sys.stdout.flush()
    return 0


def _exit_code(code: Any) -> int:
    """What python's exit status is for `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _print_traceback(exc: BaseException, entry: str) -> None:
    """The traceback python would print: from the script's first frame on (runpy's and
    bnrewrite's frames left out)."""
    tb = exc.__traceback__
    while tb is not None and not _is_script_frame(tb.tb_frame.f_code.co_filename, entry):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb if tb is not None else exc.__traceback__)
    sys.stderr.flush()


def _is_script_frame(filename: str, entry: str) -> bool:
    if os.path.isabs(entry):
        return os.path.abspath(filename) == entry
    return filename != runpy.__file__ and not os.path.abspath(filename).startswith(_PACKAGE)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _write_report(path: str) -> None:
    """Every graph decided while the script ran, in one JSON file."""
    from bnrewrite import __version__

    document = {"bnrewrite_version": __version__, "command": "run", "graphs": live.records()}
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=2)
    except OSError as exc:
        raise BnRewriteError(f"--report {path} could not be written: {exc.strerror}") from None
