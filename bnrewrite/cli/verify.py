"""`bnrewrite verify MODEL`: rewrite the original model in memory, run one checked training step
on this machine's CPU and say whether every synced layer normalized with the global batch's
statistics and updated its moving statistics once (bnrewrite.session.stepcheck).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bnrewrite.cli.document import json_report
from bnrewrite.cli.output import Printer, print_note
from bnrewrite.cli.tf import import_tensorflow
from bnrewrite.errors import BackendError, BnRewriteError

#: How long a collective all-reduce (towers inside control flow v2) may wait for its peers.
COLLECTIVE_TIMEOUT = 60.0


def cmd_verify(args: argparse.Namespace) -> int:
    from bnrewrite import io
    from bnrewrite.io.step import run_step

    out = Printer(args)
    start = time.perf_counter()
    io.check_input(args.input)
    if args.report:
        io.check_output(args.report, [args.input], args.force, "--report", io.FILE)
        for note in io.clear_leftovers(args.report, "--report"):
            print_note(note)
    tag_sets = io.parse_tags(args.tags)

    import_tensorflow()
    model = io.load(args.input)
    keywords = {"tower_by": args.tower_by, "group_size": args.group_size}
    try:
        rewrite = io.rewrite(model, tag_sets, backend="local", **keywords)
    except BackendError:  # layers inside control flow v2 branches: the collective runtime reaches them
        rewrite = io.rewrite(model, tag_sets, backend="collective", timeout_seconds=COLLECTIVE_TIMEOUT, **keywords)
        args.backend, args.timeout = "collective", COLLECTIVE_TIMEOUT  # as --report's options record them
    checkpoint = args.checkpoint
    saved_variables = os.path.join(args.input, "variables", "variables")
    if checkpoint is None and model.is_saved_model and os.path.exists(saved_variables + ".index"):
        checkpoint = saved_variables
    verdicts = {}
    for outcome in rewrite.outcomes:
        where = f"MetaGraph {outcome.entry.label}" if model.is_saved_model else ""
        if outcome.report is None or outcome.result is None:
            out.line(f"{where + ': ' if where else ''}not verified: {outcome.kept}")
            continue
        verdict = run_step(outcome.result, outcome.report, checkpoint, args.batch, args.step)
        if not verdict.layers:
            raise BnRewriteError(f"{where + ': ' if where else ''}no synced layer can be checked: all "
                                 f"{len(verdict.not_checked)} are inside function bodies (control flow v2), whose "
                                 "tensors cannot be fetched; build the graph with tf.compat.v1.disable_control_flow_v2()")
        verdicts[outcome.entry.index] = verdict
        out.line(verdict.line(where))
        for layer in verdict.layers:
            out.verbose(f"  {layer.line()}")
    if args.report:
        document = json_report("verify", args, model, rewrite)
        for graph, entry in zip(document["graphs"], model.entries):
            verdict = verdicts.get(entry.index)
            graph["verification"] = verdict.to_dict() if verdict is not None else None
        with io.Outputs(force=args.force) as outputs:
            outputs.stage_bytes(args.report, (json.dumps(document, indent=2) + "\n").encode(), "--report")
            outputs.commit()
        out.line(f"wrote {args.report} (--report)")
    out.verbose(f"done in {time.perf_counter() - start:.1f}s")
    return 0
