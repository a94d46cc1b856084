"""`rewrite_graph`: the Python entry point."""

from __future__ import annotations

import gc
import signal
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable, Iterator

from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from bnrewrite.errors import (
    AlreadyRewrittenError,
    BnRewriteError,
    InferenceOnlyError,
    NoBatchNormError,
    TowerMismatchError,
    UnsyncedLayerError,
)
from bnrewrite.graph.assembly import copy_fields
from bnrewrite.graph.index import Graph
from bnrewrite.graph.names import tensor_name
from bnrewrite.graph.nodes import MARK, outer_node
from bnrewrite.graph.opcheck import check_nodes
from bnrewrite.match.census import Census, Site
from bnrewrite.match.live_work import NOT_RUN, Walks, gradient_callers, not_run, one_tower_steps, steps
from bnrewrite.match.sites import normalization, scan
from bnrewrite.match.towers import tower_map
from bnrewrite.rewrite import functions, handles, meaning
from bnrewrite.rewrite.arguments import check_arguments
from bnrewrite.rewrite.collections_def import drop_removed
from bnrewrite.rewrite.collectives import placed
from bnrewrite.rewrite.passes import run_passes
from bnrewrite.rewrite.passes.record import PassRecord
from bnrewrite.rewrite.plan import Options, Plan, plan_without_shared_body_updates
from bnrewrite.rewrite.report import LayerRow, MovingUpdate, Report, TowerTensors
from bnrewrite.rewrite.step_copies import COPY_SCOPE, copy_steps


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


