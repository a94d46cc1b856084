"""What the command line prints: stdout for people (Printer, quiet with -q, more with -v),
the one-line error on stderr, and an API error message reworded in the command line's flags.
Shared by every command; imports nothing from the rest of bnrewrite.cli.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

PROG = "bnrewrite"

#: The keyword arguments of rewrite_graph and check -> the options that set them.
_FLAGS = {
    "backend": "--backend", "tower_by": "--tower-by", "group_size": "--group-size",
    "timeout_seconds": "--timeout", "num_workers": "--workers", "task_index": "--task-index",
    "allow_unsynced": "--allow-unsynced", "start_timeout_seconds": "--start-timeout",
    "towers": "--towers", "steps": "--steps",  # bnrewrite.check's
}
_KEYWORD = re.compile(r"\b(" + "|".join(_FLAGS) + r")=\"?([\w.]*)\"?|\b(" + "|".join(k for k in _FLAGS if "_" in k) + r")\b")

#: Unexpected internal errors (a bug): EX_SOFTWARE from sysexits.h.
INTERNAL_ERROR = 70
INTERRUPTED = 130
USAGE = 2


def cli_wording(message: str) -> str:
    """An error message of the Python API in the command line's words: `backend="collective"`
    becomes `--backend collective`, `group_size` `--group-size`."""
    def flag(match: re.Match[str]) -> str:
        if match.group(3):
            return _FLAGS[match.group(3)]
        return f"{_FLAGS[match.group(1)]} {match.group(2)}"

    return _KEYWORD.sub(flag, message)


def print_error(message: str) -> None:
    """`bnrewrite: error: MESSAGE` as one line on stderr."""
    sys.stderr.write(f"{PROG}: error: {one_line(message, 2000)}\n")
    sys.stderr.flush()


def print_note(message: str) -> None:
    """`bnrewrite: note: MESSAGE` as one line on stderr (something done that the user should know)."""
    sys.stderr.write(f"{PROG}: note: {one_line(message, 2000)}\n")
    sys.stderr.flush()


def one_line(text: str, limit: int = 500) -> str:
    """`text` on one line, whitespace collapsed, cut to `limit` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def silence_stdout() -> None:
    """Point stdout at /dev/null once its reader has gone, so exiting does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def entries_summary(model: Any) -> str:
    """The node count of a graph, or of each of a SavedModel's MetaGraphs."""
    if model.is_saved_model:
        return ", ".join(f"MetaGraph {e.label} {len(e.graph_def.node)} nodes" for e in model.entries)
    return f"{len(model.entries[0].graph_def.node)} nodes"


def report_text(report: Any, verbose: bool = False) -> str:
    """The report's text: every op removed if verbose, else a count after the first few."""
    return report.text(verbose, more="-v lists them")


class Printer:
    """stdout for people: nothing with -q, more with -v."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.quiet = bool(getattr(args, "quiet", False))
        self.is_verbose = bool(getattr(args, "verbose", False))

    def line(self, text: str = "") -> None:
        if not self.quiet:
            print(text)

    def block(self, text: str) -> None:
        if not self.quiet:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")

    def verbose(self, text: str) -> None:
        if self.is_verbose:
            print(text)
