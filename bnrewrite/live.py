"""Sessions that run the synchronized graph of the script's own tf.Graph: `enable()`,
`rewrite_graph(g, in_place=True)` and `bnrewrite run`.

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
(RemovedByRewriteError) before the run. Importing this module does not import TensorFlow: the
session class is patched when TensorFlow's session module is first imported.
"""

from __future__ import annotations

import functools
import gc
import importlib.abc
import importlib.machinery
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from bnrewrite.arguments import check_arguments
from bnrewrite.c_graph import import_fragment, operations
from bnrewrite.carry import carry, new_session, restarts
from bnrewrite.errors import (
    AlreadyRewrittenError,
    BnRewriteError,
    IndependentModelsError,
    InferenceOnlyError,
    NoBatchNormError,
    NoTowersError,
    RemovedByRewriteError,
    UnsyncedLayerError,
)

SESSION_MODULE = "tensorflow.python.client.session"
#: What makes a graph run unchanged rather than refused: there is nothing to synchronize.
NOTHING_TO_SYNC = (NoBatchNormError, InferenceOnlyError, AlreadyRewrittenError, NoTowersError)
#: Op types that can make (or hold, in their functions) a training batch-norm layer: a graph that
#: gains one after it was decided is looked at again.
MAY_HOLD_BATCH_NORM = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "Mean", "If", "StatelessIf"})
#: ... or its gradients (Keras' fit adds them to a graph whose session compile made and ran).
MAY_TRAIN_BATCH_NORM = MAY_HOLD_BATCH_NORM | {"FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3",
                                              "Reshape"}


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
    verify: bool = False  # check the first step of each rewritten graph (bnrewrite.first_step)


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
class _Decision:
    shadow: Shadow | None
    version: int  # the script graph's version when decided
    in_place: bool = False  # rewrite_graph(g, in_place=True): synchronized whether enable() is on or not


def _regrow(script_graph: Any, shadow: Shadow) -> None:
    """Rewrite a grown graph again whole when it has batch norms or gradients of them that
    `shadow` lacks (a census tells, at the cost of an export); when the rewrite synchronizes
    otherwise than `shadow` (new layers, their gradients: a forward pass synchronized before its
    gradients existed), the new shadow replaces it, and every session on it moves there with its
    variables (_current)."""
    from bnrewrite.api import take_census
    from bnrewrite.graph import Graph

    _, _, census = take_census(Graph.from_graph_def(script_graph.as_graph_def()))
    found = {s.name: len(s.grads) for s in census.sites}
    found.update((s.node, -1) for s in (*census.skips, *census.not_run))
    if found == shadow.sites:
        return
    with _state.lock:
        decision = _decide(script_graph, shadow.config, shadow.options, again=True, previous=shadow)
        if decision.shadow is None or decision.shadow is shadow:  # as before: not again for the same census
            shadow.sites = found
        else:
            shadow.replaced_by = decision.shadow
            _state.decisions[script_graph] = decision


def _sites(report: Any) -> dict[str, int]:
    """Every training batch norm a rewrite saw: synced ones with their gradient count, others -1."""
    found = {site: -1 for site in (*(s["node"] for s in report.skipped), *report.not_run)}
    for row in report.layers:
        grads = len(row.gradients) // len(row.sites)
        found.update((site, grads) for site in row.sites)
    return found


def _signature(report: Any) -> tuple:
    """What a rewrite synchronized (each layer's sites and gradients) and skipped."""
    return (tuple((tuple(row.sites), tuple(row.gradients)) for row in report.layers),
            tuple(s["node"] for s in report.skipped))


def _late_refusal(number: int, options: LiveOptions, exc: BnRewriteError) -> None:
    """A graph found wanting after steps may have run: a warning with allow_unsynced, else the
    error (printed, and the script stopped with its code, under `bnrewrite run`)."""
    with _state.lock:
        for record in _state.records:
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


_state = _State()


