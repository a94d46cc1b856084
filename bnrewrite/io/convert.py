"""Rewriting a model file MetaGraph by MetaGraph: picking MetaGraphs by --tags, rewriting each
with `rewrite_graph`, keeping those with nothing to synchronize, and checking that every
signature and the saver still name tensors that exist."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bnrewrite.errors import (
    BnRewriteError,
    GraphValidationError,
    InferenceOnlyError,
    InputFormatError,
    NoBatchNormError,
)
from bnrewrite.io.model import Entry, Model, Outcome, Rewrite, protos, shown
from bnrewrite.io.verify import check_result, loads
from bnrewrite.rewrite.report import Report

#: Errors that, when rewriting every MetaGraph of a SavedModel, only mean "nothing to do here".
_NOTHING_TO_DO = (InferenceOnlyError, NoBatchNormError)


def parse_tags(specs: Sequence[str] | None) -> list[frozenset[str]] | None:
    """--tags values ("serve", "train,gpu"; several allowed) as tag sets; None selects all."""
    if not specs:
        return None
    sets = []
    for spec in specs:
        for group in spec.split(";"):
            tags = frozenset(t.strip() for t in group.split(",") if t.strip())
            if not tags:
                raise BnRewriteError(f"--tags {spec!r} names no tag; write e.g. --tags train or --tags serve,gpu")
            sets.append(tags)
    return sets


def select(model: Model, tag_sets: list[frozenset[str]] | None) -> list[Entry]:
    """The entries `tag_sets` names (all when None). Raises InputFormatError for a missing tag set."""
    if tag_sets is None:
        return list(model.entries)
    if not model.is_saved_model:
        raise BnRewriteError(f"--tags applies to SavedModels; {shown(model.path)} is a {model.description}")
    chosen = []
    for tags in tag_sets:
        found = [e for e in model.entries if frozenset(e.tags or ()) == tags]
        if not found:
            have = ", ".join(e.label for e in model.entries) or "none"
            raise InputFormatError(
                f"{shown(model.path)} has no MetaGraph tagged [{','.join(sorted(tags))}] (it has {have}); "
                "pick one of those with --tags"
            )
        chosen.extend(e for e in found if e not in chosen)
    return chosen


def rewrite(model: Model, tag_sets: list[frozenset[str]] | None = None, *, keep_idle: bool | None = None,
            **options: Any) -> Rewrite:
    """Rewrite the selected entries of `model` with `bnrewrite.rewrite_graph(**options)`.

    Every entry rewritten must pass TensorFlow's own import (`bnrewrite.io.verify.loads`), else
    GraphValidationError: the rewrite keeps most nodes as they are and would copy what
    TensorFlow rejects into its output. Every result must then load as TensorFlow's loader
    loads it (`check_result`: a MetaGraph with import_meta_graph, collections included), else
    PassError (or GraphValidationError when the input itself does not load that way). Entries with nothing to synchronize (inference only,
    no batch norm) are kept unchanged when `keep_idle`; by default that is when every MetaGraph of a SavedModel is rewritten
    (no tag sets given), and then if none is left, `nothing_rewritten` is raised.
    Every rewritten MetaGraph's signatures and saver must still name tensors that exist.
    """
    from bnrewrite.rewrite.api import rewrite_graph

    default = keep_idle is None
    if default:
        keep_idle = model.is_saved_model and tag_sets is None and len(model.entries) > 1
    outcomes: list[Outcome] = []
    for entry in select(model, tag_sets):
        error = loads(entry)  # first: the graph TensorFlow builds is gone before the rewrite takes its memory
        try:
            result = rewrite_graph(entry.message, **options)
        except _NOTHING_TO_DO as exc:
            if not keep_idle:
                raise located(exc, model, entry) from None
            outcomes.append(Outcome(entry, kept=exc))
            continue
        except BnRewriteError as exc:
            raise located(exc, model, entry) from None
        if error is not None:
            raise located(GraphValidationError(f"the graph does not import into TensorFlow ({error}); fix or re-export it"),
                          model, entry) from None
        new = Entry(result.graph_def, result.meta_graph_def, entry.tags, entry.index)
        if new.meta_graph is not None:
            _check_references(entry.meta_graph, new.meta_graph, model, entry, result.report)
        try:
            check_result(entry, new)
        except BnRewriteError as exc:
            raise located(exc, model, entry) from None
        outcomes.append(Outcome(entry, report=result.report, result=new))
    if default:
        failure = nothing_rewritten(model, outcomes)
        if failure is not None:
            raise failure
    return Rewrite(_replace_entries(model, [o.result for o in outcomes if o.result]), outcomes)


def nothing_rewritten(model: Model, outcomes: list[Outcome]) -> BnRewriteError | None:
    """When every outcome was kept for having nothing to synchronize, the error convert fails
    with: the first one's (NoBatchNormError or InferenceOnlyError), saying which MetaGraph."""
    if any(o.report for o in outcomes):
        return None
    first = next((o for o in outcomes if o.kept is not None), None)
    return None if first is None else located(first.kept, model, first.entry)


