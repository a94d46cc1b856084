"""What a graph does, read from the graph alone, and the check that a rewrite kept it.

A rewrite can leave a graph that imports and runs but trains differently (a train op that no
longer waits on any moving-average update). So after the passes, and apart from them, the
rewritten graph's effects are compared with the input's:

1. every target (a node nothing reads, or one that waits on an update: train ops, groups)
   still runs every writer of a variable it ran, but those removed as duplicates, and, for
   the moving averages the towers share, exactly one of the towers' updates per layer group
   (a target may come to run more: synchronized towers wait on each other);
2. every inserted all-reduce has one member per tower of its group, and a step (a target
   that ran every tower's batch-norm gradients: the train op) runs every member of every
   all-reduce (a member left out hangs the step);
3. a batch-norm gradient that waited on no update waits on none (the backward is not held
   up behind moving averages).

The effects are reachability over data and control edges, as bit sets pushed forward in
topological order from the nodes of interest only. Flattened function bodies (control flow
v2 branches) are left out: their edges to the graph around them are not data edges here.
A violation is a PassError (a bug).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from bnrewrite.errors import PassError
from bnrewrite.graph.index import Graph, NodeDef
from bnrewrite.match.updates import writers
from bnrewrite.rewrite.collectives import GATHER_ROWS, INSTANCE_ATTR, QUEUES_ATTR
from bnrewrite.rewrite.functions import in_body
from bnrewrite.rewrite.plan import Plan

#: How many offending nodes a message names.
_SHOWN = 3


@dataclass(frozen=True)
class Effects:
    """target -> {variable: the writers of it that the target runs, once each per step}; the
    steps: targets that run every tower's batch-norm gradients; each batch-norm gradient op ->
    the variables whose writers it waits on."""

    updates: dict[str, dict[str, set[str]]]
    steps: frozenset[str]
    gradient_waits: dict[str, frozenset[str]]


def _reach(graph: Graph, seeds: list[str]) -> dict[str, int]:
    """node -> bit set of the seeds it runs after (bit i: seeds[i]; a seed reaches itself),
    for the descendants of the seeds only."""
    consumers = graph.consumers
    below = graph.downstream(seeds)
    masks = {seed: 1 << i for i, seed in enumerate(seeds)}
    for name in graph.sorted_topologically(below):
        mask = masks.get(name)
        if mask:
            for reader in consumers.get(name, ()):
                masks[reader] = masks.get(reader, 0) | mask
    return masks


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def effects(graph: Graph, grads: list[str], targets: Iterable[str] | None = None) -> Effects:
    """The effects of `targets` (default: nodes nothing reads, or that wait on a writer, and
    that run a writer) and of the gradient ops `grads`; steps are found among the default
    targets only (the input's)."""
    written = {name: v for name, v in writers(graph).items() if not in_body(name)}
    seeds = list(written)
    masks = _reach(graph, seeds)
    find_steps = targets is None
    if targets is None:
        consumers = graph.consumers
        waiting = {reader for w in seeds for reader in consumers.get(w, ())}
        targets = [name for name in masks if (name not in consumers or name in waiting) and not in_body(name)]
    updates: dict[str, dict[str, set[str]]] = {}
    for target in targets:
        if target in graph and masks.get(target):
            ran = updates[target] = {}
            for i in _bits(masks[target]):
                ran.setdefault(written[seeds[i]], set()).add(seeds[i])
    grads = [g for g in grads if g in graph and not in_body(g)]
    waits = {g: frozenset(written[seeds[i]] for i in _bits(masks.get(g, 0))) for g in grads}
    steps: frozenset[str] = frozenset()
    if grads and find_steps:
        every = (1 << len(grads)) - 1
        below = _reach(graph, grads)
        steps = frozenset(t for t in updates if below.get(t, 0) == every)
    return Effects(updates, steps, waits)


def gradient_ops(plan: Plan) -> list[str]:
    """Every synced site's gradient ops, in every tower (what the steps are recognized by)."""
    return [g for group in plan.groups for site in group.sites for g in (*site.grads, *site.variance_grads)]


def shared_statistics(plan: Plan) -> dict[str, list[set[str]]]:
    """Moving-average variables that several towers' sites of one layer group update -> the
    updates of each such group (a layer each tower applies twice: two groups, two updates)."""
    writers_of: dict[tuple[int, str], set[str]] = {}
    for layer, group in enumerate(plan.groups):
        for site in group.sites:
            for update in site.updates:
                writers_of.setdefault((layer, update.variable), set()).add(update.node)
    shared: dict[str, list[set[str]]] = {}
    for (_, variable), nodes in writers_of.items():
        if len(nodes) > 1:
            shared.setdefault(variable, []).append(nodes)
    return shared


def check_meaning(before: Effects, after_graph: Graph, plan: Plan, removed: set[str]) -> None:
    """Raise PassError when the rewritten graph does not do what `before` (the input's
    effects) did; `removed`: the nodes the passes removed on purpose."""
    after = effects(after_graph, list(before.gradient_waits), before.updates)
    shared = shared_statistics(plan)
    elsewhere = {v for v in shared if plan.updated_by_worker_0(after_graph, v)}
    lost = [t for t in before.updates if t not in after_graph and t not in removed]
    _fail_if("a target of the input is gone", lost)
    wrong = []
    for target, ran in before.updates.items():
        if target not in after_graph:
            continue
        now = after.updates.get(target, {})
        for variable in ran.keys() | now.keys():
            was, runs = ran.get(variable, set()), now.get(variable, set())
            gone = was - removed - runs
            if gone:
                wrong.append(f"{target} no longer runs {', '.join(sorted(gone)[:_SHOWN])}, which update(s) {variable}")
            elif variable in shared and variable not in elsewhere:
                for nodes in shared[variable]:
                    count = len(runs & nodes)
                    if count > 1 or not count and was & nodes:
                        wrong.append(f"{target} runs {count} of the towers' updates of {variable} per step")
    _fail_if("every target runs what it ran before and one update per shared moving average and layer group", wrong)
    waits = [f"{g} now waits on updates of {', '.join(sorted(after.gradient_waits[g]))}"
             for g, was in before.gradient_waits.items() if not was and after.gradient_waits.get(g)]
    _fail_if("a batch-norm gradient that waited on no update waits on none", waits)
    _check_all_reduces(after_graph, sorted(t for t in before.steps if t in after_graph), plan.options.num_workers)


def _check_all_reduces(graph: Graph, steps: list[str], workers: int) -> None:
    """Every all-reduce has as many members here as its group has towers in this graph, and
    every step runs every member of every all-reduce."""
    groups: dict[str, list[str]] = {}
    sizes: dict[str, set[int]] = {}
    for node in graph:
        if INSTANCE_ATTR in node.attr and not in_body(node.name):
            key, size = _group(graph, node)
            groups.setdefault(key, []).extend(_members(graph, node))
            sizes.setdefault(key, set()).add(size)
    _fail_if("every all-reduce has one member per tower of its group", [
        f"{key} has {len(groups[key])} member(s) here, for a group of {' or '.join(map(str, sorted(sizes[key])))} "
        f"over {workers} worker(s)"
        for key in groups if len(sizes[key]) > 1 or len(groups[key]) * workers != min(sizes[key])])
    members = [name for names in groups.values() for name in names]
    masks = _reach(graph, members)
    every = (1 << len(members)) - 1
    partial = []
    for step in steps:
        mask = masks.get(step, 0)
        if mask != every:
            missing = [member for i, member in enumerate(members) if not mask >> i & 1]
            partial.append(f"{step} does not run {', '.join(missing[:_SHOWN])}")
    _fail_if("a step runs every tower's member of every all-reduce", partial)


def _group(graph: Graph, node: NodeDef) -> tuple[str, int]:
    """The all-reduce a member belongs to (NCCL's shared name, a collective's group and instance
    keys, a "ps" member's queues, a local sum's own name) and how many members it has over all workers."""
    if node.op == "NcclAllReduce":
        return node.attr["shared_name"].s.decode(), node.attr["num_devices"].i
    if node.op == "CollectiveReduceV2":
        size, group = (graph.node(graph.producer(node.name, slot)[0]).attr["value"].tensor.int_val[0] for slot in (1, 2))
        return f"collective group {group} instance {node.attr[INSTANCE_ATTR].i}", size
    return (node.attr[QUEUES_ATTR].s.decode() if QUEUES_ATTR in node.attr else node.name), node.attr["N"].i // _rows(node)


def _members(graph: Graph, node: NodeDef) -> list[str]:
    """The nodes of an all-reduce's members here: a local sum's inputs (one per tower), a local
    gather's first row of each tower, else the node."""
    if node.op not in ("AddN", "Pack") or QUEUES_ATTR in node.attr:
        return [node.name]
    return [graph.producer(node.name, slot)[0] for slot in range(0, node.attr["N"].i, _rows(node))]


def _rows(node: NodeDef) -> int:
    """The inputs each member gives a local all-reduce: GATHER_ROWS to a gather (a Pack), 1 to a sum."""
    return GATHER_ROWS if node.op == "Pack" else 1


def _fail_if(invariant: str, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise PassError(
            f"the rewrite changed what the graph does: {invariant} does not hold: "
            f"{'; '.join(problems[:_SHOWN])}{more} (a bnrewrite bug; please report it)"
        )