def enable(
    *, backend: str = "auto", tower_by: str = "auto", group_size: int | None = None, timeout_seconds: float = 0.0,
    num_workers: int = 1, task_index: int = 0, allow_unsynced: bool = False, quiet: bool = False,
    verbose: bool = False, verify: bool = False, exit_on_refusal: bool = False,
) -> None:
    """From now on, every graph-mode session created on a graph with multi-tower training batch
    norm runs the synchronized graph (as under `bnrewrite run`); graphs with nothing to
    synchronize run unchanged, with a note on stderr unless `quiet`. A graph bnrewrite refuses
    raises its error at session creation (`exit_on_refusal`: prints it and exits with its
    code), or with `allow_unsynced` runs unchanged with a warning. `verify`: the first step of
    each rewritten graph is checked layer by layer (docs/run.md). Options: `rewrite_graph`'s."""
    check_arguments(backend, tower_by, group_size, timeout_seconds, num_workers, task_index)
    rewrite = dict(backend=backend, tower_by=tower_by, group_size=group_size, timeout_seconds=timeout_seconds,
                   num_workers=num_workers, task_index=task_index)
    with _state.lock:
        _state.options = LiveOptions(rewrite, allow_unsynced, exit_on_refusal, quiet, verbose, verify)
        _install()


def disable() -> None:
    """Sessions created from now on run their graphs as they are, also graphs enable()
    synchronized (until enable() again). Sessions already created keep what they run; graphs
    given to `rewrite_graph(g, in_place=True)` stay synchronized."""
    with _state.lock:
        _state.options = None


@contextmanager
def enabled(**options: Any) -> Iterator[None]:
    """`enable(**options)` for the block, then the options that were in force before."""
    with _state.lock:
        before = _state.options
        enable(**options)
    try:
        yield
    finally:
        with _state.lock:
            _state.options = before


def records() -> list[dict[str, Any]]:
    """One entry per graph decided so far: its outcome, why, and the rewrite's report."""
    with _state.lock:
        return list(_state.records)


def attach(graph: Any, rewrite: Callable[[Any], Any]) -> Any:
    """Rewrite tf.Graph `graph` with `rewrite` (GraphDef -> RewriteResult, raising as
    rewrite_graph does) and make every session created on it from now on run the result."""
    with _state.lock:
        decision = _state.decisions.get(graph)
        if decision is not None and decision.shadow is not None:
            cause = ("rewrite_graph(g, in_place=True) was called on it before" if decision.in_place else
                     f"enable() synchronized it at its first session, graph {decision.shadow.number}")
            raise AlreadyRewrittenError(f"sessions on this graph already run its synchronized graph ({cause})")
        open_sessions = _open_sessions(graph)
        if open_sessions:
            raise BnRewriteError(
                f"{len(open_sessions)} session(s) already exist on this graph and would go on running it unsynchronized; "
                "call rewrite_graph(g, in_place=True) before creating any session on g (or close them first)")
        graph_def = graph.as_graph_def()
        count = len(graph_def.node)
        try:
            result = rewrite(graph_def)
        except (IndependentModelsError, AlreadyRewrittenError):
            raise
        except NOTHING_TO_SYNC as exc:  # as enable() would: run it as built, and say why
            from bnrewrite.api import RewriteResult
            from bnrewrite.report import Report

            print(f"bnrewrite: graph runs unchanged: {exc}", file=sys.stderr, flush=True)
            return RewriteResult(graph_def, None, Report(unchanged=str(exc)))
        _state.decisions[graph] = _Decision(_shadow(count, result), graph.version, in_place=True)
        _install()
        return result


def rewrite_in_place(graph: Any, backend: str = "auto", *, available_gpus: int | None = None, **options: Any) -> Any:
    """`rewrite_graph(graph, in_place=True)` for a tf.Graph: its rewrite (the API's, with these
    arguments) becomes what every session created on it from now on runs (attach)."""
    from bnrewrite.api import rewrite_graph

    gpus = visible_gpus() if available_gpus is None else available_gpus
    return attach(graph, lambda graph_def: rewrite_graph(graph_def, backend, available_gpus=gpus, **options))


