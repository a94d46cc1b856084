"""The `bnrewrite` command line: convert, inspect and diff models.

Every failure prints one line, `bnrewrite: error: ...`, on stderr and exits with the code of
its error class (see EXIT_CODES and README.md, "Exit codes"); nothing is written and the
input is never changed. TensorFlow is imported only after the checks that do not need it,
and its import-time logging is silenced unless -v is given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

from bnrewrite import __version__, errors, selfcheck
from bnrewrite.errors import BnRewriteError, OutputError

PROG = "bnrewrite"
#: Unexpected internal errors (a bug): EX_SOFTWARE from sysexits.h.
INTERNAL_ERROR = 70
INTERRUPTED = 130
USAGE = 2
#: Exit code -> what it means, for --help and the README.
EXIT_CODES: list[tuple[int, str, str]] = [
    (0, "", "success (convert wrote OUT, or --dry-run/inspect/diff found no problem)"),
    (1, "BnRewriteError", "other bnrewrite error (e.g. an option that does not fit the graph: --group-size, --tags on a graph file)"),
    (USAGE, "", "usage error: unknown command or option, missing argument, --workers N without --task-index"),
    *((cls.exit_code, cls.__name__, (cls.__doc__ or "").strip().splitlines()[0]) for cls in (
        errors.InputFormatError, errors.NoBatchNormError, errors.InferenceOnlyError, errors.NoTowersError,
        errors.TowerMismatchError, errors.AlreadyRewrittenError, errors.BackendError, errors.OutputError,
        errors.GraphValidationError, errors.PassError,
    )),
    (INTERNAL_ERROR, "", "unexpected internal error (a bnrewrite bug: please report it)"),
    (INTERRUPTED, "", "interrupted (Ctrl-C; 129 for SIGHUP, 143 for SIGTERM); nothing was written, or, if the message says so, every output was"),
]

MAIN_EPILOG = """\
commands:
  convert IN OUT   rewrite IN so batch norm is synchronized across its towers; write OUT
  inspect IN       show the towers, every batch-norm site and what convert would do
  diff A B         compare two models: op counts and per-layer changes

IN can be a GraphDef (.pb binary, .pbtxt text), a MetaGraphDef (.meta, from
tf.compat.v1.train.Saver / export_meta_graph) or a SavedModel directory; the format is
told from the content, and OUT is written in the same format unless --format says otherwise.

examples:
  bnrewrite inspect model.meta
  bnrewrite convert model.meta synced.meta --report report.json
  bnrewrite convert saved_model/ synced_model/ --tags train --verify
  bnrewrite diff model.pb synced.pb

exit codes:
{codes}

Run 'bnrewrite COMMAND --help' for a command's options.
"""

CHECK_EPILOG = """\
examples:
  # the backend you would get: NCCL on 2 or more GPUs, else local on 2 virtual CPUs
  bnrewrite check

  # the collective backend on 4 virtual CPU towers, as JSON
  bnrewrite check --backend collective --towers 4 --json

Each case (fused and unfused batch norm, NHWC and NCHW) trains a small conv+BN model on K
towers rewritten by bnrewrite, the same graph un-rewritten, and one device fed the whole
batch; it passes when the rewritten graph matches one device and the un-rewritten one does
not. Exit code 0 only when every case passes, 1 when one fails.
"""

CONVERT_EPILOG = """\
examples:
  # GraphDef in, GraphDef out (binary .pb or text .pbtxt, kept as it was)
  bnrewrite convert towers.pb synced.pb

  # a Saver's .meta: collections stay consistent, the original checkpoint still restores
  bnrewrite convert model.meta synced.meta --report report.json

  # a SavedModel: rewrite the [train] MetaGraph, copy variables/ and assets/, check it imports
  bnrewrite convert saved_model/ synced_model/ --tags train --verify

  # what would change, without writing anything; a picture of one layer; TensorBoard graphs
  bnrewrite convert towers.pb synced.pb --dry-run --dot layer.dot --tensorboard logs/

  # between-graph replication: this graph is worker 1 of 4
  bnrewrite convert worker.pb synced.pb --backend collective --workers 4 --task-index 1

