"""Finding the moving-average updates that a batch-norm site's statistics feed."""

from __future__ import annotations

from bnrewrite.graph import Graph
from bnrewrite.match.sites import Update, resolve_variable
from bnrewrite.ops import IF_OPS

ASSIGN_OPS = frozenset({
    "AssignSubVariableOp", "AssignVariableOp", "AssignAddVariableOp", "AssignSub", "Assign", "AssignAdd",
})
#: Prefixes of the optimizers' update ops (ApplyAdam, ResourceApplyRMSProp, ...): input 0 is the variable.
_APPLY_PREFIXES = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply")
#: Elementwise ops a statistic passes through on its way into an update (momentum arithmetic;
#: batch renormalization's standard deviations: Sqrt, and Relu(stddev^2 - epsilon)).
_ARITHMETIC = frozenset({
    "Identity", "Sub", "Mul", "Add", "AddV2", "Cast", "RealDiv", "Div", "Neg", "StopGradient",
    "Reshape", "Squeeze", "Maximum", "Minimum", "Switch", "Merge", "Sqrt", "Relu",
})
#: Steps from a statistic to its update: batch renormalization under a v1 conditional passes
#: smart_cond's Switch/Merge, identities and the renorm arithmetic on the way (measured: 9-12).
_MAX_DEPTH = 16
#: Functional control flow: the functions of these ops are not searched for updates.
_FUNCTIONAL = IF_OPS | frozenset({"Case", "StatelessCase", "While", "StatelessWhile"})
_FOLLOWED = ASSIGN_OPS | _ARITHMETIC | _FUNCTIONAL


def find_updates(graph: Graph, statistics: list[tuple[str, int, str]]) -> tuple[tuple[Update, ...], tuple[str, ...]]:
    """Assign ops whose value depends on the (node, output, statistic name) tensors given,
    also through the value an update leaves (the output of a ref-variable assign, or a read
    that waits on a resource-variable assign): batch renormalization sets moving_variance from
    moving_stddev once that is updated. Also the functional control-flow ops the statistics
    enter on the way, whose functions may hold updates this search cannot see."""
    found: dict[str, Update] = {}
    opaque: set[str] = set()
    for site, output, statistic in statistics:
        starts = [(site, output)]
        while starts:
            new = _updates_from(graph, starts, statistic, found, opaque)
            starts = [(update, 0) for update in new] + [
                (read, 0) for update in new for read in graph.consumers.get(update, ())
                if graph.node(read).op == "ReadVariableOp" and f"^{update}" in graph.node(read).input]
    return tuple(sorted(found.values(), key=lambda u: u.node)), tuple(sorted(opaque))


def _updates_from(
    graph: Graph, starts: list[tuple[str, int]], statistic: str, found: dict[str, Update], opaque: set[str],
) -> list[str]:
    """Add to `found` the assign ops a few elementwise ops away from `starts` (and to `opaque`
    the functional ops met); the new updates."""
    new = []
    frontier, seen = starts, set()
    for _ in range(_MAX_DEPTH):
        nxt = []
        for node, out in frontier:
            for edge in graph.consumers_of(node, out, ops=_FOLLOWED):
                consumer = graph.node(edge.consumer)
                if consumer.op in ASSIGN_OPS and edge.slot == 1:
                    variable = resolve_variable(graph, graph.producer(consumer.name, 0)[0])
                    if variable is not None and consumer.name not in found:
                        found[consumer.name] = Update(consumer.name, variable, statistic)
                        new.append(consumer.name)
                elif consumer.op in _FUNCTIONAL:
                    opaque.add(consumer.name)
                elif consumer.op in _ARITHMETIC and consumer.name not in seen:
                    seen.add(consumer.name)
                    nxt.extend((consumer.name, i) for i in range(2 if consumer.op == "Switch" else 1))
        frontier = nxt
    return new


def writers(graph: Graph) -> dict[str, str]:
    """Every node that writes a variable (assigns, optimizers' updates) -> that variable."""
    found = {}
    for node in graph:
        if (node.op in ASSIGN_OPS or node.op.startswith(_APPLY_PREFIXES)) and node.input and node.input[0][0] != "^":
            variable = resolve_variable(graph, graph.producer(node.name, 0)[0])
            if variable is not None:
                found[node.name] = variable
    return found
