"""The JSON report of convert --report and inspect --json (README.md, 'Report schema'), and the
rewrite options it records, as the keyword arguments of rewrite_graph.
"""

from __future__ import annotations

import argparse
from typing import Any

from bnrewrite import __version__


def rewrite_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of rewrite_graph that the rewrite options set."""
    return {
        "backend": args.backend, "tower_by": args.tower_by, "group_size": args.group_size,
        "timeout_seconds": args.timeout, "num_workers": args.workers,
        "task_index": args.task_index if args.task_index is not None else 0,
        "allow_unsynced": getattr(args, "allow_unsynced", False),  # verify has no such option
    }


def json_report(command: str, args: argparse.Namespace, model: Any, rewrite: Any, result: Any = None,
                written: bool = False, verified: bool = False) -> dict[str, Any]:
    """The JSON report (README.md, 'Report schema')."""
    from bnrewrite.rewrite.report import SCHEMA_VERSION

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
        "options": {**rewrite_keywords(args), "tags": args.tags},
        "graphs": graphs,
    }
    if command == "convert":
        document["output"] = {"path": args.output, "format": result.format, "written": written}
        document["verified"] = verified
    return document