def _open_sessions(graph: Any) -> list[Any]:
    from tensorflow.python.client.session import BaseSession

    sessions = []
    for referrer in gc.get_referrers(graph):
        if isinstance(referrer, dict) and referrer.get("_graph") is graph and "_closed" in referrer:
            # A session whose attributes Python keeps in a dict of their own refers to the graph through it.
            sessions += [o for o in gc.get_referrers(referrer) if getattr(o, "__dict__", None) is referrer]
        else:
            sessions.append(referrer)
    return [o for o in sessions if isinstance(o, BaseSession) and not o._closed]


def _shadow(count: int, result: Any, number: int = 0, options: LiveOptions | None = None, config: Any = None) -> Shadow:
    """The shadow of a graph whose first `count` ops `result` rewrote. To be verified, it is
    imported with a Python Operation per node, which the check's ops are built on."""
    import tensorflow as tf

    from bnrewrite.first_step import FirstStep

    options = options or LiveOptions()
    shadow_graph = tf.Graph()
    first_step = None
    if options.verify:
        with shadow_graph.as_default():
            tf.graph_util.import_graph_def(result.graph_def, name="")
        first_step = FirstStep.build(shadow_graph, result)
    else:
        import_fragment(shadow_graph, result.graph_def.SerializeToString(), {}, {})
    removed = {r["node"]: f"the rewrite removed it ({r['why']})" for r in result.report.removed}
    functions = {f.signature.name for f in result.graph_def.library.function}
    return Shadow(shadow_graph, count, removed, functions, number, options, first_step, config=config,
                  signature=_signature(result.report), sites=_sites(result.report))


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
    if fragment.node:
        added = [node.name for node in fragment.node]
        existing.update(zip(added, import_fragment(shadow.graph, fragment.SerializeToString(), inputs, controls, added)))


def _install() -> None:
    """Patch TensorFlow's session class now if its module is loaded, else when it is."""
    if _state.installed:
        return
    _state.installed = True
    module = sys.modules.get(SESSION_MODULE)
    if module is not None:
        _patch(module)
    else:
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds TensorFlow's session module as the path finder would, and patches it once loaded."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != SESSION_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _patch(module)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]


def _patch(module: Any) -> None:
    base = module.BaseSession
    if getattr(base, "_bnrewrite_patched", False):
        return
    init, extend, do_run, make_callable = (base.__init__, base._extend_graph, base._do_run,
                                           base._make_callable_from_options)

    @functools.wraps(init)
    def __init__(self: Any, target: Any = "", graph: Any = None, config: Any = None) -> None:
        self._session = None  # what __del__ looks at if the decision below raises
        script_graph = graph if graph is not None else _default_graph()
        shadow = _shadow_for(script_graph, config)
        if shadow is None:
            init(self, target, graph, config)
            # While enabled, it can still move to a shadow (_late_shadow); made while disabled, it runs as it is.
            self._bnrewrite_watch, self._bnrewrite_ran = _state.options is not None, 0
            return
        init(self, target, shadow.graph, config)
        self._graph = script_graph
        self._bnrewrite_shadow = shadow

    @functools.wraps(extend)
    def _extend_graph(self: Any) -> None:  # before every run, and before a callable is made
        _current(self)
        extend(self)
        self._bnrewrite_ran = self._graph.version  # the ops it may have run: those made so far

    @functools.wraps(do_run)
    def _do_run(self: Any, handle: Any, target_list: Any, fetch_list: Any, feed_dict: Any, options: Any,
                run_metadata: Any) -> Any:
        shadow = _current(self)
        if shadow is not None or getattr(self, "_bnrewrite_watch", False):  # each kind of run once: should it
            names = tuple(op.name for op in target_list) + tuple(t.op.name for t in fetch_list)  # move (carry)
            self.__dict__.setdefault("_bnrewrite_runs", {})[names, bool(feed_dict)] = None
        if shadow is not None:
            if shadow.missing:
                shadow.refuse_missing(op.name for op in target_list)
                shadow.refuse_missing(t.op.name for t in fetch_list)
                shadow.refuse_missing((t.deref().op.name for t in feed_dict), fed=True)
            first = shadow.first_step
            if first is not None:
                names = [op.name for op in target_list] + [t.op.name for t in fetch_list]
                if first.trains_with(names) and _claim(shadow, first):
                    if handle is None:
                        return _checked_step(self, shadow, first, names, target_list, fetch_list, feed_dict, options,
                                             run_metadata)
                    _not_verified(shadow, first, "its first training step runs through partial_run, to which the "
                                                 "check cannot add its fetches")
        return do_run(self, handle, target_list, fetch_list, feed_dict, options, run_metadata)

    @functools.wraps(make_callable)
    def _make_callable_from_options(self: Any, callable_options: Any) -> Any:
        shadow = _current(self)
        first = shadow.first_step if shadow is not None else None
        if first is not None:
            names = [name.split(":")[0] for name in (*callable_options.fetch, *callable_options.target)]
            if first.trains_with(names) and _claim(shadow, first):
                _not_verified(shadow, first, "its training step runs through a callable (make_callable, Keras' fit), "
                                             "to which the check cannot add its fetches")
        return make_callable(self, callable_options)

    base.__init__, base._extend_graph, base._do_run = __init__, _extend_graph, _do_run
    base._make_callable_from_options = _make_callable_from_options
    base._bnrewrite_patched = True