def located(exc: BnRewriteError, model: Model, entry: Entry) -> BnRewriteError:
    """The same error, its message prefixed with the MetaGraph it is about."""
    if entry.tags is None:
        return exc
    return type(exc)(f"MetaGraph {entry.label} of {shown(model.path)}: {exc}")


def _replace_entries(model: Model, new: list[Entry]) -> Model:
    by_index = {e.index: e for e in new}
    entries = [by_index.get(e.index, e) for e in model.entries]
    saved = None
    if model.saved_model is not None:
        saved = protos().SavedModel()
        saved.CopyFrom(model.saved_model)
        for e in new:
            saved.meta_graphs[e.index].CopyFrom(e.meta_graph)
        entries = [Entry(m.graph_def, m, tuple(m.meta_info_def.tags), i) for i, m in enumerate(saved.meta_graphs)]
    return Model(model.path, model.format, entries, saved, model.graph_file)


def meta_references(meta: Any) -> list[tuple[str, str]]:
    """(what, node name) for every node that the MetaGraph's signatures and saver name."""
    from bnrewrite.graph.names import parse_input

    refs: list[tuple[str, str]] = []
    for sig_name, sig in meta.signature_def.items():
        for kind, tensors in (("input", sig.inputs), ("output", sig.outputs)):
            for key, info in tensors.items():
                for tensor in _tensor_info_names(info):
                    refs.append((f"signature {sig_name!r} {kind} {key!r} ({tensor})", parse_input(tensor)[0]))
    saver = meta.saver_def
    for attr in ("filename_tensor_name", "save_tensor_name", "restore_op_name"):
        value = getattr(saver, attr)
        if value:
            refs.append((f"saver {attr} ({value})", parse_input(value)[0]))
    return refs


def _tensor_info_names(info: Any) -> list[str]:
    kind = info.WhichOneof("encoding")
    if kind == "name":
        return [info.name]
    if kind == "coo_sparse":
        c = info.coo_sparse
        return [n for n in (c.values_tensor_name, c.indices_tensor_name, c.dense_shape_tensor_name) if n]
    if kind == "composite_tensor":
        return [n for component in info.composite_tensor.components for n in _tensor_info_names(component)]
    return []


def _check_references(before: Any, after: Any, model: Model, entry: Entry, report: Report) -> None:
    have_before = {n.name for n in before.graph_def.node}
    have_after = {n.name for n in after.graph_def.node}
    refs = [(what, node) for what, node in meta_references(before) if node in have_before]
    lost = [(what, node) for what, node in refs if node not in have_after]
    if lost:
        what, node = lost[0]
        raise GraphValidationError(
            f"{'MetaGraph ' + entry.label + ' of ' if entry.tags is not None else ''}{shown(model.path)}: "
            f"the rewrite removed {node}, which {what} names; remove it from the signature and export again"
        )
    if after.signature_def:
        report.notes.append(
            f"{len(after.signature_def)} signature(s) checked: all {sum(1 for w, _ in refs if w.startswith('signature'))} tensors still resolve"
        )
