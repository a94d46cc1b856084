"""The `bnrewrite` command line: convert, inspect, diff and check models.

Every failure prints one line, `bnrewrite: error: ...`, on stderr and exits with the code of
its error class (see EXIT_CODES and README.md, "Exit codes"); nothing is written and the
input is never changed. TensorFlow is imported only after the checks that do not need it,
and its import-time logging is silenced unless -v is given.

One module per command (convert, inspect, diff; check lives in bnrewrite.rewrite.selfcheck), over
shared ones: parser (arguments, epilogs, exit codes), app (main), output (what is printed),
document (the JSON report) and tf (the quiet TensorFlow import). Commands import only the
shared modules, never each other.

May import every layer below: bnrewrite.io, bnrewrite.session, bnrewrite.rewrite, bnrewrite.match,
bnrewrite.graph, bnrewrite.errors (and the package's `__version__`).
"""

from bnrewrite.cli.app import Stopped, main
from bnrewrite.cli.convert import cmd_convert
from bnrewrite.cli.diff import cmd_diff
from bnrewrite.cli.inspect import cmd_inspect
from bnrewrite.cli.output import PROG, cli_wording, report_text
from bnrewrite.cli.parser import EXIT_CODES, INTERNAL_ERROR, INTERRUPTED, USAGE, build_parser

__all__ = [
    "EXIT_CODES", "INTERNAL_ERROR", "INTERRUPTED", "PROG", "USAGE", "Stopped", "build_parser",
    "cli_wording", "cmd_convert", "cmd_diff", "cmd_inspect", "main", "report_text",
]