@contextmanager
def _signals_held() -> Iterator[None]:
    """Every signal with a Python handler (SIGINT's KeyboardInterrupt, a timeout's SIGALRM, ...)
    that arrives during the block is held back and handed to its handler (once, as the
    operating system merges a signal repeated before it is handled) when the block ends, so
    that no handler's exception stops the block's steps midway. Every handler is put back and
    every held signal handed on even when a handler raises meanwhile. Signals reach Python
    handlers only in the main thread: elsewhere nothing needs holding."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: dict[int, Any] = {}  # signal number -> the frame it arrived in, in order of arrival
    handlers: dict[int, Any] = {}
    try:
        for signum in signal.valid_signals():
            handler = signal.getsignal(signum)
            if callable(handler):
                handlers[signum] = handler  # recorded first: the finally puts back what was replaced
                signal.signal(signum, lambda number, frame: held.setdefault(number, frame))
        yield
    finally:
        # Every handler back, even when a handler raises meanwhile: `signal.signal` first runs the
        # handlers of signals that arrived (in any thread) and changes nothing when one raises, and
        # a handler put back early may raise between two steps. Each step is retried until all are
        # back, then the first exception is raised. Inline, of built-in calls only: no Python
        # function of bnrewrite's runs (to be interrupted itself) until the handlers are back.
        pending, first = list(handlers.items()), None
        while pending:
            try:
                while pending:
                    signal.signal(*pending[0])
                    del pending[0]
            except BaseException as exc:  # a KeyboardInterrupt too: raised once all are back
                first = first or exc
        try:
            if first is not None:
                raise first
        finally:
            _each(list(held.items()), lambda item: handlers[item[0]](*item))


def _each(items: list[Any], call: Callable[[Any], Any]) -> None:
    """call(item) for every item in turn, every one even when one raises."""
    if items:
        try:
            call(items[0])
        finally:
            _each(items[1:], call)


@dataclass
class _Undo:
    """What it takes to put back a GraphDef or MetaGraphDef rewritten in place: its node count
    before, the graph whose `to_graph_def` changed it, and the collections changed."""

    graph_def: graph_pb2.GraphDef | None  # None: nothing of the caller's is changed
    size: int = 0
    graph: Graph | None = None
    collections: list[tuple[Any, list[str]]] = field(default_factory=list)

    def restore(self) -> None:
        if self.graph_def is None:
            return
        for values, old in reversed(self.collections):
            del values[:]
            values.extend(old)
        if self.graph is not None:
            self.graph.undo_in_place()
        del self.graph_def.node[self.size:]  # what the passes appended


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
    available_gpus: int | None = None,
    allow_unsynced: bool = False,
    available_cpus: int | None = None,
) -> RewriteResult:
    """Synchronize batch norm across the towers of a replicated training graph.

    Every step must run every tower's all-reduces: each synced layer needs all towers' batch
    statistics. So fetch what every tower feeds (the train op) and feed every tower's inputs:
    `sess.run([train_op, loss], feed)`, with all towers' placeholders in `feed`. One tower's
    tensor fetched alone still needs the other towers' inputs (else TensorFlow's "You must feed
    a value for placeholder tensor 'tower_1/...'", on the local backend); on NCCL it waits
    forever for the towers not run, on the collective backend until `timeout_seconds`.

    graph: a tf.Graph, tf.compat.v1.GraphDef or MetaGraphDef; never modified unless in_place.
    backend: "auto" (NCCL when every tower is on a GPU; else "local" in one process, "ps" across the
        workers of a parameter-server cluster, "collective" with several workers or batch norms
        inside control flow v2), "nccl", "local" (one AddN on
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
    available_gpus, available_cpus: the GPUs and CPU devices of the session that will run the result,
        when known (bnrewrite run passes them): towers asked for devices it lacks run where soft
        placement puts them (its CPU 0), and the backend is chosen from there; towers that run on
        one device inside control flow v2 take the collective runtime on a CPU device each, and
        `report.cpu_devices` says how many CPU devices the session then needs.
    allow_unsynced: a training batch-norm layer that cannot be synchronized (report.skipped says
        why) makes the rewrite raise UnsyncedLayerError, as the towers would not train like one
        device; with True the other layers are synchronized and those left as they were.
    """
    check_arguments(backend, tower_by, group_size, timeout_seconds, num_workers, task_index, if_rewritten, in_place)
    if not isinstance(allow_unsynced, bool):
        raise BnRewriteError(f"allow_unsynced={allow_unsynced!r} is not valid; give True or False")
    options = Options(
        backend=backend, tower_by=tower_by, group_size=group_size, timeout_seconds=timeout_seconds,
        num_workers=num_workers, task_index=task_index, available_gpus=available_gpus, available_cpus=available_cpus,
    )
    graph_def, meta, storage = _as_protos(graph, in_place)
    undo = _Undo(graph_def if storage is graph_def and in_place else None, len(graph_def.node))
    try:
        with _gc_paused():
            result = _rewrite(graph_def, meta, storage, options, if_rewritten, undo, allow_unsynced)
        return result  # inside the try: an exception up to the return itself is undone
    except BaseException:
        with _signals_held():
            undo.restore()
        raise


def _rewrite(
    graph_def: graph_pb2.GraphDef, meta: meta_graph_pb2.MetaGraphDef | None, storage: graph_pb2.GraphDef,
    options: Options, if_rewritten: str, undo: _Undo, allow_unsynced: bool = False,
) -> RewriteResult:
    model = Graph.from_graph_def(graph_def, storage=storage)
    model.validate()  # a dangling input or a cycle in the input is the input's fault, not a pass's
    check_nodes(model)
    combined, bodies, census = take_census(model, options.tower_by)
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
    skips = [*census.skips, *plan.towers.skips]
    if skips and not allow_unsynced:
        raise UnsyncedLayerError(
            f"{len(skips)} training batch-norm op(s) of the {len(plan.towers.ids)} towers cannot be synchronized, so "
            f"the towers would not train like one device: {skips[0].node}: {skips[0].reason}"
            + (f" (and {', '.join(s.node for s in skips[1:4])}{', ...' if len(skips) > 4 else ''})" if skips[1:] else "")
            + "; allow_unsynced synchronizes the others and leaves these as they are")
    before = meaning.effects(combined, meaning.gradient_ops(plan))
    rewritten, records = run_passes(combined, plan)
    meaning.check_meaning(before, rewritten, plan, {name for r in records for name, _ in r.removed})
    report_note = ""
    if bodies is not None and bodies.bodies:
        rewritten = functions.restore(rewritten, bodies)
        if any(functions.in_body(c) for r in records for c in r.collectives):
            report_note = (
                "all-reduces inside If branch functions are not chained across functions by order_collectives "
                "(fine with the collective backend; with NCCL, towers could launch them in different orders)"
            )
    report = _report(combined, plan, records, census, len(model), len(rewritten))
    if report_note:
        report.notes.append(report_note)
    devices = [site.device for site in plan.groups[0].sites]
    real = [placed(d, options.available_gpus, options.available_cpus) for d in devices]
    if real != devices and len(set(real)) < len(real):
        report.notes.append(
            f"towers {', '.join(map(str, devices))} all run on {real[0]} (the session has {options.available_gpus} GPU(s) "
            f"and {options.available_cpus} CPU device(s): soft placement)"
            + (f": their all-reduces meet on /device:CPU:0..{len(plan.spread) - 1}, one per tower, which the session "
               f"needs (bnrewrite run gives it them)" if plan.spread else ": synchronized by one local sum"))
    elif plan.spread:
        report.notes.append(f"towers that share a device or name none: their all-reduces meet on /device:CPU:0.."
                            f"{len(plan.spread) - 1}, one per tower, which the session needs (bnrewrite run gives it them)")
    report.cpu_devices = len(plan.spread)
    if len(set(devices)) < len(devices) and plan.backend == "local":
        report.notes.append(
            f"towers {', '.join(plan.towers.ids)} share a device or name none "
            f"({', '.join(sorted({str(d) or '(no device)' for d in devices}))}): synchronized by one local sum; "
            "nccl and collective need a device per tower")
    if options.num_workers > 1:
        report.notes.append(
            f"worker {options.task_index} of {options.num_workers}: every all-reduce spans all workers' towers; "
            "every worker must have the same number of towers"
        )
        if plan.backend == "ps":
            report.notes.append(
                f"all-reduces through queues on {', '.join(map(str, plan.servers))}, which have no time-out: "
                "bnrewrite run and enable() bound each step, sessions of your own should set RunOptions.timeout_in_ms")
        elif not options.timeout_seconds:
            report.notes.append("no collective timeout in the graph: bnrewrite run and enable() bound each step, a "
                                "session of your own waits forever for a worker that never joins")
    removed = {r["node"] for r in report.removed}
    with _signals_held():  # the caller's GraphDef changes here when in place: in steps undo can take back
        undo.graph = rewritten
        out_def = rewritten.to_graph_def()  # uses `rewritten` (and the storage `combined` reads) up
        if meta is not None:
            drop_removed(meta, removed, undo.collections)
    return RewriteResult(out_def, meta, report)


def take_census(model: Graph, tower_by: str = "") -> tuple[Graph, functions.Bodies | None, Census]:
    """The graph with its If branches flattened beside it, those branches, and every batch-norm
    op found in both and in the rest of the function library: what the rewrite (and `inspect`) see.
    With `tower_by` (the rewrite's), a later step that runs one tower of the multi-tower step runs
    copies of that tower's forward pass (step_copies), which the graph and census then hold."""
    combined, bodies, census = _census(model)
    alone = one_tower_steps(tower_map(census.sites, tower_by), census.steps) if tower_by else {}
    if not alone:
        return combined, bodies, census
    copied = copy_steps(model, alone, census.steps, gradient_callers(census.sites, _callers(bodies)))
    if copied.why:
        raise TowerMismatchError(f"{copied.why}: train every tower in one step, or a single tower in a graph of its own")
    combined, bodies, census = _census(copied.graph, copied.own)
    census.copies = copied.copies
    return combined, bodies, census


def _census(model: Graph, aliases: Mapping[str, Mapping[str, str]] | None = None
            ) -> tuple[Graph, functions.Bodies | None, Census]:
    combined, bodies = functions.flatten(model)
    census = scan(combined, aliases)
    if model.library is not None and not census.rewritten:  # marks in branch functions left unflattened
        census.rewritten.extend(
            f"{f.signature.name}/{n.name}" for f in model.library.function for n in f.node_def if MARK in n.attr
        )
    if bodies is not None:
        functions.adopt_sites(combined, bodies, census)
    walks = Walks(combined)
    census.not_run = not_run(combined, census.sites, walks)
    if census.not_run:
        idle = {skip.node for skip in census.not_run}
        census.sites = [site for site in census.sites if site.name not in idle]
    census.steps = steps(combined, census.sites, _callers(bodies), walks)
    return combined, bodies, census


def _callers(bodies: functions.Bodies | None) -> dict[str, str]:
    """Each flattened branch body's prefix -> the If that calls it."""
    return {b.prefix: b.caller for b in bodies.bodies} if bodies else {}


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
    if is_tf_graph(graph):
        meta = _export(graph)
        graph_def = meta.graph_def
        return graph_def, meta, graph_def
    raise BnRewriteError(f"rewrite_graph takes a tf.Graph, GraphDef or MetaGraphDef, not {type(graph).__name__}")


def is_tf_graph(graph: Any) -> bool:
    return hasattr(graph, "as_graph_def") and hasattr(graph, "get_all_collection_keys")


def _export(graph: Any, attempts: int = 3) -> meta_graph_pb2.MetaGraphDef:
    """A MetaGraphDef of tf.Graph `graph`, the only view of it the rewrite then uses. A graph
    another thread adds ops to while it is exported would give a MetaGraphDef whose
    collections name ops its graph_def lacks (or make the export itself fail): the export is
    taken again, and refused if the graph keeps changing."""
    import tensorflow as tf

    failure = ""
    for _ in range(attempts):
        version = graph.version
        try:
            with graph.as_default():
                meta = tf.compat.v1.train.export_meta_graph(graph=graph, clear_devices=False)
        except Exception as exc:  # noqa: BLE001 - TensorFlow's export fails in many ways on a graph that grows meanwhile
            # (an op another thread is adding can be in the C graph before Python knows its name)
            failure = f" ({type(exc).__name__}: {str(exc)[:200]})"
            continue
        if graph.version == version and len(meta.graph_def.node) == len(graph.get_operations()):
            return meta
    raise BnRewriteError(
        f"the tf.Graph could not be read whole{failure}: is another thread adding ops to it? "
        "Rewrite it once it is built, or pass graph.as_graph_def() or a MetaGraphDef")


def _report(graph: Graph, plan: Plan, records: list[PassRecord], census: Census, before: int, after: int) -> Report:
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
    moments = {site: pair for r in records for site, pair in r.moments.items()}
    for group in plan.groups:
        first = group.sites[0]
        kept = [MovingUpdate(u.node, u.variable, u.statistic, tower) for tower, s in zip(plan.towers.ids, group.sites)
                for u in s.updates if u.node not in removed_names]
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
            updates_kept=[u.node for u in kept],
            lined_up_by=group.lined_up_by,
            epsilon=first.epsilon if first.kind == "fused" else getattr(normalization(graph, first), "epsilon", 0.0),
            reduce_axes=first.reduce_axes,
            tensors=[_tower_tensors(graph, tower, site, moments.get(site.name)) for tower, site in zip(plan.towers.ids, group.sites)],
            moving=kept,
        ))
    report.removed = [{"node": name, "why": why} for name, why in removed]
    report.skipped = [{"node": s.node, "reason": s.reason} for s in (*census.skips, *plan.towers.skips)]
    report.not_run = [s.node for s in census.not_run]
    idle = [s.node for s in census.not_run if s.reason == NOT_RUN]
    if idle:
        report.notes.append(
            f"{len(idle)} training batch-norm op(s) that no training step runs left as they are, not towers "
            f"(e.g. {idle[0]}: the call that built a Keras model on its own Input, an unused copy)")
    alone = [s for s in census.not_run if s.reason != NOT_RUN and not s.node.startswith(COPY_SCOPE)]
    if alone:
        report.notes.append(f"{len(alone)} training batch-norm op(s) left as they are, not towers: {alone[0].node}: "
                            f"{alone[0].reason}")
    report.copies = census.copies
    for step, copies in census.copies.items():
        sites = sorted(s.node for s in census.not_run if outer_node(s.node).split("/", 1)[1] in copies)
        report.notes.append(
            f"training step {step} runs {len(sites)} batch-norm op(s) of one tower alone (e.g. "
            f"{sites[0].split('/', 1)[1] if sites else next(iter(copies))}): it runs them and what they feed "
            f"unsynchronized, as python does ({len(copies)} node(s) copied under {next(iter(copies.values())).split('/')[0]}/)")
    report.passes = [
        {"name": r.name, "added": r.added, "replaced": len(r.replaced), "removed": len(r.removed),
         "control_edges": r.control_edges, "seconds": round(r.seconds, 4)}
        for r in records
    ]
    applied = plan.towers.applications
    if applied:
        more = f" and {len(applied) - 3} more" if len(applied) > 3 else ""
        report.notes.append(
            f"{len(applied)} layer(s) applied several times in each tower, each application synchronized with its "
            f"counterparts in the other towers: {'; '.join(applied[:3])}{more}")
    if any(not g.sites[0].grads for g in plan.groups):
        report.notes.append("some synced layers have no gradient op in the graph: only their forward pass is synchronized")
    return report


def _tower_tensors(graph: Graph, tower: str, site: Site, moments: tuple[str, str] | None) -> TowerTensors:
    """Site's x, y, scale, offset and global moments, as tensor names of the rewritten graph
    (the site keeps its name and output 0; its inputs are untouched nodes)."""
    if functions.in_body(site.name) or moments is None:
        return TowerTensors(tower, "", "", "", "", "", "")
    inputs = [tensor_name(*i) for i in graph.inputs(site.name)]
    mean, variance = moments
    if site.kind == "fused":
        return TowerTensors(tower, inputs[0], site.name, inputs[1], inputs[2], mean, variance)
    found = normalization(graph, site)
    if found is None:
        return TowerTensors(tower, inputs[0], "", "", "", mean, variance)
    return TowerTensors(tower, inputs[0], found.y, found.scale, found.offset, mean, variance)