def _current(session: Any) -> Shadow | None:
    """The shadow `session` runs now, caught up with its graph: a session on a graph that held
    nothing to synchronize moves to the graph's shadow once it has one (_late_shadow), and a
    session on a shadow replaced since (_regrow) moves to the new one with its variables."""
    shadow = getattr(session, "_bnrewrite_shadow", None)
    if shadow is None:
        return _late_shadow(session) if getattr(session, "_bnrewrite_watch", False) else None
    shadow.catch_up(session._graph)
    while shadow.replaced_by is not None and not getattr(session, "_bnrewrite_stays", False):
        moved = _move(session, shadow.replaced_by, shadow.graph)
        if moved is None:  # refused, --allow-unsynced: it goes on as it is
            session._bnrewrite_stays = True
            break
        shadow = moved
        shadow.catch_up(session._graph)
    return shadow


def _late_shadow(session: Any) -> Shadow | None:
    """The shadow for a session created on its graph while that held nothing to synchronize, if
    the graph has gained multi-tower training batch norm since (an InteractiveSession made before
    the model, Keras' compile before fit): the session moves to it, with the values of the
    variables it initialized if it has run (_move). None: as it is."""
    graph = session._graph
    with _state.lock:
        decision = _state.decisions.get(graph)
        if decision is None:  # created while bnrewrite was off
            session._bnrewrite_watch = False
            return None
        if decision.shadow is None:
            options = _state.options
            if decision.version == graph.version or options is None:
                return None
            if not any(op.type in MAY_TRAIN_BATCH_NORM for op in graph.get_operations()[decision.version:]):
                decision.version = graph.version
                return None
            decision = _state.decisions[graph] = _decide(graph, session._config, options, again=True)
            if decision.shadow is None:
                return None
        shadow = decision.shadow
        session._bnrewrite_watch = False  # decided for good: moved to the shadow, or refused now
    return _move(session, shadow, graph)


def _move(session: Any, shadow: Shadow, old_graph: Any) -> Shadow | None:
    """Replace the TensorFlow session under `session` (on `old_graph`) by one on `shadow`, which
    gets the values of the variables the old one initialized when it has run (bnrewrite.carry).
    A session holding state that cannot be carried (queues, iterators, tables) is refused."""
    from tensorflow.python.client import pywrap_tf_session as tf_session

    if not getattr(session, "_bnrewrite_ran", 0):
        new = new_session(session, shadow.graph)
        how = "its session was created before the model: it runs the synchronized graph from its first step"
    else:
        script_ops = session._graph.get_operations()
        again, held = restarts(session._graph, script_ops[:session._bnrewrite_ran],
                               list(getattr(session, "_bnrewrite_runs", {})))
        if held:
            _late_refusal(shadow.number, shadow.options, UnsyncedLayerError(
                f"it gained multi-tower training batch norm after a session on it had run, and that session holds "
                f"state other than variables ({held}) that cannot be moved to the synchronized graph; it would train "
                "unsynchronized: build the whole model, train op included, before the first session.run"))
            return None
        new, count = carry(session, old_graph, script_ops, shadow.graph, again)
        how = (f"its session ran before the graph trained batch norm on several towers (e.g. Keras' fit after "
               f"compile): it moves to the synchronized graph with the values of its {count} initialized variable(s)")
    old, session._session = session._session, new
    tf_session.TF_CloseSession(old)
    tf_session.TF_DeleteSession(old)
    session._bnrewrite_shadow = shadow
    _note(shadow.options, f"graph {shadow.number}: {how}")
    return shadow


