"""The argument parser: commands, options, argument types, --help epilogs and the exit-code
table (EXIT_CODES). A usage error is one line on stderr and exit code 2. Each command's
subparser points at its cmd_* function in the module of that name.
"""

from __future__ import annotations

import argparse
from typing import Any

from bnrewrite import __version__, errors
from bnrewrite.cli.convert import cmd_convert
from bnrewrite.cli.diff import cmd_diff
from bnrewrite.cli.inspect import cmd_inspect
from bnrewrite.cli.output import INTERNAL_ERROR, INTERRUPTED, PROG, USAGE, print_error
from bnrewrite.cli.run import cmd_run
from bnrewrite.cli.verify import cmd_verify
from bnrewrite.rewrite import selfcheck
from bnrewrite.rewrite.arguments import BACKENDS
from bnrewrite.session.bounds import DEFAULT_SECONDS, START_SECONDS

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
  run SCRIPT ARGS  run a training script unmodified, its sessions on the synchronized graph
  verify MODEL     rewrite MODEL in memory and prove on one step run here that it syncs

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

RUN_EPILOG = """\
examples:
  bnrewrite run train.py --num_gpus 4
  bnrewrite run --backend local --report run.json train.py --num_gpus 4
  bnrewrite run --verify train.py --num_gpus 4
  bnrewrite run -m trainer.main --config cfg.yaml

SCRIPT (a file, a directory or zip file with __main__.py, or - for stdin) runs exactly as
`python SCRIPT ARGS` would (argv, __main__, sys.path[0], its exit code, tracebacks, Ctrl-C as
130); everything after SCRIPT is the script's. Each session it creates (tf.compat.v1.Session,
InteractiveSession, Supervisor, MonitoredTrainingSession, tf_slim.learning.train, ...) on a
graph with multi-tower training batch norm runs the synchronized graph; the script's graph,
handles, savers and checkpoints stay as they were. Graphs with nothing to synchronize
(inference, one tower, already rewritten) run unchanged with a note; a graph bnrewrite refuses
stops the script before its first step with the error's exit code, unless --allow-unsynced.
--report follows the rule of convert's outputs: checked before the script starts (exit 10),
written atomically when it ends, also on SIGTERM and SIGHUP.
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

VERIFY_EPILOG = """\
examples:
  bnrewrite verify model.meta
  bnrewrite verify model.meta --checkpoint ckpt/model-1000 -v
  bnrewrite verify towers.pb --batch 8 --report verified.json
  bnrewrite verify saved_model/ --tags train

