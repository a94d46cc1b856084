"""`rewrite_graph`: the Python entry point."""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from bnrewrite import functions, handles
from bnrewrite.errors import (
    AlreadyRewrittenError,
    BnRewriteError,
    InferenceOnlyError,
    NoBatchNormError,
)
from bnrewrite.graph import Graph, copy_fields, parse_input
from bnrewrite.match.sites import Census, scan
from bnrewrite.match.towers import TOWER_BY
from bnrewrite.nodes import MARK
from bnrewrite.passes import run_passes
from bnrewrite.passes.record import PassRecord
from bnrewrite.passes.sites import KERNEL_MIN_ELEMENTS, kernel_size_unknown
from bnrewrite.plan import Options, Plan, plan_without_shared_body_updates
from bnrewrite.report import LayerRow, Report


@dataclass(frozen=True)
class RewriteResult:
    graph_def: graph_pb2.GraphDef
    meta_graph_def: meta_graph_pb2.MetaGraphDef | None
    report: Report
    _built: weakref.WeakSet = field(default_factory=weakref.WeakSet, init=False, repr=False, compare=False)

    def to_graph(self) -> Any:
        """A new tf.Graph of the rewritten graph, with the collections, saver and variables of
        the MetaGraphDef when the input had one (a tf.Graph or MetaGraphDef)."""
        graph = handles.to_graph(self.graph_def, self.meta_graph_def)
        self._built.add(graph)
        return graph

    def find(self, graph: Any, old: Any) -> Any:
        """The counterparts in `graph` (from `to_graph`) of the handles `old` held in the input
        graph: Operations, Tensors, Variables or names, alone or in lists, tuples and dicts.
        Raises RemovedByRewriteError for a node the rewrite removed, ForeignGraphError for a
        graph `to_graph` did not make."""
        return handles.find(graph, old, {r["node"]: r["why"] for r in self.report.removed}, self._built)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cycle collector off for the duration (as it was before, after).

    A rewrite makes a few small objects per node (index entries, NodeDefs) and frees almost
    none of them until it returns, so the collector finds nothing to collect, yet it would
    walk the whole heap, TensorFlow's included, several times per rewrite.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_gc_paused()
def rewrite_graph(
    graph: Any,
    backend: str = "auto",
    *,
    tower_by: str = "auto",
    group_size: int | None = None,
    timeout_seconds: float = 0.0,
    num_workers: int = 1,
    task_index: int = 0,
    if_rewritten: str = "error",
    in_place: bool = False,
) -> RewriteResult:
    """Synchronize batch norm across the towers of a replicated training graph.

    Every step must run every tower's all-reduces: each synced layer needs all towers' batch
    statistics. So fetch what every tower feeds (the train op) and feed every tower's inputs:
    `sess.run([train_op, loss], feed)`, with all towers' placeholders in `feed`. One tower's
    tensor fetched alone still needs the other towers' inputs (else TensorFlow's "You must feed
    a value for placeholder tensor 'tower_1/...'", on the local backend); on NCCL it waits
    forever for the towers not run, on the collective backend until `timeout_seconds`.

    graph: a tf.Graph, tf.compat.v1.GraphDef or MetaGraphDef; never modified unless in_place.
    backend: "auto" (NCCL when every tower is on a GPU; else "local" in one process, "collective"
        with several workers or batch norms inside control flow v2), "nccl", "local" (one AddN on
        the first tower's device) or "collective" (CollectiveReduceV2).
    tower_by: "auto", "device" (one tower per device) or "scope" (one per top-level name scope).
    group_size: synchronize towers in consecutive groups of this many (default: all towers).
    timeout_seconds: CollectiveReduceV2's timeout, so a missing peer fails instead of hanging.
    num_workers, task_index: between-graph replication: this graph is worker `task_index` of
        `num_workers` identical workers; every all-reduce then spans all workers' towers
        (collective backend; keys are the same on every worker because the graphs are).
    if_rewritten: "error" raises AlreadyRewrittenError on a graph bnrewrite already rewrote;
        "keep" returns it unchanged with a report saying so.
    in_place: rewrite the GraphDef or MetaGraphDef given and return it in the result instead
        of a copy, which saves the memory of one copy of the graph; if the rewrite fails, it
        is left as it was.
    """
    if tower_by not in TOWER_BY:
        raise BnRewriteError(f"unknown tower_by {tower_by!r}; choose one of {', '.join(TOWER_BY)}")
    if if_rewritten not in ("error", "keep"):
        raise BnRewriteError(f"unknown if_rewritten {if_rewritten!r}; choose error or keep")
    options = Options(
        backend=backend, tower_by=tower_by, group_size=group_size, timeout_seconds=timeout_seconds,
        num_workers=num_workers, task_index=task_index,
    )
    graph_def, meta, storage = _as_protos(graph, in_place)
    size = len(graph_def.node)
    try:
        return _rewrite(graph_def, meta, storage, options, if_rewritten)
    except BaseException:
        if storage is graph_def:  # drop what the passes appended; the nodes before change only at the very end
            del graph_def.node[size:]
        raise