def _claim(shadow: Shadow, first: Any) -> bool:
    """Take `first` as the one step to check, unless another thread took it already."""
    with shadow.lock:
        if shadow.first_step is not first:
            return False
        shadow.first_step = None
        return True


def _not_verified(shadow: Shadow, first: Any, why: str) -> None:
    """Say that graph's check saw nothing (failing first if a layer is unsynchronized)."""
    from bnrewrite.errors import UnsyncedLayerError

    try:
        first.check.require_synced()
    except UnsyncedLayerError as exc:
        _failed(shadow, exc)
    _record_verdict(shadow.number, {"passed": None, "why": why})
    _note(shadow.options, f"graph {shadow.number}: nothing verified: {why}")


def _failed(shadow: Shadow, exc: Any) -> NoReturn:
    """Record a failed check and stop the script (`bnrewrite run`) or raise it."""
    _record_verdict(shadow.number, {"passed": False, "error": str(exc)})
    if shadow.options.exit_on_refusal:
        print(f"bnrewrite: error: graph {shadow.number}: the first step failed its check, the script is stopped: "
              f"{exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None
    raise exc


def _checked_step(session: Any, shadow: Shadow, first: Any, names: list[str], target_list: Any, fetch_list: Any,
                  feed_dict: Any, options: Any, run_metadata: Any) -> list[Any]:
    """The script's run, as BaseSession._do_run makes it, with the first step's check around it."""
    from bnrewrite.errors import PassError, UnsyncedLayerError

    feeds = {t.deref()._as_tf_output(): v for t, v in feed_dict.items()}
    fetches = [t._as_tf_output() for t in fetch_list]
    targets = [op._c_op for op in target_list]

    def step(extra: list[Any], extra_feeds: dict[Any, Any]) -> list[Any]:
        def run() -> list[Any]:
            session._extend_graph()
            return session._call_tf_sessionrun(options, {**feeds, **extra_feeds}, fetches + extra, targets, run_metadata)

        return session._do_call(run)

    try:
        values, verdict = first.run(session, step, names)
    except (PassError, UnsyncedLayerError) as exc:
        _failed(shadow, exc)
    _record_verdict(shadow.number, {"passed": True, **verdict.to_dict()})
    _note(shadow.options, f"graph {shadow.number}: {verdict.line()}")
    if shadow.options.verbose:
        for layer in verdict.layers:
            _note(shadow.options, f"graph {shadow.number}:   {layer.line()}")
    return values


def _record_verdict(number: int, verdict: dict[str, Any]) -> None:
    with _state.lock:
        for record in _state.records:
            if record["graph"] == number:
                record["verify"] = verdict


def _default_graph() -> Any:
    from tensorflow.python.framework import ops

    return ops.get_default_graph()


def _shadow_for(graph: Any, config: Any) -> Shadow | None:
    """The shadow a new session on `graph` runs, deciding (rewriting) at the graph's first
    session, or again at a later one if it ran unchanged and has grown since; None: as it is
    (also a graph enable() synchronized, while disabled)."""
    from tensorflow.python.framework import ops

    if not isinstance(graph, ops.Graph):
        return None
    with _state.lock:
        decision = _state.decisions.get(graph)
        options = _state.options
        if decision is not None and decision.shadow is not None:
            return decision.shadow if decision.in_place or options is not None else None
        if options is None or (decision is not None and decision.version == graph.version):
            return None
        decision = _decide(graph, config, options)
        _state.decisions[graph] = decision
        return decision.shadow


def _decide(graph: Any, config: Any, options: LiveOptions, again: bool = False,
            previous: Shadow | None = None) -> _Decision:
    """Rewrite `graph` for its session; `again`: looked at again after it grew, so a graph that
    still has nothing to synchronize gets no second record or line; `previous`: the shadow it
    had, kept (no record or line) when the rewrite synchronizes the same layers."""
    from bnrewrite.api import rewrite_graph

    number = len(_state.records) + 1
    version = graph.version
    graph_def = graph.as_graph_def()
    count = len(graph_def.node)
    try:
        result = rewrite_graph(graph_def, in_place=True, if_rewritten="keep", available_gpus=_gpus(config),
                               allow_unsynced=options.allow_unsynced, **options.rewrite)
    except IndependentModelsError as exc:
        return _refused(number, exc, options, version)
    except NOTHING_TO_SYNC as exc:
        if again:
            return _Decision(None, version)
        _record(number, "unchanged", str(exc), None)
        _note(options, f"graph {number} runs unchanged: {exc}")
        return _Decision(None, version)
    except BnRewriteError as exc:
        return _refused(number, exc, options, version)
    if previous is not None and (result.report.already_rewritten or _signature(result.report) == previous.signature):
        return _Decision(previous, version)
    if result.report.already_rewritten:
        if again:
            return _Decision(None, version)
        _record(number, "unchanged", "already rewritten by bnrewrite", result.report)
        _note(options, f"graph {number} runs unchanged: it was already rewritten by bnrewrite")
        return _Decision(None, version)
    if not any(row.gradients for row in result.report.layers):
        if again or previous is not None:
            return _Decision(previous, version)
        why = ("its training batch norm has no gradient in the graph yet (a model built before its train op, e.g. "
               "Keras' compile before fit): nothing trains, so it runs as it is until gradients are added")
        _record(number, "unchanged", why, None)
        _note(options, f"graph {number} runs unchanged: {why}")
        return _Decision(None, version)
    shadow = _shadow(count, result, number, options, config)
    report = result.report
    unsynced = ", ".join(f"{s['node']} ({s['reason']})" for s in report.skipped)
    _record(number, "synchronized", f"left unsynchronized (--allow-unsynced): {unsynced}" if unsynced else "", report)
    if options.verbose:
        _note(options, f"graph {number}: " + report.text().removeprefix("bnrewrite: ").rstrip())
    else:
        _note(options, f"graph {number}: " + report.text().splitlines()[0].removeprefix("bnrewrite: ")
              + "".join(f"; {n}" for n in report.notes))
    if unsynced:
        print(f"bnrewrite: warning: graph {number}: {len(report.skipped)} batch-norm op(s) run UNSYNCHRONIZED "
              f"(--allow-unsynced): {unsynced}", file=sys.stderr, flush=True)
    check = shadow.first_step.check if shadow.first_step is not None else None
    if check is not None and not check.layers and not check.unsynced:  # nothing the check can fetch
        not_checked = check.not_checked
        shadow.first_step = None
        _record_verdict(number, {"passed": None, "not_checked": not_checked})
        _note(options, f"graph {number}: nothing verified: its {len(not_checked)} layer(s) are inside function "
                       f"bodies (control flow v2), which the check cannot fetch ({', '.join(not_checked)})")
    return _Decision(shadow, version)


def _refused(number: int, exc: BnRewriteError, options: LiveOptions, version: int) -> _Decision:
    if options.allow_unsynced:
        _record(number, "unsynced", str(exc), None)
        print(f"bnrewrite: warning: graph {number} runs UNSYNCHRONIZED (--allow-unsynced): {exc}",
              file=sys.stderr, flush=True)
        return _Decision(None, version)
    _record(number, "refused", str(exc), None)
    if options.exit_on_refusal:
        print(f"bnrewrite: error: graph {number} refused, the script is stopped before its first step: {exc}",
              file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code)
    raise exc


def _record(number: int, outcome: str, why: str, report: Any) -> None:
    _state.records.append({"graph": number, "outcome": outcome, "why": why,
                           "report": report.to_dict() if report is not None else None})


def _note(options: LiveOptions, text: str) -> None:
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