Nothing is written unless every step succeeds: outputs are staged beside their targets and
moved into place together at the end (or, on any failure or interrupt, none of them). OUT,
--report, --dot and --tensorboard must not exist unless --force is given, and --force
replaces only what bnrewrite writes there (a file, a SavedModel, its own TensorBoard runs);
OUT may never be IN. convert never runs the graph; --verify only imports the result.
"""

INSPECT_EPILOG = """\
examples:
  bnrewrite inspect towers.pb
  bnrewrite inspect saved_model/ --tags train
  bnrewrite inspect model.meta --json > plan.json

inspect runs the rewrite in memory and prints what convert would do; it writes nothing.
Its exit code is the one convert would return (0 when convert would succeed).
"""

DIFF_EPILOG = """\
examples:
  bnrewrite diff towers.pb synced.pb
  bnrewrite diff saved_model/ synced_model/ --tags train
  bnrewrite diff model.meta synced.meta --json

diff compares op-type counts and lists, per batch-norm layer, the nodes bnrewrite added
(marked with its `_bnrewrite` attribute), replaced (same name, now marked) and removed.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _print_error(f"{message} (see '{self.prog} --help')")
        raise SystemExit(USAGE)


def _exit_code_table() -> str:
    return "\n".join(f"  {code:>3}  {name + ': ' if name else ''}{what}" for code, name, what in EXIT_CODES)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog=PROG,
        description="Synchronized batch norm for replicated multi-tower TensorFlow 1 graphs, as a graph rewrite.",
        epilog=MAIN_EPILOG.format(codes=_exit_code_table()),
        formatter_class=fmt,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    convert = sub.add_parser(
        "convert", help="rewrite IN and write OUT", epilog=CONVERT_EPILOG, formatter_class=fmt,
        description="Rewrite IN so that batch norm is synchronized across its towers, and write OUT.",
    )
    convert.add_argument("input", metavar="IN", help="GraphDef (.pb/.pbtxt), MetaGraphDef (.meta) or SavedModel directory")
    convert.add_argument("output", metavar="OUT", help="where to write the rewritten model (must not exist unless --force)")
    _rewrite_options(convert)
    out = convert.add_argument_group("output")
    out.add_argument("--format", choices=["pb", "pbtxt", "meta", "metatxt", "savedmodel"],
                     help="OUT's format (default: IN's); pb/pbtxt = GraphDef, meta/metatxt = MetaGraphDef")
    out.add_argument("--force", action="store_true",
                     help="replace OUT, --report, --dot, --tensorboard if they exist and hold what bnrewrite writes there")
    out.add_argument("--dry-run", action="store_true", help="do everything but write OUT (--report, --dot, --tensorboard are still written)")
    out.add_argument("--verify", action="store_true", help="import the result into TensorFlow (never run it) and fail if it does not import")
    out.add_argument("--report", metavar="FILE.json", help="write the report as JSON (schema: README.md, 'Report schema')")
    out.add_argument("--dot", metavar="FILE", help="write a picture of one rewritten layer before/after: .dot/.gv (Graphviz text), "
                     ".svg/.png (rendered by Graphviz's dot, else by the graphviz-pure dependency)")
    out.add_argument("--dot-layer", metavar="LAYER", help="the layer --dot draws (default: the first one)")
    out.add_argument("--tensorboard", metavar="LOGDIR", help="write the graphs before and after as TensorBoard runs LOGDIR/before and LOGDIR/after "
                     "(a new directory, or with --force one bnrewrite wrote)")
    _verbosity(convert)
    convert.set_defaults(func=cmd_convert)

    inspect = sub.add_parser(
        "inspect", help="show what convert would do", epilog=INSPECT_EPILOG, formatter_class=fmt,
        description="Show the towers found, every batch-norm site per tower, and what convert would do and why. Writes nothing.",
    )
    inspect.add_argument("input", metavar="IN", help="GraphDef (.pb/.pbtxt), MetaGraphDef (.meta) or SavedModel directory")
    _rewrite_options(inspect)
    inspect.add_argument("--json", action="store_true", help="print the JSON report instead of text")
    _verbosity(inspect)
    inspect.set_defaults(func=cmd_inspect)

    diff = sub.add_parser(
        "diff", help="compare two models", epilog=DIFF_EPILOG, formatter_class=fmt,
        description="Compare two models: op-type counts and per-layer nodes added, replaced and removed.",
    )
    diff.add_argument("a", metavar="A", help="the first model (e.g. the original)")
    diff.add_argument("b", metavar="B", help="the second model (e.g. the rewritten one)")
    diff.add_argument("--tags", action="append", metavar="T1,T2", help="SavedModels: compare only this tag set (repeatable)")
    diff.add_argument("--json", action="store_true", help="print the differences as JSON")
    _verbosity(diff)
    diff.set_defaults(func=cmd_diff)

    check = sub.add_parser(
        "check", help="check on this machine that synced training matches one device", epilog=CHECK_EPILOG,
        formatter_class=fmt,
        description="Train small multi-tower graphs rewritten by bnrewrite here and compare with one device.",
    )
    selfcheck.add_arguments(check)
    _verbosity(check)
    check.set_defaults(func=selfcheck.run)
    return parser


