"""`bnrewrite inspect IN`: the towers, every batch-norm site per tower and what convert would
do, from a rewrite run in memory; writes nothing and exits with the code convert would.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from bnrewrite import errors
from bnrewrite.cli.document import json_report, rewrite_keywords
from bnrewrite.cli.output import Printer, cli_wording, entries_summary, one_line
from bnrewrite.cli.tf import import_tensorflow
from bnrewrite.errors import BnRewriteError


def cmd_inspect(args: argparse.Namespace) -> int:
    from bnrewrite import io

    out = Printer(args)
    io.check_input(args.input)
    tag_sets = io.parse_tags(args.tags)
    import_tensorflow()
    model = io.load(args.input)
    chosen = io.select(model, tag_sets)
    if not args.json:
        out.line(f"{args.input}: {model.description}, {entries_summary(model)}")
        out.line("")
    failure: BnRewriteError | None = None
    outcomes = []
    for entry in chosen:
        head = f"MetaGraph {entry.label}: " if model.is_saved_model else ""
        skips = _print_census(out, entry, head) if not args.json else []
        idle_ok = model.is_saved_model and tag_sets is None
        try:
            single = io.Model(model.path, model.format, [entry], model.saved_model, model.graph_file)
            outcome = io.rewrite(single, None, keep_idle=idle_ok, if_rewritten="keep", **rewrite_keywords(args)).outcomes[0]
        except BnRewriteError as exc:
            failure = failure or exc
            if not args.json:
                _print_unsupported(out, skips)
                out.line(f"{head}convert would fail: {one_line(cli_wording(str(exc)), 2000)}")
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
        document = json_report("inspect", args, model, io.Rewrite(model, outcomes))
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


def _print_census(out: Printer, entry: Any, head: str) -> list[Any]:
    """Print how many batch-norm ops of each kind the rewrite finds; returns those it skips
    (the report lists them when there is one)."""
    from bnrewrite.graph.index import Graph
    from bnrewrite.rewrite.api import take_census

    _, _, census = take_census(Graph.from_graph_def(entry.graph_def))
    out.line(f"{head}batch-norm ops: {len(census.sites)} in training mode, {len(census.inference)} in inference mode"
             + (f", {len(census.skips)} unsupported" if census.skips else "")
             + (f", {len(census.not_run)} that no training step runs" if census.not_run else "")
             + (f", {len(census.rewritten)} nodes already rewritten by bnrewrite" if census.rewritten else ""))
    if out.is_verbose:
        for site in census.sites:
            out.line(f"  {site.name} ({site.op}, {site.data_format}, on {site.device or '(no device)'}, {len(site.grads)} gradient op(s))")
        for skip in census.not_run:
            out.line(f"  {skip.node} (no training step runs it: not a tower)")
        for name in census.inference:
            out.line(f"  {name} (inference mode)")
    return census.skips


def _print_unsupported(out: Printer, skips: list[Any]) -> None:
    for skip in skips:
        out.line(f"  unsupported: {skip.node}: {skip.reason}")


def _print_plan(out: Printer, outcome: Any, head: str) -> None:
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
