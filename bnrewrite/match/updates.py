"""Finding the moving-average updates that a batch-norm site's statistics feed."""

from __future__ import annotations

from bnrewrite.graph import Graph
from bnrewrite.match.sites import Update, resolve_variable

ASSIGN_OPS = frozenset({
    "AssignSubVariableOp", "AssignVariableOp", "AssignAddVariableOp", "AssignSub", "Assign", "AssignAdd",
})
#: Elementwise ops a statistic passes through on its way into an update (momentum arithmetic).
_ARITHMETIC = frozenset({
    "Identity", "Sub", "Mul", "Add", "AddV2", "Cast", "RealDiv", "Div", "Neg", "StopGradient",
    "Reshape", "Squeeze", "Maximum", "Minimum", "Switch", "Merge",
})
_MAX_DEPTH = 8


def find_updates(graph: Graph, statistics: list[tuple[str, int, str]]) -> tuple[Update, ...]:
    """Assign ops whose value depends on the (node, output, statistic name) tensors given."""
    found: dict[str, Update] = {}
    for site, output, statistic in statistics:
        frontier = [(site, output)]
        seen: set[str] = set()
        for _ in range(_MAX_DEPTH):
            nxt = []
            for node, out in frontier:
                for edge in graph.consumers_of(node, out):
                    consumer = graph.node(edge.consumer)
                    if consumer.op in ASSIGN_OPS and edge.slot == 1:
                        variable = resolve_variable(graph, graph.producer(consumer.name, 0)[0])
                        if variable is not None and consumer.name not in found:
                            found[consumer.name] = Update(consumer.name, variable, statistic)
                    elif consumer.op in _ARITHMETIC and consumer.name not in seen:
                        seen.add(consumer.name)
                        nxt.extend((consumer.name, i) for i in range(2 if consumer.op == "Switch" else 1))
            frontier = nxt
    return tuple(sorted(found.values(), key=lambda u: u.node))
