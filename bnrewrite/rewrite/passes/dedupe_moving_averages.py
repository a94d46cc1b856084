"""Exactly one moving-average update per statistics variable and layer group per step.

After `sync_forward` every tower's batch statistics are the global ones, so when K towers
update the same shared variable, one update (the first tower's) is the right one and the
other K-1 are removed (a layer each tower applies m times keeps m, one per application, as
one device running it m times would), together with the arithmetic that only fed them and
the reads that only waited on them. Every edge to a removed update, data or control, moves to the kept
update of the same variable: a target that ran any tower's update of a variable (the first
tower's, the last one's, all of them) runs the kept one, once. Towers that own their own
copy of a statistic keep their update: each copy gets the global value.

In a parameter-server cluster (backend "ps") every worker's towers update the statistics
the ps holds, each with the same global value: worker 0 keeps its update, the other workers
remove theirs; what read such an update's output reads the variable itself.

What a removed update waited for, the kept one now waits for: batch renormalization makes
each tower's update of renorm_mean and renorm_stddev wait (control edges in the update's
value chain) for that tower's r and d, which read the old values; the kept update stands
for every tower, so it waits for every tower's r and d, as the one device's update does.
"""

from __future__ import annotations

from collections import defaultdict

from tensorflow.python.framework import op_def_registry

from bnrewrite.graph.edit import Editor
from bnrewrite.graph.index import Graph
from bnrewrite.graph.names import parse_input, tensor_name
from bnrewrite.match.updates import ASSIGN_OPS
from bnrewrite.rewrite.passes.record import PassRecord
from bnrewrite.rewrite.plan import Plan

#: Ops that are never removed, whatever their consumers.
_KEEP = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault", "VarHandleOp", "VariableV2", "Variable"})
#: Stateful ops that are still safe to drop once only removed updates read them: reads, and
#: the assigns of a duplicate update's own bookkeeping (zero-debias's `local_step`).
_DROPPABLE_STATEFUL = frozenset({"ReadVariableOp"}) | ASSIGN_OPS


def dedupe_moving_averages(graph: Graph, plan: Plan) -> tuple[Graph, PassRecord]:
    record = PassRecord("dedupe_moving_averages")
    writers: dict[tuple[int, str], list[str]] = defaultdict(list)  # (layer group, variable) -> its updates
    listed: set[str] = set()
    for layer, group in enumerate(plan.groups):
        for site in group.sites:
            for update in site.updates:
                if update.node in graph and update.node not in listed:
                    listed.add(update.node)
                    writers[layer, update.variable].append(update.node)
    doomed: dict[str, str] = {}
    keeper: dict[str, str] = {}
    elsewhere: set[str] = set()  # variables another worker updates
    for (_, variable), nodes in writers.items():
        if plan.updated_by_worker_0(graph, variable):
            doomed.update(dict.fromkeys(nodes, f"update of {variable}, which the parameter server holds for every "
                                               f"worker; worker 0 updates it, worker {plan.options.task_index} does not"))
            keeper.update(dict.fromkeys(nodes, variable))
            elsewhere.add(variable)
            continue
        for extra in nodes[1:]:
            doomed[extra] = f"duplicate update of {variable}; {nodes[0]} is kept"
            keeper[extra] = nodes[0]
    if not doomed:
        return graph, record
    editor = Editor(graph)
    removed = _with_exclusive_ancestors(graph, doomed)
    _rewire_consumers(graph, editor, removed, keeper, elsewhere)
    for name, why in removed.items():
        editor.remove(name)
        record.removed.append((name, why))
    kept = {update: other for update, other in keeper.items() if other not in elsewhere}
    record.control_edges = _inherit_waits(graph, editor, kept, removed)
    return editor.finish(), record


def _inherit_waits(graph: Graph, editor: Editor, keeper: dict[str, str], removed: dict[str, str]) -> int:
    """Make each kept update wait for what the removed updates it stands for, and the removed
    nodes that computed their values, waited for (their control inputs from nodes that stay);
    how many edges that added. A node that runs after the kept update is left out: waiting for
    it would close a cycle. One reachability sweep answers that for every kept update."""
    inherited = [(kept, _chain_waits(graph, update, removed)) for update, kept in keeper.items()]
    waiting = {kept for kept, waits in inherited if waits}
    if not waiting:
        return 0
    after = graph.ancestors_among({w[1:] for _, waits in inherited for w in waits}, waiting)
    added = 0
    for kept, waits in inherited:
        waits = {w for w in waits - set(editor.node(kept).input) if kept not in after[w[1:]]}
        if waits:
            editor.mutable(kept).input.extend(sorted(waits))
            added += len(waits)
    return added