MODEL is your ORIGINAL model (not one convert wrote): verify rewrites it in memory as convert
would (--tower-by, --group-size, --tags), with the all-reduces as one local sum, maps every
tower's device to the CPU of its index, and runs one training step on virtual CPUs, fed
synthetic inputs (placeholders, and queue or iterator outputs directly; give --batch for an
unknown batch dimension) with the variables' initial values, --checkpoint's, or a SavedModel's
own. Extra ops compute, per layer and tower, float64 sums of the layer's input and the largest
error of its output; it then checks that the rewrite's global mean and variance are those of
all towers' inputs together, that every tower's output is gamma * (x - mean) / sqrt(var + eps)
+ beta with them, and that each moving statistic moved once toward the global one. A failure
exits with 12 (PassError) naming the layer, the tower and the figure; a model verify cannot
feed or initialize, with 1.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print_error(f"{message} (see '{self.prog} --help')")
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
    _allow_unsynced(convert)
    out = convert.add_argument_group("output")
    out.add_argument("--format", choices=["pb", "pbtxt", "meta", "metatxt", "savedmodel"],
                     help="OUT's format (default: IN's); pb/pbtxt = GraphDef, meta/metatxt = MetaGraphDef")
    out.add_argument("--force", action="store_true",
                     help="replace OUT, --report, --dot, --tensorboard if they exist and hold what bnrewrite writes there")
    out.add_argument("--dry-run", action="store_true", help="do everything but write OUT (--report, --dot, --tensorboard are still written)")
    out.add_argument("--verify", action="store_true", help="import the result into TensorFlow (never run it) and fail if it does not import")
    out.add_argument("--report", type=_path, metavar="FILE.json", help="write the report as JSON (schema: README.md, 'Report schema')")
    out.add_argument("--dot", type=_path, metavar="FILE", help="write a picture of one rewritten layer before/after: .dot/.gv (Graphviz text), "
                     ".svg/.png (rendered by Graphviz's dot, else by the graphviz-pure dependency)")
    out.add_argument("--dot-layer", metavar="LAYER", help="the layer --dot draws (default: the first one)")
    out.add_argument("--tensorboard", type=_path, metavar="LOGDIR", help="write the graphs before and after as TensorBoard runs LOGDIR/before and LOGDIR/after "
                     "(a new directory, or with --force one bnrewrite wrote)")
    _verbosity(convert)
    convert.set_defaults(func=cmd_convert)

    inspect = sub.add_parser(
        "inspect", help="show what convert would do", epilog=INSPECT_EPILOG, formatter_class=fmt,
        description="Show the towers found, every batch-norm site per tower, and what convert would do and why. Writes nothing.",
    )
    inspect.add_argument("input", metavar="IN", help="GraphDef (.pb/.pbtxt), MetaGraphDef (.meta) or SavedModel directory")
    _rewrite_options(inspect)
    _allow_unsynced(inspect)
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

    run = sub.add_parser(
        "run", help="run a training script with synchronized batch norm", epilog=RUN_EPILOG, formatter_class=fmt,
        usage=f"{PROG} run [OPTIONS] SCRIPT [ARGS...] | {PROG} run [OPTIONS] -m MODULE [ARGS...]",
        description="Run SCRIPT (or -m MODULE) as python would; its sessions run the synchronized graph.",
    )
    run.add_argument("-m", dest="module", metavar="MODULE", help="run library module MODULE as a script (python -m)")
    _rewrite_options(run, tags=False)
    run.add_argument("--start-timeout", type=_positive_float, default=START_SECONDS, metavar="SECONDS",
                     help="with --workers N > 1: how long the first step that runs an all-reduce waits for the other "
                          f"workers to start (default {START_SECONDS:g}, as MonitoredTrainingSession waits)")
    run.add_argument("--allow-unsynced", action="store_true",
                     help="run a graph bnrewrite refuses with a warning instead of stopping the script: synchronized but for "
                          "the layers that cannot be, or as it is")
    run.add_argument("--verify", action="store_true",
                     help="check the first step of each synchronized graph layer by layer (global moments, every tower's "
                          "output, moving statistics updated once); a failure stops the script with exit 12")
    run.add_argument("--report", type=_path, metavar="FILE.json", help="write every graph's outcome and report to FILE.json when the script ends (also on SIGTERM, SIGHUP)")
    run.add_argument("--force", action="store_true", help="replace --report's file if it exists and is a regular file")
    _verbosity(run)
    run.set_defaults(func=cmd_run, script_argv=[])
    verify = sub.add_parser(
        "verify", help="prove on one step run here that the rewrite syncs MODEL", epilog=VERIFY_EPILOG,
        formatter_class=fmt,
        description="Rewrite MODEL (the original) in memory, run one checked training step on CPU, and verify every synced layer.",
    )
    verify.add_argument("input", metavar="MODEL", help="the original GraphDef (.pb/.pbtxt), MetaGraphDef (.meta) or SavedModel directory")
    group = verify.add_argument_group("rewrite")
    group.add_argument("--tower-by", choices=["auto", "device", "scope"], default="auto",
                       help="tell towers apart by device or by top-level name scope (as convert)")
    group.add_argument("--group-size", type=_positive_int, metavar="G", help="synchronize towers in groups of G (as convert)")
    group.add_argument("--tags", action="append", metavar="T1,T2", help="SavedModels: verify only this tag set (repeatable)")
    step = verify.add_argument_group("step")
    step.add_argument("--checkpoint", metavar="PREFIX", help="variables from this checkpoint (default: initializers; a SavedModel's own)")
    step.add_argument("--batch", type=_positive_int, metavar="B", help="size of an unknown batch dimension of the inputs")
    step.add_argument("--step", action="append", metavar="OP",
                      help="the op(s) one training step runs (default: what runs the moving-average updates and gradients)")
    step.add_argument("--report", type=_path, metavar="FILE.json", help="write the rewrite's report and every figure as JSON")
    step.add_argument("--force", action="store_true", help="replace --report if it exists and is a file bnrewrite wrote")
    _verbosity(verify)
    verify.set_defaults(func=cmd_verify, backend="local", timeout=0.0, workers=1, task_index=None)

    check = sub.add_parser(
        "check", help="check on this machine that synced training matches one device", epilog=CHECK_EPILOG,
        formatter_class=fmt,
        description="Train small multi-tower graphs rewritten by bnrewrite here and compare with one device.",
    )
    selfcheck.add_arguments(check)
    _verbosity(check)
    check.set_defaults(func=selfcheck.run)
    return parser