def _rewrite_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rewrite")
    group.add_argument("--backend", choices=["auto", "nccl", "local", "collective"], default="auto",
                       help="all-reduce: NcclAllReduce (GPU towers), local (one AddN, towers of one process) or "
                            "CollectiveReduceV2; auto picks NCCL when every tower is a GPU, else local unless "
                            "several workers or batch norms inside control flow v2 need collective")
    group.add_argument("--tower-by", choices=["auto", "device", "scope"], default="auto",
                       help="tell towers apart by device or by top-level name scope (default: device when sites span several)")
    group.add_argument("--group-size", type=_positive_int, metavar="G",
                       help="synchronize towers in consecutive groups of G (default: all towers together)")
    group.add_argument("--timeout", type=_non_negative_float, default=0.0, metavar="SECONDS",
                       help="collective all-reduce timeout, so a missing peer fails instead of hanging (0: none)")
    group.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                       help="between-graph replication: N identical workers (collective backend)")
    group.add_argument("--task-index", type=_non_negative_int, metavar="I",
                       help="this worker's index, 0..N-1 (required with --workers N > 1)")
    group.add_argument("--tags", action="append", metavar="T1,T2",
                       help="SavedModels: rewrite only the MetaGraph with exactly these tags (repeatable; default: all)")


def _verbosity(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    group.add_argument("-v", "--verbose", action="store_true",
                       help="more detail (passes, timings), TensorFlow's own logging, tracebacks of internal errors")


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number of seconds")
    return value


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = _replication_problem(args)
    if problem is not None:
        _print_error(f"{problem} (see '{PROG} {args.command} --help')")
        return USAGE
    if not args.verbose:
        _quiet_tensorflow()
    previous = _stop_on_signals()
    try:
        return int(args.func(args) or 0)
    except BnRewriteError as exc:
        message = cli_wording(str(exc))
        _print_error(message)
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
        _print_error(message)
        _json_failure(args, type(exc).__name__, message, 128 + signum)
        return 128 + signum
    except BrokenPipeError:
        _silence_stdout()
        return 0
    except Exception as exc:  # noqa: BLE001 - the last resort: one line, not a traceback
        if args.verbose:
            traceback.print_exc()
        message = (f"internal error: {type(exc).__name__}: {_one_line(str(exc))} "
                   "(a bnrewrite bug: please report it with the command you ran; -v shows the traceback)")
        _print_error(message)
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
    from bnrewrite.report import SCHEMA_VERSION

    document = {
        "schema_version": SCHEMA_VERSION, "bnrewrite_version": __version__, "command": "inspect",
        "input": {"path": args.input, "format": None}, "output": None,
        "options": {**_options(args), "tags": args.tags}, "graphs": [],
        "error": {"class": name, "exit_code": exit_code, "message": message},
    }
    try:
        print(json.dumps(document, indent=2))
    except BrokenPipeError:
        _silence_stdout()


#: The keyword arguments of rewrite_graph and check -> the options that set them.
_FLAGS = {
    "backend": "--backend", "tower_by": "--tower-by", "group_size": "--group-size",
    "timeout_seconds": "--timeout", "num_workers": "--workers", "task_index": "--task-index",
    "towers": "--towers", "steps": "--steps",  # bnrewrite.check's
}
_KEYWORD = re.compile(r"\b(" + "|".join(_FLAGS) + r")=\"?([\w.]*)\"?|\b(" + "|".join(k for k in _FLAGS if "_" in k) + r")\b")


def cli_wording(message: str) -> str:
    """An error message of the Python API in the command line's words: `backend="collective"`
    becomes `--backend collective`, `group_size` `--group-size`."""
    def flag(match: re.Match[str]) -> str:
        if match.group(3):
            return _FLAGS[match.group(3)]
        return f"{_FLAGS[match.group(1)]} {match.group(2)}"

    return _KEYWORD.sub(flag, message)


def _print_error(message: str) -> None:
    sys.stderr.write(f"{PROG}: error: {_one_line(message, 2000)}\n")
    sys.stderr.flush()


def _one_line(text: str, limit: int = 500) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _quiet_tensorflow() -> None:
    """Keep TensorFlow's native logging (written straight to file descriptor 2, also at import
    time) off the terminal: fd 2 goes to /dev/null and Python's sys.stderr to a copy of the
    real one, so bnrewrite's own messages still arrive."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import warnings

    warnings.filterwarnings("ignore")
    if "tensorflow" in sys.modules:  # imported in-process (tests): leave the process alone
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        sys.stderr = os.fdopen(saved, "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    except (OSError, ValueError, AttributeError):
        pass


class _SkipKeras:
    """A meta-path finder under which `import keras` / `import tf_keras` fail (their spec is
    still found). TensorFlow's own import tries to load Keras and carries on without it; the
    command line never uses Keras, and not loading it (and what it pulls in: scikit-learn,
    IPython, ... when installed) makes every command start about 1.5 s sooner.
    BNREWRITE_IMPORT_KERAS=1 turns this off."""

    NAMES = ("keras", "tf_keras")

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.NAMES:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = self
        return spec

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        raise ImportError(f"{module.__name__} is not loaded by the bnrewrite command line")


def _import_tensorflow() -> None:
    import logging

    skip = None
    if "tensorflow" not in sys.modules and not os.environ.get("BNREWRITE_IMPORT_KERAS"):
        skip = _SkipKeras()
        sys.meta_path.insert(0, skip)
    try:
        import tensorflow as tf  # noqa: F401 - the slow import, in one place
    finally:
        if skip is not None:
            sys.meta_path.remove(skip)
            for name in [m for m in sys.modules if m.split(".")[0] in _SkipKeras.NAMES]:
                del sys.modules[name]

    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # pragma: no cover
        pass


# ---------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "backend": args.backend, "tower_by": args.tower_by, "group_size": args.group_size,
        "timeout_seconds": args.timeout, "num_workers": args.workers,
        "task_index": args.task_index if args.task_index is not None else 0,
    }


def _replication_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with --workers/--task-index together: a worker must say which one it is."""
    workers, index = getattr(args, "workers", 1), getattr(args, "task_index", None)
    if workers > 1 and index is None:
        return f"--workers {workers} needs --task-index I, this worker's index (0..{workers - 1})"
    if index is not None and index >= workers:
        if workers == 1:
            return f"--task-index {index} needs --workers N, the number of workers (more than {index})"
        return f"--task-index {index} is not one of the {workers} workers (0..{workers - 1})"
    return None


def cmd_convert(args: argparse.Namespace) -> int:
    from bnrewrite import io

    out = _Printer(args)
    start = time.perf_counter()
    # Everything that needs no TensorFlow first, so that these mistakes fail fast.
    io.check_input(args.input)
    out_format = args.format or ("savedmodel" if os.path.isdir(args.input) else "file")
    io.check_output(args.output, [args.input], args.force, "OUT", io.SAVED_MODEL if out_format == "savedmodel" else io.FILE)
    extra = [(flag, path) for flag, path in (("--report", args.report), ("--dot", args.dot), ("--tensorboard", args.tensorboard)) if path]
    written = ([] if args.dry_run else [("OUT", args.output)]) + extra
    for k, (flag, path) in enumerate(written):
        if flag != "OUT":
            io.check_output(path, [args.input], args.force, flag, io.LOGDIR if flag == "--tensorboard" else io.FILE)
        for other_flag, other in written[:k]:
            if io.same_or_nested(path, other):
                raise OutputError(f"{flag} {path} overlaps {other_flag} {other}; write it somewhere else")
    if args.dot:
        from bnrewrite import visualize

        visualize.check_target(args.dot)
    tag_sets = io.parse_tags(args.tags)

    _import_tensorflow()
    model = io.load(args.input)
    out.verbose(f"loaded {args.input}: {model.description}, {_entries_summary(model)} ({time.perf_counter() - start:.1f}s)")
    chosen = io.select(model, tag_sets)
    io.output_entries(model, args.format or model.format, chosen)
    rewrite = io.rewrite(model, tag_sets, **_options(args))
    result = io.as_format(rewrite.model, args.format or model.format, chosen)
    verified = 0
    if args.verify:
        verified = io.verify(rewrite)

    notes: list[str] = []
    args.outputs = io.Outputs(force=args.force)  # main() tells from it whether an interrupt came after the commit
    with args.outputs as outputs:
        if not args.dry_run:
            notes += io.stage_model(outputs, result, args.output)
        if args.report:
            document = _document("convert", args, model, rewrite, result, written=not args.dry_run, verified=bool(args.verify))
            outputs.stage_bytes(args.report, (json.dumps(document, indent=2) + "\n").encode(), "--report")
        if args.dot:
            from bnrewrite import visualize

            dot = visualize.stage(outputs, args.dot, rewrite, args.dot_layer)
            notes.append(dot)
        if args.tensorboard:
            from bnrewrite import visualize

            visualize.stage_tensorboard(outputs, args.tensorboard, rewrite)
        notes += outputs.commit()

    for outcome in rewrite.outcomes:
        _print_outcome(out, outcome, multiple=model.is_saved_model)
    _print_unselected(out, model, chosen)
    for note in notes:
        if note:
            out.line(f"note: {note}")
    if args.verify:
        out.line(f"verified: {verified} rewritten graph(s) import into TensorFlow")
    if args.dry_run:
        out.line(f"dry run: nothing written to {args.output} (would write a {result.description})")
    else:
        out.line(f"wrote {args.output} ({result.description}{_saved_model_extra(result)})")
    for flag, path in extra:
        out.line(f"wrote {path} ({flag})")
    out.verbose(f"done in {time.perf_counter() - start:.1f}s")
    return 0


def _saved_model_extra(model: Any) -> str:
    if not model.is_saved_model:
        return ""
    return f", {len(model.entries)} MetaGraph(s), variables and assets copied unchanged"


def _entries_summary(model: Any) -> str:
    if model.is_saved_model:
        return ", ".join(f"MetaGraph {e.label} {len(e.graph_def.node)} nodes" for e in model.entries)
    return f"{len(model.entries[0].graph_def.node)} nodes"


def _print_outcome(out: _Printer, outcome: Any, multiple: bool) -> None:
    head = f"MetaGraph {outcome.entry.label}: " if multiple else ""
    if outcome.report is None:
        out.line(f"{head}kept unchanged: {outcome.kept}")
        out.line("")
        return
    if head:
        out.line(head.rstrip(": ") + ":")
    out.block(report_text(outcome.report, out.is_verbose))
    if out.is_verbose and outcome.report.passes:
        out.line("passes:")
        for p in outcome.report.passes:
            out.line(f"  {p['name']}: +{p['added']} nodes, {p['replaced']} replaced, {p['removed']} removed, "
                     f"{p['control_edges']} control edges, {p['seconds']}s")
    out.line("")


def _print_unselected(out: _Printer, model: Any, chosen: list[Any]) -> None:
    if not model.is_saved_model:
        return
    picked = {e.index for e in chosen}
    for entry in model.entries:
        if entry.index not in picked:
            out.line(f"MetaGraph {entry.label}: not selected by --tags, copied unchanged")


def _document(command: str, args: argparse.Namespace, model: Any, rewrite: Any, result: Any = None,
              written: bool = False, verified: bool = False) -> dict[str, Any]:
    """The JSON report (README.md, 'Report schema')."""
    from bnrewrite.report import SCHEMA_VERSION

    graphs = []
    reported = {o.entry.index: o for o in rewrite.outcomes}
    for entry in model.entries:
        outcome = reported.get(entry.index)
        status = "unselected" if outcome is None else "rewritten" if outcome.report else "kept"
        if outcome is not None and outcome.report is not None and outcome.report.already_rewritten:
            status = "already_rewritten"
        graphs.append({
            "tags": list(entry.tags) if entry.tags is not None else None,
            "status": status,
            "reason": str(outcome.kept) if outcome is not None and outcome.kept is not None else None,
            "report": outcome.report.to_dict() if outcome is not None and outcome.report is not None else None,
        })
    document: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "bnrewrite_version": __version__,
        "command": command,
        "input": {"path": args.input, "format": model.format},
        "output": None,
        "options": {**_options(args), "tags": args.tags},
        "graphs": graphs,
    }
    if command == "convert":
        document["output"] = {"path": args.output, "format": result.format, "written": written}
        document["verified"] = verified
    return document


