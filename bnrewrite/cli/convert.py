"""`bnrewrite convert IN OUT`: check every path before TensorFlow is imported, rewrite, and
stage OUT, --report, --dot and --tensorboard so they are committed together or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from bnrewrite.cli.document import json_report, rewrite_keywords
from bnrewrite.cli.output import Printer, entries_summary, print_note, report_text
from bnrewrite.cli.tf import import_tensorflow
from bnrewrite.errors import OutputError


def cmd_convert(args: argparse.Namespace) -> int:
    from bnrewrite import io

    out = Printer(args)
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
        from bnrewrite.io import visualize

        visualize.check_target(args.dot)
    for flag, path in written:  # what a killed run left beside them: refused, or removed when scratch
        for note in io.clear_leftovers(path, flag):
            print_note(note)
    tag_sets = io.parse_tags(args.tags)

    import_tensorflow()
    model = io.load(args.input)
    out.verbose(f"loaded {args.input}: {model.description}, {entries_summary(model)} ({time.perf_counter() - start:.1f}s)")
    chosen = io.select(model, tag_sets)
    io.output_entries(model, args.format or model.format, chosen)
    rewrite = io.rewrite(model, tag_sets, **rewrite_keywords(args))
    result = io.as_format(rewrite.model, args.format or model.format, chosen)
    verified = 0
    if args.verify:
        verified = io.verify(rewrite)

    notes: list[str] = [_gpus_missing(rewrite)]
    args.outputs = io.Outputs(force=args.force)  # main() tells from it whether an interrupt came after the commit
    with args.outputs as outputs:
        if not args.dry_run:
            notes += io.stage_model(outputs, result, args.output)
        if args.report:
            document = json_report("convert", args, model, rewrite, result, written=not args.dry_run, verified=bool(args.verify))
            outputs.stage_bytes(args.report, (json.dumps(document, indent=2) + "\n").encode(), "--report")
        if args.dot:
            from bnrewrite.io import visualize

            dot = visualize.stage(outputs, args.dot, rewrite, args.dot_layer)
            notes.append(dot)
        if args.tensorboard:
            from bnrewrite.io import visualize

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


def _gpus_missing(rewrite: Any) -> str:
    """A note when the output all-reduces by NCCL on GPUs this machine does not have: it cannot
    run here, and backend local writes one that can; else ""."""
    from bnrewrite.graph.index import Device
    from bnrewrite.session.live import visible_gpus

    indices = sorted({Device.parse(node.device).index for outcome in rewrite.outcomes if outcome.result is not None
                      for node in outcome.result.graph_def.node if node.op == "NcclAllReduce"})
    have = visible_gpus()
    if not indices or indices[-1] < have:
        return ""
    return (f"the output all-reduces by NCCL on /device:GPU:{indices[0]}..{indices[-1]}, which this machine does not "
            f"have ({have} GPU(s)): it runs only where those GPUs are; --backend local writes one that runs here too "
            "(soft placement puts the towers on the CPU, where collective would need a device per tower)")


def _saved_model_extra(model: Any) -> str:
    if not model.is_saved_model:
        return ""
    return f", {len(model.entries)} MetaGraph(s), variables and assets copied unchanged"


def _print_outcome(out: Printer, outcome: Any, multiple: bool) -> None:
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


def _print_unselected(out: Printer, model: Any, chosen: list[Any]) -> None:
    if not model.is_saved_model:
        return
    picked = {e.index for e in chosen}
    for entry in model.entries:
        if entry.index not in picked:
            out.line(f"MetaGraph {entry.label}: not selected by --tags, copied unchanged")
