"""Bounded meetings: under `bnrewrite run` / `enable()` no synchronized step waits forever.

A run of a shadow session that reaches a keyed all-reduce (NCCL, the collective runtime, queues
on a parameter server: a "meeting") gets TensorFlow's RunOptions.timeout_in_ms: the script's
`timeout_seconds`, else DEFAULT_SECONDS; the first meeting of a several-worker graph in a process
waits as long as TensorFlow's own session start waits for its peers (START_SECONDS,
MonitoredTrainingSession's max_wait_secs, or `start_timeout_seconds`), as workers start at
different times. A run TensorFlow stops there ends as one line naming the layer, the towers and
the causes (StepTimeoutError, exit 13); a run TensorFlow does not return from (NCCL, a follower
retrying an absent leader) is ended by a watchdog GRACE_SECONDS later with the same line.
Local sums are ordinary ops and never wait: they are not meetings. Importing this module does
not import TensorFlow.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from bnrewrite.errors import StepTimeoutError

#: A meeting's bound without `timeout_seconds` (--timeout).
DEFAULT_SECONDS = 600.0
#: The first meeting of a several-worker graph: as long as MonitoredTrainingSession's workers wait for their peers.
START_SECONDS = 7200.0
#: How long after its bound a run TensorFlow has not returned from is ended by the watchdog.
GRACE_SECONDS = 10.0


@dataclass
class Meetings:
    """A shadow's keyed all-reduces: outer node -> the layers whose all-reduces it runs (itself,
    or inside the functions it calls), and what the one-line stop says about them."""

    nodes: dict[str, frozenset[int]]
    inputs: dict[str, list[str]]  # node -> its inputs as the GraphDef gives them ("x", "x:1", "^x")
    layers: list[str]  # report row order: the instance key's layer index
    towers: list[str]
    num_workers: int = 1
    task_index: int = 0
    seconds: float = DEFAULT_SECONDS
    start_seconds: float = START_SECONDS
    runs: dict[Any, frozenset[int]] = field(default_factory=dict)  # run kind -> the layers it meets

    def learn(self, nodes: Iterable[Any]) -> None:
        """Ops copied into the shadow since (NodeDefs): runs may reach meetings through them."""
        self.inputs.update((node.name, list(node.input)) for node in nodes)


#: Set once a meeting completed in this process: the peers have all started.
_met = threading.Event()


def meetings(graph_def: Any, report: Any, rewrite: dict[str, Any], start_seconds: float) -> Meetings | None:
    """The meetings of a rewritten graph (None: local sums, nothing waits) under run's options."""
    from bnrewrite.rewrite.collectives import INSTANCE_ATTR
    from bnrewrite.rewrite.plan import KEYS_PER_LAYER, Options

    if report.backend == "local":
        return None
    base = Options().instance_key_base
    inside: dict[str, set[int]] = {f.signature.name: {(n.attr[INSTANCE_ATTR].i - base) // KEYS_PER_LAYER
                                                       for n in f.node_def if INSTANCE_ATTR in n.attr}
                                   for f in graph_def.library.function}
    calls = {f.signature.name: {c for n in f.node_def for c in _called(n)} for f in graph_def.library.function}
    changed = True
    while changed:  # functions calling functions that meet
        changed = False
        for name, callees in calls.items():
            more = set().union(*(inside.get(c, set()) for c in callees)) - inside[name]
            if more:
                inside[name] |= more
                changed = True
    nodes = {}
    for node in graph_def.node:
        layers = {(node.attr[INSTANCE_ATTR].i - base) // KEYS_PER_LAYER} if INSTANCE_ATTR in node.attr else set()
        layers = layers.union(*(inside.get(c, set()) for c in _called(node)))
        if layers:
            nodes[node.name] = frozenset(layers)
    inputs = {node.name: list(node.input) for node in graph_def.node}
    return Meetings(nodes, inputs, [row.layer for row in report.layers], list(report.towers), rewrite.get("num_workers", 1),
                    rewrite.get("task_index", 0), rewrite.get("timeout_seconds") or DEFAULT_SECONDS, start_seconds)


def _called(node: Any) -> Iterable[str]:
    for value in node.attr.values():
        if value.HasField("func"):
            yield value.func.name
        yield from (f.name for f in value.list.func)


def met_layers(found: Meetings, ops: Iterable[str], fetches: Iterable[str], fed: Iterable[str]) -> frozenset[int]:
    """The layers a run of ops `ops` and tensors `fetches` ("x:0"), fed tensors `fed`, meets."""
    fed = frozenset(fed)
    key = (tuple(ops), tuple(fetches), fed)
    if key in found.runs:
        return found.runs[key]
    seen: set[str] = set()
    layers: set[int] = set()
    stack = [*key[0], *(name.split(":")[0] for name in key[1] if name not in fed)]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        layers |= found.nodes.get(name, frozenset())
        for edge in found.inputs.get(name, ()):
            source, _, index = edge.lstrip("^").partition(":")
            if edge.startswith("^") or f"{source}:{index or 0}" not in fed:
                stack.append(source)
    found.runs[key] = frozenset(layers)
    return found.runs[key]


def bound_seconds(found: Meetings) -> float:
    """This run's bound: the first meeting of several workers waits as long as their start may take."""
    if found.num_workers > 1 and not _met.is_set():
        return max(found.seconds, found.start_seconds)
    return found.seconds


def stop_line(found: Meetings, layers: frozenset[int], seconds: float, number: int) -> str:
    """What the script is stopped with: the layer first met, the towers, the bound and the causes."""
    first = min(layers)
    name = found.layers[first] if first < len(found.layers) else f"layer {first}"
    more = f" (and {len(layers) - 1} more layer(s))" if len(layers) > 1 else ""
    towers = ", ".join(found.towers)
    if found.num_workers > 1:
        where = (f"towers {towers} of worker {found.task_index} and the {found.num_workers - 1} other worker(s)")
        cause = ("another worker never joined: it died, has not started, or was given the same --task-index "
                 f"{found.task_index}" if not _met.is_set() else
                 "another worker stopped answering: it died or hangs")
    else:
        where = f"towers {towers}"
        cause = ("some tower's member did not run: fetch what every tower feeds (the train op) and feed every "
                 "tower's inputs")
    return (f"graph {number}: a step waited {seconds:g} s at the all-reduce of batch-norm layer {name}{more} across "
            f"{where} and was stopped: {cause} (bound: --timeout / timeout_seconds"
            + (", --start-timeout / start_timeout_seconds for the first meeting" if found.num_workers > 1 else "")
            + ")")


def run_bounded(found: Meetings, layers: frozenset[int], number: int, exit_on_stop: bool, seconds: float,
                run: Callable[[], Any]) -> Any:
    """`run()` (a session run TensorFlow bounds by `seconds`), watched: a DeadlineExceededError at
    the bound becomes the one-line stop; a run that does not return GRACE_SECONDS later ends the process."""
    import tensorflow as tf

    line = stop_line(found, layers, seconds, number)
    start = time.monotonic()
    watch = threading.Timer(seconds + GRACE_SECONDS, _end_process, (line,))
    watch.daemon = True
    watch.start()
    try:
        result = run()
    except tf.errors.DeadlineExceededError:
        if time.monotonic() - start < seconds * 0.99:  # a deadline of the script's own, not the bound's
            raise
        if exit_on_stop:
            print(f"bnrewrite: error: {line}", file=sys.stderr, flush=True)
            raise SystemExit(StepTimeoutError.exit_code) from None
        raise StepTimeoutError(line) from None
    finally:
        watch.cancel()
    _met.set()
    return result


def _end_process(line: str) -> None:
    """TensorFlow did not return from the run (it does not cancel it): say why and end the process."""
    sys.stdout.flush()
    print(f"bnrewrite: error: {line}; TensorFlow did not return from the step, the process is ended",
          file=sys.stderr, flush=True)
    os._exit(StepTimeoutError.exit_code)
