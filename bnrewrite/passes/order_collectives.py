"""Every tower issues its all-reduces in one and the same order.

NCCL hangs when two devices launch collectives in different orders, and the executor is
free to run independent ops in any order. The order of the first tower's all-reduces in a
topological sort is taken as the order for all, and each tower's all-reduces are chained
with control edges in that order. Towers are replicas, so the chain respects every tower's
data dependencies; if it did not, validation after this pass reports the cycle.
"""

from __future__ import annotations

from collections import defaultdict

from bnrewrite.collectives import COLLECTIVE_OPS, INSTANCE_ATTR
from bnrewrite.graph import Graph
from bnrewrite.passes.record import PassRecord
from bnrewrite.plan import Plan


def order_collectives(graph: Graph, plan: Plan) -> tuple[Graph, PassRecord]:
    """`plan` is unused: the order is read off the graph itself."""
    record = PassRecord("order_collectives")
    by_device: dict[str, list[str]] = defaultdict(list)
    instance: dict[str, int] = {}
    for name in graph.topological_order():
        node = graph.node(name)
        if node.op in COLLECTIVE_OPS and INSTANCE_ATTR in node.attr:
            by_device[node.device].append(name)
            instance[name] = node.attr[INSTANCE_ATTR].i
    if not by_device:
        return graph, record
    first = next(iter(by_device.values()))
    rank = {instance[name]: i for i, name in enumerate(first)}
    editor = graph.edit()
    for names in by_device.values():
        names.sort(key=lambda n: rank.get(instance[n], len(rank)))
        for prev, cur in zip(names, names[1:]):
            edge = f"^{prev}"
            if edge not in editor.node(cur).input:
                editor.mutable(cur).input.append(edge)
                record.control_edges += 1
    return editor.finish(), record
