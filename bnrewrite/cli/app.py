"""main(): parse the arguments, run the command, and turn whatever it raises into one line on
stderr and the exit code of its error class (BnRewriteError's, 128 + N on a signal, 70 for a
bug). SIGTERM and SIGHUP unwind like Ctrl-C, so staged outputs are removed on the way out;
`inspect --json` prints a JSON document even when it fails before its report.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

from bnrewrite import __version__
from bnrewrite.cli.document import rewrite_keywords
from bnrewrite.cli.output import PROG, cli_wording, one_line, print_error, silence_stdout
from bnrewrite.cli.parser import INTERNAL_ERROR, USAGE, build_parser, replication_problem
from bnrewrite.cli.run import cmd_run, split_argv
from bnrewrite.cli.tf import quiet_tensorflow
from bnrewrite.errors import BnRewriteError


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_argv: list[str] = []
    if argv[:1] == ["run"]:
        own, script_argv = split_argv(argv[1:])
        argv = ["run", *own]
    args = build_parser().parse_args(argv)
    problem = replication_problem(args)
    if problem is not None:
        print_error(f"{problem} (see '{PROG} {args.command} --help')")
        return USAGE
    if args.command == "run":  # the script's own stderr, logging and signals stay its own
        args.script_argv = script_argv
        try:
            return cmd_run(args)
        except BnRewriteError as exc:
            print_error(cli_wording(str(exc)))
            return exc.exit_code
    if not args.verbose:
        quiet_tensorflow()
    previous = _stop_on_signals()
    try:
        return int(args.func(args) or 0)
    except BnRewriteError as exc:
        message = cli_wording(str(exc))
        print_error(message)
        _json_failure(args, type(exc).__name__, message, exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        outputs = getattr(args, "outputs", None)
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        if outputs is not None and outputs.committed:
            message = f"{what} after every output was written (they are complete)"
        else:
            message = f"{what}; nothing was written"
        print_error(message)
        _json_failure(args, type(exc).__name__, message, 128 + signum)
        return 128 + signum
    except BrokenPipeError:
        silence_stdout()
        return 0
    except Exception as exc:  # noqa: BLE001 - the last resort: one line, not a traceback
        if args.verbose:
            traceback.print_exc()
        message = (f"internal error: {type(exc).__name__}: {one_line(str(exc))} "
                   "(a bnrewrite bug: please report it with the command you ran; -v shows the traceback)")
        print_error(message)
        _json_failure(args, type(exc).__name__, message, INTERNAL_ERROR)
        return INTERNAL_ERROR
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C's KeyboardInterrupt so that every output staged
    so far is removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, _frame: Any) -> None:
    raise Stopped(signum)


def _stop_on_signals() -> dict[int, Any]:
    """SIGTERM and SIGHUP unwind like Ctrl-C (unless ignored, e.g. under nohup); the handlers
    they had, to put back."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    for name in ("SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) is signal.SIG_DFL:
            previous[signum] = signal.signal(signum, _stop)
    return previous


def _json_failure(args: argparse.Namespace, name: str, message: str, exit_code: int) -> None:
    """`inspect --json` prints JSON whatever happens: on a failure before its report, a document
    with the report's keys that it has and the error, as in a report of a graph that fails."""
    if args.command != "inspect" or not args.json or getattr(args, "json_printed", False):
        return
    from bnrewrite.rewrite.report import SCHEMA_VERSION

    document = {
        "schema_version": SCHEMA_VERSION, "bnrewrite_version": __version__, "command": "inspect",
        "input": {"path": args.input, "format": None}, "output": None,
        "options": {**rewrite_keywords(args), "tags": args.tags}, "graphs": [],
        "error": {"class": name, "exit_code": exit_code, "message": message},
    }
    try:
        print(json.dumps(document, indent=2))
    except BrokenPipeError:
        silence_stdout()