def _rewrite(
    graph_def: graph_pb2.GraphDef, meta: meta_graph_pb2.MetaGraphDef | None, storage: graph_pb2.GraphDef,
    options: Options, if_rewritten: str,
) -> RewriteResult:
    model = Graph.from_graph_def(graph_def, storage=storage)
    model.validate()  # a dangling input or a cycle in the input is the input's fault, not a pass's
    combined, bodies, census = take_census(model)
    if census.rewritten:
        if if_rewritten == "error":
            raise AlreadyRewrittenError(
                f"this graph was already rewritten by bnrewrite ({len(census.rewritten)} nodes carry its mark); "
                "rewrite the original graph instead"
            )
        report = Report(already_rewritten=True, nodes_before=len(model), nodes_after=len(model))
        report.notes.append(f"{len(census.rewritten)} nodes already carry bnrewrite's mark")
        if storage is not graph_def:
            storage.CopyFrom(graph_def)
        return RewriteResult(storage, meta, report)
    if not census.sites:
        if census.inference:
            raise InferenceOnlyError(
                f"all {len(census.inference)} batch-norm ops are in inference mode (is_training=False); "
                "bnrewrite rewrites training graphs: export the graph with training=True and its gradients"
            )
        raise NoBatchNormError(
            "no batch-norm op found that bnrewrite can rewrite (FusedBatchNorm*, tf.nn.moments); nothing to synchronize"
            + (f" ({len(census.skips)} unsupported: {census.skips[0].reason})" if census.skips else "")
        )
    plan = plan_without_shared_body_updates(combined, census, options)
    rewritten, records = run_passes(combined, plan)
    report_note = ""
    if bodies is not None and bodies.bodies:
        rewritten = functions.restore(rewritten, bodies)
        if any(functions.in_body(c) for r in records for c in r.collectives):
            report_note = (
                "all-reduces inside If branch functions are not chained across functions by order_collectives "
                "(fine with the collective backend; with NCCL, towers could launch them in different orders)"
            )
    unsized = sum(kernel_size_unknown(combined, group.sites[0]) for group in plan.groups)
    report = _report(plan, records, census, len(model), len(rewritten))
    out_def = rewritten.to_graph_def()  # uses `rewritten` (and the storage `combined` reads) up
    if report_note:
        report.notes.append(report_note)
    if unsized:
        report.notes.append(
            f"{unsized} layer(s) on CPU towers: elementwise passes, as the graph records no static shapes (fused "
            f"kernels, faster from {KERNEL_MIN_ELEMENTS} elements per tower, need them: "
            "convert a .meta or pass a tf.Graph)")
    if options.num_workers > 1:
        report.notes.append(
            f"worker {options.task_index} of {options.num_workers}: every all-reduce spans all workers' towers; "
            "every worker must have the same number of towers"
        )
        if not options.timeout_seconds:
            report.notes.append("no collective timeout: a worker that never joins makes the others wait forever")
    if meta is not None:
        _drop_from_collections(meta, {r["node"] for r in report.removed})
    return RewriteResult(out_def, meta, report)


