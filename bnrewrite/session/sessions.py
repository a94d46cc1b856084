"""The session layer's entry points: `enable()`, `disable()`, `enabled()`, and
`rewrite_graph(g, in_place=True)` for a tf.Graph (`attach`).

They set what sessions created from now on run (bnrewrite.session.live's `state`) and patch TensorFlow's
session class once (bnrewrite.session.patch), now if its module is loaded, else when it is
imported. Why here: `enable()` must refuse a bad option before the user's script imports
TensorFlow. Invariant: importing this module does not import TensorFlow.
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from bnrewrite.errors import AlreadyRewrittenError, BnRewriteError, IndependentModelsError
from bnrewrite.rewrite.arguments import check_arguments, check_seconds
from bnrewrite.session.bounds import START_SECONDS
from bnrewrite.session.live import NOTHING_TO_SYNC, SESSION_MODULE, Decision, LiveOptions, make_shadow, state, visible_gpus
from bnrewrite.session.patch import patch


def enable(
    *, backend: str = "auto", tower_by: str = "auto", group_size: int | None = None, timeout_seconds: float = 0.0,
    num_workers: int = 1, task_index: int = 0, allow_unsynced: bool = False, quiet: bool = False,
    verbose: bool = False, verify: bool = False, exit_on_refusal: bool = False,
    start_timeout_seconds: float = START_SECONDS,
) -> None:
    """From now on, every graph-mode session created on a graph with multi-tower training batch
    norm runs the synchronized graph (as under `bnrewrite run`); graphs with nothing to
    synchronize run unchanged, with a note on stderr unless `quiet`. A graph bnrewrite refuses
    raises its error at session creation (`exit_on_refusal`: prints it and exits with its
    code), or with `allow_unsynced` runs unchanged with a warning. `verify`: the first step of
    each rewritten graph is checked layer by layer (docs/run.md). Options: `rewrite_graph`'s, but
    `timeout_seconds` bounds every step that runs an all-reduce (0: bnrewrite.session.bounds' default),
    `start_timeout_seconds` the first such step of several workers (docs/run.md)."""
    check_arguments(backend, tower_by, group_size, timeout_seconds, num_workers, task_index)
    check_seconds("start_timeout_seconds", start_timeout_seconds, positive=True)
    rewrite = dict(backend=backend, tower_by=tower_by, group_size=group_size, timeout_seconds=timeout_seconds,
                   num_workers=num_workers, task_index=task_index)
    with state.lock:
        state.options = LiveOptions(rewrite, allow_unsynced, exit_on_refusal, quiet, verbose, verify,
                                    start_timeout=float(start_timeout_seconds))
        _install()


def disable() -> None:
    """Sessions created from now on run their graphs as they are, also graphs enable()
    synchronized (until enable() again). Sessions already created keep what they run; graphs
    given to `rewrite_graph(g, in_place=True)` stay synchronized."""
    with state.lock:
        state.options = None


@contextmanager
def enabled(**options: Any) -> Iterator[None]:
    """`enable(**options)` for the block, then the options that were in force before."""
    with state.lock:
        before = state.options
        enable(**options)
    try:
        yield
    finally:
        with state.lock:
            state.options = before


def attach(graph: Any, rewrite: Callable[[Any], Any]) -> Any:
    """Rewrite tf.Graph `graph` with `rewrite` (GraphDef -> RewriteResult, raising as
    rewrite_graph does) and make every session created on it from now on run the result."""
    with state.lock:
        decision = state.decisions.get(graph)
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
            from bnrewrite.rewrite.api import RewriteResult
            from bnrewrite.rewrite.report import Report

            print(f"bnrewrite: graph runs unchanged: {exc}", file=sys.stderr, flush=True)
            return RewriteResult(graph_def, None, Report(unchanged=str(exc)))
        state.decisions[graph] = Decision(make_shadow(count, result), graph.version, in_place=True)
        _install()
        return result


def rewrite_in_place(graph: Any, backend: str = "auto", *, available_gpus: int | None = None, **options: Any) -> Any:
    """`rewrite_graph(graph, in_place=True)` for a tf.Graph: its rewrite (the API's, with these
    arguments) becomes what every session created on it from now on runs (attach)."""
    from bnrewrite.rewrite.api import rewrite_graph

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


def _install() -> None:
    """Patch TensorFlow's session class now if its module is loaded, else when it is."""
    if state.installed:
        return
    state.installed = True
    module = sys.modules.get(SESSION_MODULE)
    if module is not None:
        patch(module)
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
        patch(module)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
