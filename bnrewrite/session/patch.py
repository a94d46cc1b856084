"""TensorFlow's session class as bnrewrite patches it: `patch(module)` wraps BaseSession's
__init__, _extend_graph, _do_run and _make_callable_from_options, so that a session created on a
graph with multi-tower training batch norm runs that graph's shadow (bnrewrite.session.live decides and
keeps it), follows the graph as it grows (a move carries the session's variables:
bnrewrite.session.carry), refuses names the rewrite removed, bounds runs that meet all-reduces
(bnrewrite.session.bounds) and, with `verify`, checks the first training step. Apart from the session
layer's entry points (bnrewrite.session.sessions), which only decide when to patch. Invariant: a session
whose graph has nothing to synchronize runs TensorFlow's own methods unchanged.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from bnrewrite.errors import UnsyncedLayerError
from bnrewrite.session.bounds import bound_seconds, met_layers, run_bounded
from bnrewrite.session.carry import carry, new_session, restarts
from bnrewrite.session.live import (
    MAY_TRAIN_BATCH_NORM, Shadow, decide, growth, late_refusal, note, record_verdict, shadow_for, state, step_config,
)

def patch(module: Any) -> None:
    base = module.BaseSession
    if getattr(base, "_bnrewrite_patched", False):
        return
    init, extend, do_run, make_callable = (base.__init__, base._extend_graph, base._do_run,
                                           base._make_callable_from_options)

    @functools.wraps(init)
    def __init__(self: Any, target: Any = "", graph: Any = None, config: Any = None) -> None:
        self._session = None  # what __del__ looks at if the decision below raises
        script_graph = graph if graph is not None else _default_graph()
        shadow = shadow_for(script_graph, config)
        if shadow is None:
            init(self, target, graph, config)
            # While enabled, it can still move to a shadow (_late_shadow); made while disabled, it runs as it is.
            self._bnrewrite_watch, self._bnrewrite_ran = state.options is not None, 0
            return
        init(self, target, shadow.graph, step_config(config, shadow))
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
        if shadow is None:
            return do_run(self, handle, target_list, fetch_list, feed_dict, options, run_metadata)
        if shadow.missing:
            shadow.refuse_missing(op.name for op in target_list)
            shadow.refuse_missing(t.op.name for t in fetch_list)
            shadow.refuse_missing((t.deref().op.name for t in feed_dict), fed=True)
        copies = shadow.copies_for([*(op.name for op in target_list), *(t.op.name for t in fetch_list)])
        if copies:
            fetch_list = [_Copy(t, copies[t.op.name], shadow) if t.op.name in copies else t for t in fetch_list]

        def run(options: Any) -> Any:
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

        layers = _meets(shadow, [op.name for op in target_list], [t.name for t in fetch_list],
                        [t.deref().name for t in feed_dict], options)
        if not layers:
            return run(options)
        seconds = bound_seconds(shadow.meetings)
        return run_bounded(shadow.meetings, layers, shadow.number, shadow.options.exit_on_refusal, seconds,
                           lambda: _with_timeout(options, seconds, run))

    @functools.wraps(make_callable)
    def _make_callable_from_options(self: Any, callable_options: Any) -> Any:
        shadow = _current(self)
        first = shadow.first_step if shadow is not None else None
        if first is not None:
            names = [name.split(":")[0] for name in (*callable_options.fetch, *callable_options.target)]
            if first.trains_with(names) and _claim(shadow, first):
                _not_verified(shadow, first, "its training step runs through a callable (make_callable, Keras' fit), "
                                             "to which the check cannot add its fetches")
        if shadow is None and not getattr(self, "_bnrewrite_watch", False):
            return make_callable(self, callable_options)  # a session that runs its graph as it is for good
        return _Following(self, callable_options, make_callable)

    base.__init__, base._extend_graph, base._do_run = __init__, _extend_graph, _do_run
    base._make_callable_from_options = _make_callable_from_options
    base._bnrewrite_patched = True


class _Copy:
    """A tensor the script fetches with a step that trains one tower alone, read from the copy of
    its op that the step runs (Shadow.copies_for): what BaseSession._do_run asks of a fetch."""

    def __init__(self, tensor: Any, copy: str, shadow: Shadow) -> None:
        self.op, self.name = tensor.op, f"{copy}:{tensor.value_index}"
        self._output = shadow.output(copy, tensor.value_index)

    def _as_tf_output(self) -> Any:
        return self._output


class _Following:
    """A callable made by `Session._make_callable_from_options` (Keras' functions) that follows its
    session to a new shadow, bounded where it meets keyed all-reduces (bnrewrite.session.bounds): TensorFlow's
    holds a handle into the TensorFlow session it was made in, which after a move is no longer the
    session's, so a call there would fail ("No such callable handle") or run another callable. Each
    call first catches the session up (moving it if its graph grew), and the callable is made again,
    with the new shadow's bound, in the session's TensorFlow session when that has changed."""

    def __init__(self, session: Any, options: Any, make: Callable[[Any, Any], Any]) -> None:
        self._session, self._options, self._make = session, options, make
        self._made_in = session._session
        self._callable, self._bound = self._made()

    def _made(self) -> tuple[Any, tuple[Shadow, frozenset[int], float] | None]:
        """TensorFlow's callable for the session's shadow now, and its bound (None: unbounded)."""
        options, shadow = self._options, getattr(self._session, "_bnrewrite_shadow", None)
        copies = shadow.copies_for(name.split(":")[0] for name in (*options.target, *options.fetch)) if shadow else {}
        if copies:  # a step training one tower alone: its fetches read the copies it runs
            options = type(options)()
            options.CopyFrom(self._options)
            options.fetch[:] = [_copy_name(name, copies) for name in options.fetch]
        layers = _meets(shadow, list(options.target), list(options.fetch), list(options.feed),
                        options.run_options.SerializeToString())
        if not layers:
            return self._make(self._session, options), None
        seconds = bound_seconds(shadow.meetings)  # a callable's run options are its own from now on
        bounded = type(options)()
        bounded.CopyFrom(options)
        bounded.run_options.timeout_in_ms = max(1, round(seconds * 1000))
        return self._make(self._session, bounded), (shadow, layers, seconds)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        session = self._session
        if session._session is not self._made_in or getattr(session, "_bnrewrite_shadow", None) is not None:
            _current(session)
        if session._session is not self._made_in:
            self._forget()
            self._callable, self._bound = self._made()
            self._made_in = session._session
        if self._bound is None:
            return self._callable(*args, **kwargs)
        shadow, layers, seconds = self._bound
        return run_bounded(shadow.meetings, layers, shadow.number, shadow.options.exit_on_refusal, seconds,
                           lambda: self._callable(*args, **kwargs))

    def _forget(self) -> None:
        """Drop a handle of a TensorFlow session the session has left (closed with it): released
        in the new one, it would release another callable made there under the same number."""
        if self._session._session is not self._made_in:
            self._callable._handle = None

    def __del__(self) -> None:
        if getattr(self, "_callable", None) is not None:
            self._forget()


def _copy_name(tensor: str, copies: dict[str, str]) -> str:
    name, colon, index = tensor.partition(":")
    return f"{copies[name]}{colon}{index}" if name in copies else tensor


def _meets(shadow: Shadow | None, ops: list[str], fetches: list[str], fed: list[str], options: Any) -> frozenset[int]:
    """The layers whose all-reduces a run meets, when bnrewrite bounds it: on a shadow with keyed
    all-reduces (enable()'s), and not given a timeout of the script's own (RunOptions.timeout_in_ms)."""
    if shadow is None or shadow.meetings is None or _run_options(options).timeout_in_ms:
        return frozenset()
    return met_layers(shadow.meetings, ops, fetches, fed)


def _run_options(options: Any) -> Any:
    """RunOptions from a TF_Buffer pointer (a run's), serialized bytes (a callable's) or None."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.client import pywrap_tf_session as tf_session

    parsed = config_pb2.RunOptions()
    if options is not None:
        parsed.ParseFromString(options if isinstance(options, bytes) else tf_session.TF_GetBuffer(options))
    return parsed


def _with_timeout(options: Any, seconds: float, run: Callable[[Any], Any]) -> Any:
    """`run` given the run's options (a TF_Buffer pointer or None) with timeout_in_ms `seconds`."""
    from tensorflow.python.client import pywrap_tf_session as tf_session

    bounded = _run_options(options)
    bounded.timeout_in_ms = max(1, round(seconds * 1000))
    buffer = tf_session.TF_NewBufferFromString(bounded.SerializeToString())
    try:
        return run(buffer)
    finally:
        tf_session.TF_DeleteBuffer(buffer)


def _current(session: Any) -> Shadow | None:
    """The shadow `session` runs now, caught up with its graph: a session on a graph that held
    nothing to synchronize moves to the graph's shadow once it has one (_late_shadow), and a
    session on a shadow replaced since (_regrow) moves to the new one with its variables."""
    shadow = getattr(session, "_bnrewrite_shadow", None)
    if shadow is None:
        return _late_shadow(session) if getattr(session, "_bnrewrite_watch", False) else None
    shadow.catch_up(session._graph)
    while shadow.replaced_by is not None and not getattr(session, "_bnrewrite_stays", False):
        moved = _move(session, shadow.replaced_by, shadow.graph, grown_from=shadow)
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
    with state.lock:
        decision = state.decisions.get(graph)
        if decision is None:  # created while bnrewrite was off
            session._bnrewrite_watch = False
            return None
        if decision.shadow is None:
            options = state.options
            if decision.version == graph.version or options is None:
                return None
            if not any(op.type in MAY_TRAIN_BATCH_NORM for op in graph.get_operations()[decision.version:]):
                decision.version = graph.version
                return None
            decision = state.decisions[graph] = decide(graph, session._config, options, again=True,
                                                       number=decision.number)
            if decision.shadow is None:
                return None
        shadow = decision.shadow
        session._bnrewrite_watch = False  # decided for good: moved to the shadow, or refused now
    return _move(session, shadow, graph)


def _move(session: Any, shadow: Shadow, old_graph: Any, grown_from: Shadow | None = None) -> Shadow | None:
    """Replace the TensorFlow session under `session` (on `old_graph`) by one on `shadow`, which
    gets the values of the variables the old one initialized when it has run (bnrewrite.session.carry).
    `grown_from`: the synchronized graph the session ran, which `shadow` replaces (the script's
    graph grew). A session holding state that cannot be carried (queues, iterators, tables) is refused."""
    from tensorflow.python.client import pywrap_tf_session as tf_session

    session._config = step_config(session._config, shadow)
    if not getattr(session, "_bnrewrite_ran", 0):
        new = new_session(session, shadow.graph)
        how = (f"{growth(grown_from, shadow)} before its session's first step: it runs the graph synchronized again "
               "from its first step" if grown_from is not None else
               "its session was created before the model: it runs the synchronized graph from its first step")
    else:
        script_ops = session._graph.get_operations()
        again, held = restarts(session._graph, script_ops[:session._bnrewrite_ran],
                               list(getattr(session, "_bnrewrite_runs", {})))
        if held:
            late_refusal(shadow.number, shadow.options, UnsyncedLayerError(
                f"it gained multi-tower training batch norm after a session on it had run, and that session holds "
                f"state other than variables ({held}) that cannot be moved to the synchronized graph; it would train "
                "unsynchronized: build the whole model, train op included, before the first session.run"))
            return None
        new, count = carry(session, old_graph, script_ops, shadow.graph, again)
        how = (f"{growth(grown_from, shadow)} after its session ran: the session moves to the graph synchronized "
               f"again, with the values of its {count} initialized variable(s)" if grown_from is not None else
               f"its session ran before the graph trained batch norm on several towers (e.g. Keras' fit after "
               f"compile): it moves to the synchronized graph with the values of its {count} initialized variable(s)")
    old, session._session = session._session, new
    tf_session.TF_CloseSession(old)
    tf_session.TF_DeleteSession(old)
    session._bnrewrite_shadow = shadow
    note(shadow.options, f"graph {shadow.number}: {how}")
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
    record_verdict(shadow.number, {"passed": None, "why": why})
    note(shadow.options, f"graph {shadow.number}: nothing verified: {why}")


def _failed(shadow: Shadow, exc: Any) -> NoReturn:
    """Record a failed check and stop the script (`bnrewrite run`) or raise it."""
    record_verdict(shadow.number, {"passed": False, "error": str(exc)})
    if shadow.options.exit_on_refusal:
        print(f"bnrewrite: error: graph {shadow.number}: the first step failed its check, the script is stopped: "
              f"{exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None
    raise exc


def _checked_step(session: Any, shadow: Shadow, first: Any, names: list[str], target_list: Any, fetch_list: Any,
                  feed_dict: Any, options: Any, run_metadata: Any) -> list[Any]:
    """The script's run, as BaseSession._do_run makes it, with the first step's check around it."""
    from bnrewrite.errors import PassError, UnsyncedLayerError

    from tensorflow.python.client import pywrap_tf_session as tf_session

    feeds = {t.deref()._as_tf_output(): v for t, v in feed_dict.items()}
    fetches = [t._as_tf_output() for t in fetch_list]
    targets = [op._c_op for op in target_list]
    step_options = _placement_options(options)  # where the towers ran: the step's partition graphs,
    step_metadata = tf_session.TF_NewBuffer() if run_metadata is None else run_metadata  # also in the script's

    def step(extra: list[Any], extra_feeds: dict[Any, Any]) -> list[Any]:
        def run() -> list[Any]:
            session._extend_graph()
            return session._call_tf_sessionrun(step_options, {**feeds, **extra_feeds}, fetches + extra, targets,
                                               step_metadata)

        return session._do_call(run)

    try:
        values, verdict = first.run(session, step, names)
        verdict.ran_on = first.check.ran_on(_partition_graphs(step_metadata))
    except (PassError, UnsyncedLayerError) as exc:
        _failed(shadow, exc)
    finally:
        tf_session.TF_DeleteBuffer(step_options)
        if run_metadata is None:
            tf_session.TF_DeleteBuffer(step_metadata)
    record_verdict(shadow.number, {"passed": True, **verdict.to_dict()})
    note(shadow.options, f"graph {shadow.number}: {verdict.line()}")
    if shadow.options.verbose:
        for layer in verdict.layers:
            note(shadow.options, f"graph {shadow.number}:   {layer.line()}")
    return values


def _placement_options(options: Any) -> Any:
    """A RunOptions buffer: the script's (a buffer or None) asking for the partition graphs too,
    which tell where soft placement ran each op."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.client import pywrap_tf_session as tf_session

    proto = config_pb2.RunOptions()
    if options is not None:
        proto.ParseFromString(tf_session.TF_GetBuffer(options))
    proto.output_partition_graphs = True
    return tf_session.TF_NewBufferFromString(proto.SerializeToString())


def _partition_graphs(metadata: Any) -> list[Any]:
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.client import pywrap_tf_session as tf_session

    return list(config_pb2.RunMetadata.FromString(tf_session.TF_GetBuffer(metadata)).partition_graphs)


def _default_graph() -> Any:
    from tensorflow.python.framework import ops

    return ops.get_default_graph()