def _chain_waits(graph: Graph, update: str, removed: dict[str, str]) -> set[str]:
    """The control inputs (`^name`) from nodes that stay of the removed `update` and of the
    removed nodes that computed its value."""
    chain, stack = {update}, [update]
    while stack:
        for src, _ in graph.inputs(stack.pop()):
            if src in removed and src not in chain:
                chain.add(src)
                stack.append(src)
    return {spec for node in chain for spec in graph.node(node).input if spec.startswith("^") and spec[1:] not in removed}


def _rewire_consumers(
    graph: Graph, editor: Editor, removed: dict[str, str], keeper: dict[str, str], elsewhere: set[str],
) -> None:
    """Point every edge to a removed update at the kept update of the same variable, so that
    whatever ran an update of a variable before (a train op that groups any tower's updates,
    a separate group, `with_dependencies`) runs the kept one. A control edge that would close
    a cycle (the kept update already runs after the reader) is dropped, and so is one to an
    update another worker keeps (its keeper is the variable `elsewhere` names: data edges read it).

    One pass over the inputs of each node that stays and reads a removed update (a train_op
    can wait on thousands of them), and one reachability sweep for every edge that may close
    a cycle.
    """
    readers = dict.fromkeys(r for name in keeper for r in graph.consumers.get(name, ()) if r not in removed)
    rewired: dict[str, tuple[list[str], list[str]]] = {}
    for reader in readers:
        inputs, waits = [], set()
        for spec in graph.node(reader).input:
            src, output = parse_input(spec)
            if src not in keeper:
                inputs.append(spec)
            elif output >= 0:
                inputs.append(tensor_name(keeper[src], output))
            elif keeper[src] not in elsewhere:
                waits.add(keeper[src])
        present = {parse_input(spec)[0] for spec in inputs}
        rewired[reader] = inputs, sorted(waits - present)
    after = graph.ancestors_among(
        {kept for _, waits in rewired.values() for kept in waits}, [r for r, (_, waits) in rewired.items() if waits])
    for reader, (inputs, waits) in rewired.items():
        inputs.extend(f"^{kept}" for kept in waits if reader not in after[kept])
        node = editor.mutable(reader)
        del node.input[:]
        node.input.extend(inputs)


def _removable(graph: Graph, name: str) -> bool:
    node = graph.node(name)
    if node.op in _KEEP:
        return False
    if node.op in _DROPPABLE_STATEFUL:
        return True
    op_def = op_def_registry.get(node.op)
    return op_def is not None and not op_def.is_stateful


def _with_exclusive_ancestors(graph: Graph, doomed: dict[str, str]) -> dict[str, str]:
    """The doomed updates plus every node that only they (transitively) consumed.

    Also takes the reads nothing reads that only waited on a node removed here
    (`ReadVariableOp [v, ^update]`: the value an assign returns, unused), so the assigns of
    a duplicate update's bookkeeping (zero-debias's `local_step`) go with it.
    """
    reads: dict[str, dict[str, str]] = {}  # a node read by every tower is met once per tower

    def dead_reads(name: str) -> dict[str, str]:
        if name not in reads:
            reads[name] = _dead_reads(graph, name)
        return reads[name]

    removed = dict(doomed)
    for name in doomed:
        removed.update(dead_reads(name))
    stack = list(removed)
    while stack:
        name = stack.pop()
        for spec in graph.node(name).input:
            src, _ = parse_input(spec)
            if src in removed or src not in graph or not _removable(graph, src):
                continue
            dead = dead_reads(src)
            if all(reader in removed or reader in dead for reader in graph.consumers.get(src, ())):
                removed[src] = f"only fed {name}, which was removed"
                removed.update(dead)
                stack.append(src)
    return removed


def _dead_reads(graph: Graph, name: str) -> dict[str, str]:
    """Reads of a variable that wait on `name` and that nothing reads, with why they go."""
    found = {}
    for reader in graph.consumers.get(name, ()):
        waiting = graph.node(reader)
        if waiting.op == "ReadVariableOp" and f"^{name}" in waiting.input and reader not in graph.consumers:
            found[reader] = f"read only after {name}, which was removed"
    return found