def report_text(report: Any, verbose: bool = False) -> str:
    """The report's text: every op removed if verbose, else a count after the first few."""
    return report.text(verbose, more="-v lists them")


class _Printer:
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


# ---------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    from bnrewrite import io

    out = _Printer(args)
    io.check_input(args.input)
    tag_sets = io.parse_tags(args.tags)
    _import_tensorflow()
    model = io.load(args.input)
    chosen = io.select(model, tag_sets)
    if not args.json:
        out.line(f"{args.input}: {model.description}, {_entries_summary(model)}")
        out.line("")
    failure: BnRewriteError | None = None
    outcomes = []
    for entry in chosen:
        head = f"MetaGraph {entry.label}: " if model.is_saved_model else ""
        skips = _print_census(out, entry, head) if not args.json else []
        idle_ok = model.is_saved_model and tag_sets is None
        try:
            single = io.Model(model.path, model.format, [entry], model.saved_model, model.graph_file)
            outcome = io.rewrite(single, None, keep_idle=idle_ok, if_rewritten="keep", **_options(args)).outcomes[0]
        except BnRewriteError as exc:
            failure = failure or exc
            if not args.json:
                _print_unsupported(out, skips)
                out.line(f"{head}convert would fail: {_one_line(cli_wording(str(exc)), 2000)}")
                out.line("")
            continue
        outcomes.append(outcome)
        if outcome.report is not None and outcome.report.already_rewritten:
            failure = failure or errors.AlreadyRewrittenError(
                f"{head}{args.input} was already rewritten by bnrewrite; convert would refuse it: rewrite the original graph instead")
        if not args.json:
            if outcome.report is None:
                _print_unsupported(out, skips)
            _print_plan(out, outcome, head)
    if failure is None:
        failure = io.nothing_rewritten(model, outcomes)
    if args.json:
        document = _document("inspect", args, model, io.Rewrite(model, outcomes))
        if failure is not None:
            document["error"] = {"class": type(failure).__name__, "exit_code": failure.exit_code,
                                 "message": cli_wording(str(failure))}
        print(json.dumps(document, indent=2))
        args.json_printed = True
    elif failure is None:
        out.line("convert would succeed")
    if failure is not None:
        raise failure
    return 0