def _rewrite_options(parser: argparse.ArgumentParser, tags: bool = True) -> None:
    group = parser.add_argument_group("rewrite")
    group.add_argument("--backend", choices=list(BACKENDS), default="auto",
                       help="all-reduce: NcclAllReduce (GPU towers), local (one AddN, towers of one process), "
                            "CollectiveReduceV2, or ps (queues on the parameter server of a ps cluster); auto picks "
                            "NCCL when every tower is a GPU, else local unless several workers (ps when their graph "
                            "uses a parameter server) or batch norms inside control flow v2 need collective")
    group.add_argument("--tower-by", choices=["auto", "device", "scope"], default="auto",
                       help="tell towers apart by device or by top-level name scope (default: device when sites span several)")
    group.add_argument("--group-size", type=_positive_int, metavar="G",
                       help="synchronize towers in consecutive groups of G (default: all towers together)")
    group.add_argument("--timeout", type=_non_negative_float, default=0.0, metavar="SECONDS",
                       help="collective all-reduce timeout, so a missing peer fails instead of hanging (0: none); "
                            f"under run: every step's that runs an all-reduce (0: {DEFAULT_SECONDS:g})")
    group.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                       help="between-graph replication: N identical workers (collective backend)")
    group.add_argument("--task-index", type=_non_negative_int, metavar="I",
                       help="this worker's index, 0..N-1 (required with --workers N > 1)")
    if tags:
        group.add_argument("--tags", action="append", metavar="T1,T2",
                           help="SavedModels: rewrite only the MetaGraph with exactly these tags (repeatable; default: all)")


def _allow_unsynced(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-unsynced", action="store_true",
                        help="synchronize the layers that can be and leave the others as they are, instead of refusing "
                             "the graph (exit 7) when a training batch-norm layer cannot be synchronized")


def _verbosity(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    group.add_argument("-v", "--verbose", action="store_true",
                       help="more detail (passes, timings), TensorFlow's own logging, tracebacks of internal errors")


def _path(text: str) -> str:
    """An output path; an empty one (an unset shell variable) is a mistake, not "no output"."""
    if not text:
        raise argparse.ArgumentTypeError("'' is an empty path (an unset variable?)")
    return text


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _parsed(text: str, kind: type, what: str) -> Any:
    """`text` as an int or float, or the argparse error saying it is not `what`."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def _non_negative_int(text: str) -> int:
    value = _parsed(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _non_negative_float(text: str) -> float:
    value = _parsed(text, float, "a number")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number of seconds")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def replication_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with --workers/--task-index together: a worker must say which one it is."""
    workers, index = getattr(args, "workers", 1), getattr(args, "task_index", None)
    if workers > 1 and index is None:
        return f"--workers {workers} needs --task-index I, this worker's index (0..{workers - 1})"
    if index is not None and index >= workers:
        if workers == 1:
            return f"--task-index {index} needs --workers N, the number of workers (more than {index})"
        return f"--task-index {index} is not one of the {workers} workers (0..{workers - 1})"
    return None
