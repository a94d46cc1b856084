"""Every tower issues its all-reduces in one and the same order.

Collectives that meet by keys across workers can hang when two devices launch them in different
orders (NCCL requires one order per communicator), and the executor is free to run independent
ops in any order. Within one process TensorFlow's NcclAllReduce cannot: it enqueues an
all-reduce on every device's stream only once all its local participants have arrived, one at a
time; its all-reduces are chained all the same. The order of the first tower's all-reduces in a
topological sort is taken as the order for all, and each tower's all-reduces are chained with
control edges in that order. Towers are replicas, so the chain respects every tower's data
dependencies; if it did not, validation after this pass reports the cycle.

Under v1 conditionals (Switch/Merge) an op with a dead control input is dead itself, so
all-reduces are only chained to others that run under the same branch conditions.
"""

from __future__ import annotations

from collections import defaultdict

from bnrewrite.graph.edit import Editor
from bnrewrite.graph.index import Graph
from bnrewrite.graph.names import parse_input
from bnrewrite.rewrite.collectives import COLLECTIVE_OPS, INSTANCE_ATTR
from bnrewrite.rewrite.passes.record import PassRecord
from bnrewrite.rewrite.plan import Plan


def order_collectives(graph: Graph, plan: Plan) -> tuple[Graph, PassRecord]:
    """`plan` is unused: the order is read off the graph itself."""
    record = PassRecord("order_collectives")
    collectives = [node.name for node in graph if node.op in COLLECTIVE_OPS and INSTANCE_ATTR in node.attr]
    if not collectives:
        return graph, record
    conditions = branch_conditions(graph)
    chains: dict[tuple[str, frozenset], list[str]] = defaultdict(list)
    instance: dict[str, int] = {}
    rank: dict[int, int] = {}  # instance key -> position among the first device's all-reduces
    first_device = None
    for name in graph.sorted_topologically(collectives):
        node = graph.node(name)
        chains[(node.device, conditions.get(name, _NONE))].append(name)
        instance[name] = node.attr[INSTANCE_ATTR].i
        first_device = node.device if first_device is None else first_device
        if node.device == first_device:
            rank[instance[name]] = len(rank)
    editor = Editor(graph)
    for names in chains.values():
        names.sort(key=lambda n: rank.get(instance[n], len(rank)))
        for prev, cur in zip(names, names[1:]):
            edge = f"^{prev}"
            if edge not in editor.node(cur).input:
                editor.mutable(cur).input.append(edge)
                record.control_edges += 1
    return editor.finish(), record


_SWITCH = frozenset({"Switch", "RefSwitch"})
_MERGE = frozenset({"Merge", "RefMerge"})
_NONE: frozenset = frozenset()


def branch_conditions(graph: Graph) -> dict[str, frozenset]:
    """Node -> the (predicate, branch) pairs of the v1 conditionals it runs under (absent: none).

    A Switch output adds its (predicate, port); a Merge keeps what all its inputs share.
    """
    if not any(node.op in _SWITCH for node in graph):
        return {}  # no v1 conditional: nothing runs under a branch
    conditions: dict[str, frozenset] = {}
    for name in graph.topological_order():
        node = graph.node(name)
        if node.op in _MERGE:
            live = [conditions.get(parse_input(i)[0], _NONE) for i in node.input if not i.startswith("^")]
            conditions[name] = frozenset.intersection(*live) if live else _NONE
            continue
        current = _NONE
        for spec in node.input:
            src, output = parse_input(spec)
            inherited = conditions.get(src, _NONE)
            if output >= 0 and graph.node(src).op in _SWITCH:
                inherited = inherited | {(graph.node(src).input[1], output)}
            if inherited:
                current = current | inherited
        conditions[name] = current
    return conditions