def _print_census(out: _Printer, entry: Any, head: str) -> list[Any]:
    """Print how many batch-norm ops of each kind the rewrite finds; returns those it skips
    (the report lists them when there is one)."""
    from bnrewrite.api import take_census
    from bnrewrite.graph import Graph

    _, _, census = take_census(Graph.from_graph_def(entry.graph_def))
    out.line(f"{head}batch-norm ops: {len(census.sites)} in training mode, {len(census.inference)} in inference mode"
             + (f", {len(census.skips)} unsupported" if census.skips else "")
             + (f", {len(census.rewritten)} nodes already rewritten by bnrewrite" if census.rewritten else ""))
    if out.is_verbose:
        for site in census.sites:
            out.line(f"  {site.name} ({site.op}, {site.data_format}, on {site.device or '(no device)'}, {len(site.grads)} gradient op(s))")
        for name in census.inference:
            out.line(f"  {name} (inference mode)")
    return census.skips


def _print_unsupported(out: _Printer, skips: list[Any]) -> None:
    for skip in skips:
        out.line(f"  unsupported: {skip.node}: {skip.reason}")


def _print_plan(out: _Printer, outcome: Any, head: str) -> None:
    report = outcome.report
    if report is None:
        out.line(f"{head}nothing to do, kept unchanged: {outcome.kept}")
        out.line("")
        return
    if report.already_rewritten:
        out.line(f"{head}already rewritten by bnrewrite ({'; '.join(report.notes)}); convert would refuse it")
        out.line("")
        return
    towers = report.towers
    from bnrewrite.match.towers import shown_tower

    out.line(f"{head}towers ({report.tower_by}): {', '.join(map(shown_tower, towers))}")
    out.line(f"layout: {report.layout}")
    if len(report.sync_groups) > 1:
        out.line("sync groups: " + "; ".join("[" + ", ".join(g) + "]" for g in report.sync_groups))
    out.line("batch-norm sites per tower:")
    for k, tower in enumerate(towers):
        out.line(f"  {shown_tower(tower)}:")
        for row in report.layers:
            per = len(row.gradients) // max(len(row.towers), 1)
            grads = row.gradients[k * per:(k + 1) * per]
            site = row.sites[k] if k < len(row.sites) else "?"
            paired = "" if row.lined_up_by == "shared variables" else f"  [lined up by {row.lined_up_by}]"
            out.line(f"    {row.layer}: {site}" + (f"  (gradient: {', '.join(grads)})" if grads else "  (no gradient op)") + paired)
    out.line("")
    out.line("convert would:")
    for row in report.layers:
        per = len(row.gradients) // max(len(row.towers), 1)
        out.line(f"  {row.layer}: replace {len(row.sites)} {row.op} op(s) and {len(row.gradients)} gradient op(s) "
                 f"with global-batch versions joined by {row.collectives} all-reduce(s) ({report.backend}; per tower "
                 f"1 forward{f', {per} backward' if per else ''})")
    if report.removed:
        kept = [u for row in report.layers for u in row.updates_kept]
        out.line(f"  remove {len(report.removed)} op(s): duplicate moving-average updates and what only fed them "
                 f"(one update per statistic is kept: {', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''})")
        for removed in report.removed if out.is_verbose else ():
            out.line(f"    {removed['node']}: {removed['why']}")
    for line in report.closing_lines():
        out.line(line)
    out.line("")