def take_census(model: Graph) -> tuple[Graph, functions.Bodies | None, Census]:
    """The graph with its If branches flattened beside it, those branches, and every batch-norm
    op found in both and in the rest of the function library: what the rewrite (and `inspect`) see."""
    combined, bodies = functions.flatten(model)
    census = scan(combined)
    if model.library is not None and not census.rewritten:  # marks in branch functions left unflattened
        census.rewritten.extend(
            f"{f.signature.name}/{n.name}" for f in model.library.function for n in f.node_def if MARK in n.attr
        )
    if bodies is not None:
        functions.adopt_sites(combined, bodies, census, functions.called_functions(model))
    return combined, bodies, census


def _as_protos(
    graph: Any, in_place: bool
) -> tuple[graph_pb2.GraphDef, meta_graph_pb2.MetaGraphDef | None, graph_pb2.GraphDef]:
    """The GraphDef to rewrite, the MetaGraphDef the result goes in (if any), and the GraphDef
    the result is built in: the one to rewrite when that is ours to change (in_place, or an
    export of a tf.Graph), else a new one (in the new MetaGraphDef)."""
    if isinstance(graph, meta_graph_pb2.MetaGraphDef):
        if in_place:
            graph_def = graph.graph_def
            return graph_def, graph, graph_def
        meta = meta_graph_pb2.MetaGraphDef()
        copy_fields(graph, meta, but="graph_def")
        return graph.graph_def, meta, meta.graph_def
    if isinstance(graph, graph_pb2.GraphDef):
        return graph, None, graph if in_place else graph_pb2.GraphDef()
    if hasattr(graph, "as_graph_def") and hasattr(graph, "get_all_collection_keys"):
        import tensorflow as tf

        with graph.as_default():
            meta = tf.compat.v1.train.export_meta_graph(graph=graph, clear_devices=False)
        graph_def = meta.graph_def
        return graph_def, meta, graph_def
    raise BnRewriteError(f"rewrite_graph takes a tf.Graph, GraphDef or MetaGraphDef, not {type(graph).__name__}")


def _drop_from_collections(meta: meta_graph_pb2.MetaGraphDef, removed: set[str]) -> None:
    """Removed ops leave every collection that listed them."""
    for collection in meta.collection_def.values():
        if collection.WhichOneof("kind") == "node_list":
            kept = [v for v in collection.node_list.value if parse_input(v)[0] not in removed]
            del collection.node_list.value[:]
            collection.node_list.value.extend(kept)


def _report(plan: Plan, records: list[PassRecord], census: Census, before: int, after: int) -> Report:
    report = Report(
        backend=plan.backend,
        tower_by=plan.towers.by,
        towers=list(plan.towers.ids),
        layout=plan.towers.layout,
        sync_groups=[list(g) for g in plan.sync_groups],
        nodes_before=before,
        nodes_after=after,
    )
    removed = [r for rec in records for r in rec.removed]
    removed_names = {name for name, _ in removed}
    for group in plan.groups:
        first = group.sites[0]
        grads = [g for s in group.sites for g in s.grads]
        report.layers.append(LayerRow(
            layer=group.key,
            op=first.op,
            data_format=first.data_format,
            dtype=first.dtype_name,
            towers=list(plan.towers.ids),
            sites=[s.name for s in group.sites],
            gradients=grads,
            collectives=len(group.sites) + len(grads),
            sync_groups=[list(g) for g in plan.sync_groups],
            updates_kept=[u.node for s in group.sites for u in s.updates if u.node not in removed_names],
            lined_up_by=group.lined_up_by,
        ))
    report.removed = [{"node": name, "why": why} for name, why in removed]
    report.skipped = [{"node": s.node, "reason": s.reason} for s in (*census.skips, *plan.towers.skips)]
    report.passes = [
        {"name": r.name, "added": r.added, "replaced": len(r.replaced), "removed": len(r.removed),
         "control_edges": r.control_edges, "seconds": round(r.seconds, 4)}
        for r in records
    ]
    if any(not g.sites[0].grads for g in plan.groups):
        report.notes.append("some synced layers have no gradient op in the graph: only their forward pass is synchronized")
    return report
