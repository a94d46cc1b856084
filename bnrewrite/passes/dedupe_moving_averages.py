"""Exactly one moving-average update per statistics variable per step.

After `sync_forward` every tower's batch statistics are the global ones, so when K towers
update the same shared variable, one update (the first tower's) is the right one and the
other K-1 are removed, together with the arithmetic that only fed them and the reads that
only waited on them. Control edges to removed ops are dropped (e.g. `tf.group` of all
towers' UPDATE_OPS); a data edge is moved to the kept update of the same variable. Towers
that own their own copy of a statistic keep their update: each copy gets the global value.
"""

from __future__ import annotations

from collections import defaultdict

from tensorflow.python.framework import op_def_registry

from bnrewrite.graph import Editor, Graph, parse_input, tensor_name
from bnrewrite.passes.record import PassRecord
from bnrewrite.plan import Plan

#: Ops that are never removed, whatever their consumers.
_KEEP = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault", "VarHandleOp", "VariableV2", "Variable"})
#: Stateful ops that are still safe to drop once nothing reads them.
_DROPPABLE_STATEFUL = frozenset({"ReadVariableOp"})


def dedupe_moving_averages(graph: Graph, plan: Plan) -> tuple[Graph, PassRecord]:
    record = PassRecord("dedupe_moving_averages")
    writers: dict[str, list[str]] = defaultdict(list)
    for group in plan.groups:
        for site in group.sites:
            for update in site.updates:
                if update.node in graph and update.node not in writers[update.variable]:
                    writers[update.variable].append(update.node)
    doomed: dict[str, str] = {}
    keeper: dict[str, str] = {}
    for variable, nodes in writers.items():
        for extra in nodes[1:]:
            doomed[extra] = f"duplicate update of {variable}; {nodes[0]} is kept"
            keeper[extra] = nodes[0]
    if not doomed:
        return graph, record
    editor = graph.edit()
    _rewire_consumers(graph, editor, doomed, keeper)
    for name, why in _with_exclusive_ancestors(graph, doomed).items():
        editor.remove(name)
        record.removed.append((name, why))
    return editor.finish(), record


def _rewire_consumers(graph: Graph, editor: Editor, doomed: dict[str, str], keeper: dict[str, str]) -> None:
    """Drop control edges to doomed updates; point data edges at the kept update."""
    dropped: dict[str, set[str]] = defaultdict(set)  # consumer -> control inputs to drop
    for name in doomed:
        for edge in graph.consumers_of(name):
            if edge.consumer in doomed:
                continue
            if edge.slot < 0:
                dropped[edge.consumer].add(f"^{name}")
            else:
                editor.mutable(edge.consumer).input[edge.slot] = tensor_name(keeper[name], edge.output)
    for consumer, controls in dropped.items():  # one pass per consumer: a train_op can wait on thousands
        node = editor.mutable(consumer)
        kept = [spec for spec in node.input if spec not in controls]
        del node.input[:]
        node.input.extend(kept)


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

    Also takes reads that only waited on a doomed update (`ReadVariableOp [v, ^update]`)
    and that nothing else reads.
    """
    removed = dict(doomed)
    for name in doomed:
        for edge in graph.consumers_of(name, -1):
            waiting = graph.node(edge.consumer)
            if waiting.op == "ReadVariableOp" and not graph.consumers_of(edge.consumer):
                removed[edge.consumer] = f"read only after {name}, which was removed"
    stack = list(removed)
    while stack:
        name = stack.pop()
        for spec in graph.node(name).input:
            src, _ = parse_input(spec)
            if src in removed or src not in graph or not _removable(graph, src):
                continue
            if all(edge.consumer in removed for edge in graph.consumers_of(src)):
                removed[src] = f"only fed {name}, which was removed"
                stack.append(src)
    return removed