# ---------------------------------------------------------------------------
# diff
# ---------------------------------------------------------------------------


def cmd_diff(args: argparse.Namespace) -> int:
    from bnrewrite import io
    from bnrewrite.visualize import diff_entries

    out = _Printer(args)
    io.check_input(args.a)
    io.check_input(args.b)
    tag_sets = io.parse_tags(args.tags)
    _import_tensorflow()
    a, b = io.load(args.a), io.load(args.b)
    pairs = _pair_entries(io, a, b, tag_sets, args)
    results = []
    for label, ea, eb in pairs:
        d = diff_entries(ea.graph_def, eb.graph_def)
        d["tags"] = list(ea.tags) if ea.tags is not None else None
        results.append((label, d))
    if args.json:
        print(json.dumps({"a": {"path": args.a, "format": a.format}, "b": {"path": args.b, "format": b.format},
                          "graphs": [d for _, d in results]}, indent=2))
        return 0
    out.line(f"A: {args.a} ({a.description}, {_entries_summary(a)})")
    out.line(f"B: {args.b} ({b.description}, {_entries_summary(b)})")
    for label, d in results:
        out.line("")
        if label:
            out.line(f"MetaGraph {label}:")
        _print_diff(out, d)
    return 0


def _pair_entries(io: Any, a: Any, b: Any, tag_sets: Any, args: argparse.Namespace) -> list[tuple[str, Any, Any]]:
    if a.is_saved_model and b.is_saved_model:
        chosen = io.select(a, tag_sets)
        pairs = []
        for ea in chosen:
            eb = [e for e in b.entries if set(e.tags or ()) == set(ea.tags or ())]
            if not eb:
                raise errors.InputFormatError(f"{args.b} has no MetaGraph tagged {ea.label}, which {args.a} has; pick common tags with --tags")
            pairs.append((ea.label, ea, eb[0]))
        return pairs
    ea = io.select(a, tag_sets) if a.is_saved_model else a.entries
    eb = io.select(b, tag_sets) if b.is_saved_model else b.entries
    if len(ea) != 1 or len(eb) != 1:
        which = args.a if len(ea) != 1 else args.b
        raise BnRewriteError(f"{which} has several MetaGraphs; pick one with --tags to compare it with a single graph")
    return [("", ea[0], eb[0])]


