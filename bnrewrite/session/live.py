"""The shadows that sessions on the script's own tf.Graph run (`enable()`, `rewrite_graph(g,
in_place=True)`, `bnrewrite run`: their entry points and the patched session class are in
bnrewrite.session.sessions), the decisions that make them, and the state the session layer keeps.

The script's graph is never edited, so every handle it holds (ops, tensors, variables, savers,
summaries, collections, hooks) stays what it built. When a session is created on a graph that
holds multi-tower training batch norm, the graph is rewritten and imported into a shadow
tf.Graph; TensorFlow's session is created on the shadow, while the Python session object keeps
the script's graph (`sess.graph`, and the resolution of fetches and feeds). TensorFlow's C API
runs feeds, fetches and targets by name, and the rewrite keeps the name of every node it does
not remove, so each handle runs its synchronized counterpart. Ops the script adds to its graph
later (an init op, a Saver, eval ops) are copied into the shadow before the next run.

Invariant: a session on a rewritten graph runs, under every name, what the rewritten graph
gives that name; a name the rewrite removed, or a later op that reads one, is refused by name
(RemovedByRewriteError) before the run. Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bnrewrite.errors import (
    AlreadyRewrittenError,
    BnRewriteError,
    IndependentModelsError,
    InferenceOnlyError,
    NoBatchNormError,
    NoTowersError,
    RemovedByRewriteError,
)
from bnrewrite.graph.c_graph import import_fragment, operations
from bnrewrite.session.bounds import START_SECONDS

SESSION_MODULE = "tensorflow.python.client.session"
#: What makes a graph run unchanged rather than refused: there is nothing to synchronize.
NOTHING_TO_SYNC = (NoBatchNormError, InferenceOnlyError, AlreadyRewrittenError, NoTowersError)
#: Op types that can make (or hold, in their functions) a training batch-norm layer or its gradients
#: (Reshape, BroadcastTo: a moments layer's): a graph that gains one after it was decided is looked at again
#: (Keras' fit adds the gradients to a graph whose session compile made and ran).
MAY_TRAIN_BATCH_NORM = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "Mean", "If", "StatelessIf",
                                  "FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3", "Reshape",
                                  "BroadcastTo"})


@dataclass(frozen=True)
class LiveOptions:
    """`enable()`'s options: the rewrite's keyword arguments, and what to do with a graph
    bnrewrite refuses (`allow_unsynced`: run it as it is; `exit_on_refusal`: `bnrewrite run`
    stops the script with the error's exit code) and what to print."""

    rewrite: dict[str, Any] = field(default_factory=dict)
    allow_unsynced: bool = False
    exit_on_refusal: bool = False
    quiet: bool = False
    verbose: bool = False
    verify: bool = False  # check the first step of each rewritten graph (bnrewrite.session.first_step)
    start_timeout: float = START_SECONDS  # the first meeting of several workers' bound (bnrewrite.session.bounds)


@dataclass
class Shadow:
    """The rewritten graph a script's graph runs as, and what of the script's graph it holds:
    the first `copied` ops, less those `missing` (node -> why it cannot run)."""

    graph: Any
    copied: int
    missing: dict[str, str]
    functions: set[str]  # the names of the functions in the shadow's library
    number: int = 0  # the graph's number in the messages and records
    options: LiveOptions = field(default_factory=LiveOptions)
    first_step: Any = None  # a FirstStep while the first step is to be checked
    operations: dict[str, Any] | None = None  # name -> TF_Operation of the shadow, made at the first copy
    lock: threading.Lock = field(default_factory=threading.Lock)
    config: Any = None  # the ConfigProto of the session that made it
    signature: tuple = ()  # what the rewrite synchronized and skipped (_signature)
    replaced_by: "Shadow | None" = None  # the shadow of the graph grown since, which sessions move to
    sites: dict[str, int] = field(default_factory=dict)  # training batch norms the rewrite saw (_sites)
    meetings: Any = None  # its keyed all-reduces, whose runs are bounded (bnrewrite.session.bounds.Meetings)
    cpu_devices: int = 0  # the CPU devices its session needs: all-reduces spread over them (step_config)
    copies: dict[str, dict[str, str]] = field(default_factory=dict)  # a step training one tower alone -> node -> copy

    def copies_for(self, names: Iterable[str]) -> dict[str, str]:
        """Node -> the copy a run of `names` computes it by ({} for most runs): a step that trains one
        tower alone runs copies of its forward pass (bnrewrite.rewrite.step_copies), so what the script
        fetches with it is read from those, as python computes it in that step."""
        return next((self.copies[name] for name in names if name in self.copies), {})

    def output(self, name: str, index: int) -> Any:
        """The TF_Output of output `index` of the shadow's node `name`."""
        from tensorflow.python.framework import c_api_util

        with self.lock:
            if self.operations is None:
                self.operations = operations(self.graph)
            return c_api_util.tf_output(self.operations[name], index)

    def catch_up(self, script_graph: Any) -> None:
        """Copy the ops added to `script_graph` since the last call; an op that reads a missing
        node is not copied and becomes missing too. Ops that may make or train batch-norm layers
        (a second model, Keras' fit adding gradients) have the graph rewritten again (_regrow)."""
        if script_graph.version == self.copied:
            return
        with script_graph._session_run_lock(), self.lock:  # no op of the script's is half made meanwhile
            ops = script_graph.get_operations()
            new = ops[self.copied:]
            if new:
                _copy_ops(new, script_graph, self)
            self.copied = len(ops)
        if self.replaced_by is None and any(op.type in MAY_TRAIN_BATCH_NORM for op in new):
            _regrow(script_graph, self)

    def refuse_missing(self, names: Iterator[str], fed: bool = False) -> None:
        for name in names:
            if name in self.missing:
                if fed:
                    raise RemovedByRewriteError(
                        f"{name} is not in the synchronized graph, so it cannot be fed: {self.missing[name]}")
                raise RemovedByRewriteError(
                    f"{name} is not in the synchronized graph: {self.missing[name]}; fetch the train op instead")


@dataclass
class Decision:
    shadow: Shadow | None
    version: int  # the script graph's version when decided
    number: int = 0  # the graph's number in the messages and records, one for its whole life
    in_place: bool = False  # rewrite_graph(g, in_place=True): synchronized whether enable() is on or not


def _regrow(script_graph: Any, shadow: Shadow) -> None:
    """Rewrite a grown graph again whole when it has batch norms or gradients of them that
    `shadow` lacks (a census tells, at the cost of an export); when the rewrite synchronizes
    otherwise than `shadow` (new layers, their gradients: a forward pass synchronized before its
    gradients existed), the new shadow replaces it, and every session on it moves there with its
    variables (_current)."""
    from bnrewrite.graph.index import Graph
    from bnrewrite.rewrite.api import take_census

    version, graph_def = script_graph.version, script_graph.as_graph_def()  # read, never written, by the census
    _, _, census = take_census(Graph.from_graph_def(graph_def), shadow.options.rewrite.get("tower_by", "auto"))
    found = {s.name: len(s.grads) for s in census.sites}
    found.update((s.node, -1) for s in (*census.skips, *census.not_run))
    if found == shadow.sites:
        return
    with state.lock:
        decision = decide(script_graph, shadow.config, shadow.options, again=True, previous=shadow,
                          exported=(version, graph_def))
        if decision.shadow is None or decision.shadow is shadow:  # as before: not again for the same census
            shadow.sites = found
        else:
            shadow.replaced_by = decision.shadow
            state.decisions[script_graph] = decision


def _sites(report: Any) -> dict[str, int]:
    """Every training batch norm a rewrite saw: synced ones with their gradient count, others -1."""
    found = {site: -1 for site in (*(s["node"] for s in report.skipped), *report.not_run)}
    for row in report.layers:
        grads = len(row.gradients) // len(row.sites)
        found.update((site, grads) for site in row.sites)
    return found


def _signature(report: Any) -> tuple:
    """What a rewrite synchronized (each layer's sites and gradients) and skipped, and the steps it
    gave copies of one tower (step_copies)."""
    return (tuple((tuple(row.sites), tuple(row.gradients)) for row in report.layers),
            tuple(s["node"] for s in report.skipped), tuple(sorted(report.copies)))


def growth(old: Shadow, new: Shadow) -> str:
    """What a graph synchronized again after it grew gained, from the two rewrites' signatures."""
    def counts(signature: tuple) -> tuple[int, int]:
        return len(signature[0]), sum(len(gradients) for _, gradients in signature[0])

    (layers, gradients), (had_layers, had_gradients) = counts(new.signature), counts(old.signature)
    alone = [step for step in new.signature[2] if step not in old.signature[2]]
    if alone and (layers, gradients) == (had_layers, had_gradients):
        return (f"the graph grew (training step {alone[0]} added, which trains one tower alone: it runs copies of that "
                "tower's batch norms, unsynchronized, as python does)")
    return (f"the graph grew (a model or train op added; now {layers} batch-norm layer(s) with {gradients} gradient "
            f"op(s) synchronized, {had_layers} with {had_gradients} before)")


def late_refusal(number: int, options: LiveOptions, exc: BnRewriteError) -> None:
    """A graph found wanting after steps may have run: a warning with allow_unsynced, else the
    error (printed, and the script stopped with its code, under `bnrewrite run`)."""
    with state.lock:
        for record in state.records:
            if record["graph"] == number:
                record["why"] = str(exc)
    if options.allow_unsynced:
        print(f"bnrewrite: warning: graph {number}: {exc} (--allow-unsynced: they run UNSYNCHRONIZED)",
              file=sys.stderr, flush=True)
        return
    if options.exit_on_refusal:
        print(f"bnrewrite: error: graph {number} refused, the script is stopped: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code)
    raise exc


@dataclass
class _State:
    options: LiveOptions | None = None  # None: disabled (graphs given to attach() still run rewritten)
    decisions: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    records: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock)
    installed: bool = False


state = _State()


def records() -> list[dict[str, Any]]:
    """One entry per graph decided so far: its outcome, why, and the rewrite's report."""
    with state.lock:
        return list(state.records)


def make_shadow(count: int, result: Any, number: int = 0, options: LiveOptions | None = None, config: Any = None) -> Shadow:
    """The shadow of a graph whose first `count` ops `result` rewrote; to be verified, with the
    check's ops; its meetings bounded when `options` (enable()'s) are given, not for
    rewrite_graph(g, in_place=True), whose graph carries the caller's own timeout."""
    import tensorflow as tf

    from bnrewrite.session.bounds import meetings
    from bnrewrite.session.first_step import FirstStep

    bounded = options is not None
    options = options or LiveOptions()
    shadow_graph = tf.Graph()
    import_fragment(shadow_graph, result.graph_def.SerializeToString(), {}, {})
    first_step = FirstStep.build(shadow_graph, result) if options.verify else None
    removed = {r["node"]: f"the rewrite removed it ({r['why']})" for r in result.report.removed}
    functions = {f.signature.name for f in result.graph_def.library.function}
    return Shadow(shadow_graph, count, removed, functions, number, options, first_step, config=config,
                  signature=_signature(result.report), sites=_sites(result.report), cpu_devices=result.report.cpu_devices,
                  copies=result.report.copies,
                  meetings=meetings(result.graph_def, result.report, options.rewrite, options.start_timeout) if bounded
                  else None)


def step_config(config: Any, shadow: Shadow) -> Any:
    """The ConfigProto for a session on `shadow`: with all-reduces spread over CPU devices
    (towers that run on one device), at least that many CPU devices."""
    if _cpus(config) >= shadow.cpu_devices:
        return config
    from tensorflow.core.protobuf import config_pb2

    more = config_pb2.ConfigProto()
    if config is not None:
        more.CopyFrom(config)
    more.device_count["CPU"] = shadow.cpu_devices
    return more


def _copy_ops(new_ops: list[Any], script_graph: Any, shadow: Shadow) -> None:
    """Import `new_ops` (new ops of the script's graph, in creation order) into the shadow,
    inputs from outside them mapped to the shadow's ops of the same names."""
    from tensorflow.core.framework import graph_pb2

    if shadow.operations is None:
        shadow.operations = operations(shadow.graph)
    existing = shadow.operations
    fragment = graph_pb2.GraphDef()
    fragment.versions.CopyFrom(script_graph.graph_def_versions)
    names = {op.name for op in new_ops}
    inputs: dict[str, tuple[Any, int]] = {}
    controls: dict[str, Any] = {}
    for op in new_ops:
        node = op.node_def
        if node.name in existing:
            shadow.missing[node.name] = "its name is taken by an op bnrewrite added to the synchronized graph"
            names.discard(node.name)
            continue
        reads = [name.lstrip("^").split(":")[0] for name in node.input]
        bad = next((name for name in reads if name in shadow.missing), None)
        if bad is not None:
            shadow.missing[node.name] = f"it reads {bad}, and {shadow.missing[bad]}"
            names.discard(node.name)
            continue
        for name, source in zip(node.input, reads):
            if source in names:
                continue
            if name.startswith("^"):
                controls[source] = existing[source]
            else:
                index = int(name.partition(":")[2] or 0)
                inputs[f"{source}:{index}"] = (existing[source], index)
        fragment.node.append(node)
    for name, function in list(script_graph._functions.items()):
        if name not in shadow.functions and hasattr(function, "definition"):
            fragment.library.function.append(function.definition)
            shadow.functions.add(name)
    if shadow.first_step is not None:  # a train op built after the session is a step to check too
        shadow.first_step.learn({node.name: [name.lstrip("^").split(":")[0] for name in node.input]
                                 for node in fragment.node})
    if shadow.meetings is not None:
        shadow.meetings.learn(fragment.node)
    if fragment.node:
        added = [node.name for node in fragment.node]
        existing.update(zip(added, import_fragment(shadow.graph, fragment.SerializeToString(), inputs, controls, added)))


def record_verdict(number: int, verdict: dict[str, Any]) -> None:
    with state.lock:
        for record in state.records:
            if record["graph"] == number:
                record["verify"] = verdict


def shadow_for(graph: Any, config: Any) -> Shadow | None:
    """The shadow a new session on `graph` runs, deciding (rewriting) at the graph's first
    session, or again at a later one if it ran unchanged and has grown since; None: as it is
    (also a graph enable() synchronized, while disabled)."""
    from tensorflow.python.framework import ops

    if not isinstance(graph, ops.Graph):
        return None
    with state.lock:
        decision = state.decisions.get(graph)
        options = state.options
        if decision is not None and decision.shadow is not None:
            return decision.shadow if decision.in_place or options is not None else None
        if options is None or (decision is not None and decision.version == graph.version):
            return None
        decision = decide(graph, config, options, number=decision.number if decision is not None else 0)
        state.decisions[graph] = decision
        return decision.shadow


def decide(graph: Any, config: Any, options: LiveOptions, again: bool = False,
            previous: Shadow | None = None, exported: tuple[int, Any] | None = None, number: int = 0) -> Decision:
    """Rewrite `graph` for its session; `again`: looked at again after it grew, so a graph that
    still has nothing to synchronize gets no second record or line; `previous`: the shadow it
    had, kept (no record or line) when the rewrite synchronizes the same layers; `exported`:
    (version, GraphDef) of the graph, already exported by the caller (rewritten here in place);
    `number`: the graph's, when decided before (also `previous`'s), else the next one."""
    from bnrewrite.rewrite.api import rewrite_graph

    number = number or (previous.number if previous is not None else 0) or len(state.records) + 1
    version, graph_def = exported or (graph.version, graph.as_graph_def())
    count = len(graph_def.node)
    try:
        # no timeout in the graph: the session bounds each run that meets, the first of several workers' longer
        result = rewrite_graph(graph_def, in_place=True, if_rewritten="keep", available_gpus=_gpus(config),
                               available_cpus=_cpus(config),
                               allow_unsynced=options.allow_unsynced, **{**options.rewrite, "timeout_seconds": 0.0})
    except IndependentModelsError as exc:
        return _refused(number, exc, options, version)
    except NOTHING_TO_SYNC as exc:
        if again:
            return Decision(None, version, number)
        _record(number, "unchanged", str(exc), None)
        note(options, f"graph {number} runs unchanged: {exc}")
        return Decision(None, version, number)
    except BnRewriteError as exc:
        return _refused(number, exc, options, version)
    if previous is not None and (result.report.already_rewritten or _signature(result.report) == previous.signature):
        return Decision(previous, version, number)
    if result.report.already_rewritten:
        if again:
            return Decision(None, version, number)
        _record(number, "unchanged", "already rewritten by bnrewrite", result.report)
        note(options, f"graph {number} runs unchanged: it was already rewritten by bnrewrite")
        return Decision(None, version, number)
    if not any(row.gradients for row in result.report.layers):
        if again or previous is not None:
            return Decision(previous, version, number)
        why = ("its training batch norm has no gradient in the graph yet (a model built before its train op, e.g. "
               "Keras' compile before fit): nothing trains, so it runs as it is until gradients are added")
        _record(number, "unchanged", why, None)
        note(options, f"graph {number} runs unchanged: {why}")
        return Decision(None, version, number)
    shadow = make_shadow(count, result, number, options, config)
    report = result.report
    unsynced = ", ".join(f"{s['node']} ({s['reason']})" for s in report.skipped)
    _record(number, "synchronized", f"left unsynchronized (--allow-unsynced): {unsynced}" if unsynced else "", report)
    if options.verbose:
        note(options, f"graph {number}: " + report.text(verbose=True).removeprefix("bnrewrite: ").rstrip())
    else:
        note(options, f"graph {number}: " + report.text().splitlines()[0].removeprefix("bnrewrite: ")
              + "".join(f"; {n}" for n in report.notes))
    if unsynced:
        print(f"bnrewrite: warning: graph {number}: {len(report.skipped)} batch-norm op(s) run UNSYNCHRONIZED "
              f"(--allow-unsynced): {unsynced}", file=sys.stderr, flush=True)
    check = shadow.first_step.check if shadow.first_step is not None else None
    if check is not None and not check.layers and not check.unsynced:  # nothing the check can fetch
        not_checked = check.not_checked
        shadow.first_step = None
        record_verdict(number, {"passed": None, "not_checked": not_checked})
        note(options, f"graph {number}: nothing verified: its {len(not_checked)} layer(s) are inside function "
                       f"bodies (control flow v2), which the check cannot fetch ({', '.join(not_checked)})")
    return Decision(shadow, version, number)


def _refused(number: int, exc: BnRewriteError, options: LiveOptions, version: int) -> Decision:
    """Record and say a refusal: under allow_unsynced the graph runs as it is, else its error."""
    if options.allow_unsynced:
        _record(number, "unsynced", str(exc), None)
        print(f"bnrewrite: warning: graph {number} runs UNSYNCHRONIZED (--allow-unsynced): {exc}",
              file=sys.stderr, flush=True)
        return Decision(None, version, number)
    _record(number, "refused", str(exc), None)
    if options.exit_on_refusal:
        print(f"bnrewrite: error: graph {number} refused, the script is stopped before its first step: {exc}",
              file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code)
    raise exc


def _record(number: int, outcome: str, why: str, report: Any) -> None:
    """The graph's record, made at its first decision and brought up to date at a later one."""
    entry = {"graph": number, "outcome": outcome, "why": why, "report": report.to_dict() if report is not None else None}
    record = next((r for r in state.records if r["graph"] == number), None)
    if record is None:
        state.records.append(entry)
    else:
        record.update(entry)


def note(options: LiveOptions, text: str) -> None:
    if not options.quiet:
        print(f"bnrewrite: {text}", file=sys.stderr, flush=True)


def visible_gpus() -> int:
    """The GPUs TensorFlow sees in this process."""
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def _gpus(config: Any) -> int:
    """The GPUs a session with `config` gets: the visible ones, capped by its device_count."""
    count = visible_gpus()
    if config is not None and "GPU" in config.device_count:
        count = min(count, config.device_count["GPU"])
    return count


def _cpus(config: Any) -> int:
    """The CPU devices a session with `config` gets (TensorFlow's default: one)."""
    return config.device_count["CPU"] if config is not None and "CPU" in config.device_count else 1
