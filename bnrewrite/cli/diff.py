"""`bnrewrite diff A B`: op-type counts and, per batch-norm layer, the nodes bnrewrite added,
replaced and removed between two models (SavedModels compared MetaGraph by MetaGraph).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from bnrewrite import errors
from bnrewrite.cli.output import Printer, entries_summary
from bnrewrite.cli.tf import import_tensorflow
from bnrewrite.errors import BnRewriteError


def cmd_diff(args: argparse.Namespace) -> int:
    from bnrewrite import io
    from bnrewrite.io.visualize import diff_entries

    out = Printer(args)
    io.check_input(args.a)
    io.check_input(args.b)
    tag_sets = io.parse_tags(args.tags)
    import_tensorflow()
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
    out.line(f"A: {args.a} ({a.description}, {entries_summary(a)})")
    out.line(f"B: {args.b} ({b.description}, {entries_summary(b)})")
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


def _print_diff(out: Printer, d: dict[str, Any]) -> None:
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