def _print_diff(out: _Printer, d: dict[str, Any]) -> None:
    out.line(f"nodes: {d['nodes_a']} -> {d['nodes_b']} ({d['nodes_b'] - d['nodes_a']:+d}): "
             f"{len(d['added'])} added, {len(d['removed'])} removed, {len(d['changed'])} changed")
    if d["op_counts"]:
        out.line("op counts that differ:")
        width = max(len(op) for op in d["op_counts"])
        for op, (ca, cb) in d["op_counts"].items():
            out.line(f"  {op.ljust(width)}  {ca:>5} -> {cb:<5} ({cb - ca:+d})")
    else:
        out.line("op counts: identical")
    if d["layers"]:
        out.line("per layer (nodes marked _bnrewrite):")
        for layer, row in d["layers"].items():
            out.line(f"  {layer}: {row['added']} added, {row['replaced']} replaced "
                     f"({', '.join(f'{k} x{v}' for k, v in row['replaced_ops'].items()) or '-'}), "
                     f"{row['removed']} removed, all-reduces: {row['collectives']}")
    other = d["unattributed"]
    if any(other.values()):
        out.line(f"  (not in a layer): {other['added']} added, {other['removed']} removed, {other['changed']} changed")
    if out.is_verbose:
        for key in ("added", "removed", "changed"):
            for name in d[key]:
                out.line(f"  {key}: {name}")
