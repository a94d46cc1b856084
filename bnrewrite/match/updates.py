"""Finding the moving-average updates that a batch-norm site's statistics feed."""

from __future__ import annotations

import functools
from collections.abc import Callable

from bnrewrite.graph.index import Graph
from bnrewrite.graph.ops import IF_OPS
from bnrewrite.match.census import Update
from bnrewrite.match.sites import resolve_variable

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
#: ... of which these hold no stateful op, so no write of a variable (TensorFlow builds them so).
_STATELESS = frozenset({"StatelessIf", "StatelessCase", "StatelessWhile"})
#: Prefixes of the ops that write a variable's elements in place.
_SCATTER_PREFIXES = ("Scatter", "ResourceScatter", "ResourceStridedSliceAssign", "StridedSliceAssign")
_FOLLOWED = ASSIGN_OPS | _ARITHMETIC | _FUNCTIONAL
#: Searches for updates, by their starts: what they met (`_search`), kept to be used again.
Searched = dict[tuple[tuple[str, int | None], ...], tuple[list[tuple[str, str | None]], set[str]]]


def find_updates(
    graph: Graph, statistics: list[tuple[str, int, str]], elsewhere: Callable[[str], bool] = lambda update: False,
    searched: Searched | None = None,
) -> tuple[tuple[Update, ...], tuple[str, ...]]:
    """Assign ops whose value depends on the (node, output, statistic name) tensors given,
    also through the value an update leaves (the output of a ref-variable assign, or a read of
    the same variable that waits on a resource-variable assign): batch renormalization sets
    moving_variance from moving_stddev once that is updated. Reads of other variables that wait
    on the update (an optimizer's `beta1_power` built under `control_dependencies(UPDATE_OPS)`)
    take no value from it. Also the functional control-flow ops the statistics
    enter on the way that may hide an update this search cannot see (_may_hide_updates); one
    that only reads them (a summary's tf.nn.zero_fraction cond) is no obstacle.

    `elsewhere(update)`: other sites' statistics reach it directly (`direct_updates`). Met only
    through an update's value, such an update is those sites' (a network applied twice whose
    second application waits on the first's updates): neither kept nor followed.
    `searched`: the searches `direct_updates` made, whose first steps are these."""
    found: dict[str, Update] = {}
    opaque: set[str] = set()
    for site, output, statistic in statistics:
        starts, derived = [(site, output)], False
        while starts:
            new = _updates_from(graph, starts, statistic, found, opaque, searched)
            if derived:
                for update in [update for update in new if elsewhere(update)]:
                    del found[update]
                    new.remove(update)
            derived = True
            starts = [(update, 0) for update in new] + [
                (read, 0) for update in new for read in graph.consumers.get(update, ())
                if graph.node(read).op == "ReadVariableOp" and f"^{update}" in graph.node(read).input
                and resolve_variable(graph, graph.producer(read, 0)[0]) == found[update].variable]
    return tuple(sorted(found.values(), key=lambda u: u.node)), tuple(sorted(o for o in opaque if _may_hide_updates(graph, o)))


def direct_updates(graph: Graph, statistics: list[tuple[str, int, str]], searched: Searched | None = None) -> set[str]:
    """The assign ops a few elementwise ops from the statistics themselves (no update's value between);
    the searches kept in `searched` for `find_updates`."""
    found: dict[str, Update] = {}
    for site, output, statistic in statistics:
        _updates_from(graph, [(site, output)], statistic, found, set(), searched)
    return set(found)


def _may_hide_updates(graph: Graph, functional: str) -> bool:
    """Whether moving-average updates may lie inside or beyond a functional op the statistics
    enter: its functions may write a variable, or an assign (or another functional op) is a few
    elementwise ops after one of its outputs (batch renormalization's cond v2). A cond whose
    outputs feed no update (a summary's tf.nn.zero_fraction) hides none."""
    if may_write_variables(graph, graph.node(functional)):
        return True
    beyond: set[str] = set()
    return bool(_updates_from(graph, [(functional, None)], "", {}, beyond)) or bool(beyond)


def _updates_from(
    graph: Graph, starts: list[tuple[str, int | None]], statistic: str, found: dict[str, Update], opaque: set[str],
    searched: Searched | None = None,
) -> list[str]:
    """Add to `found` the assign ops a few elementwise ops away from `starts` (and to `opaque`
    the functional ops met); the new updates. The search itself is kept in `searched`, if given."""
    key = tuple(starts)
    met = searched.get(key) if searched is not None else None
    if met is None:
        met = _search(graph, starts)
        if searched is not None:
            searched[key] = met
    assigns, functional = met
    opaque.update(functional)
    new = []
    for name, variable in assigns:
        if variable is not None and name not in found:
            found[name] = Update(name, variable, statistic)
            new.append(name)
    return new


def _search(graph: Graph, starts: list[tuple[str, int | None]]) -> tuple[list[tuple[str, str | None]], set[str]]:
    """The assign ops a few elementwise ops away from `starts` as met (each with its variable,
    None where none resolves; once per edge that meets it), and the functional ops met."""
    assigns, functional = [], set()
    frontier, seen = starts, set()
    for _ in range(_MAX_DEPTH):
        nxt = []
        for node, out in frontier:
            for edge in graph.consumers_of(node, out, ops=_FOLLOWED):
                consumer = graph.node(edge.consumer)
                if consumer.op in ASSIGN_OPS and edge.slot == 1:
                    assigns.append((consumer.name, resolve_variable(graph, graph.producer(consumer.name, 0)[0])))
                elif consumer.op in _FUNCTIONAL:
                    functional.add(consumer.name)
                elif consumer.op in _ARITHMETIC and consumer.name not in seen:
                    seen.add(consumer.name)
                    nxt.extend((consumer.name, i) for i in range(2 if consumer.op == "Switch" else 1))
        frontier = nxt
    return assigns, functional


def may_write_variables(graph: Graph, node: object) -> bool:
    """Whether a functional op's functions (and the functions they call) hold an op that can
    write a variable: an assign, an optimizer's update, a scatter, or an op it cannot look into."""
    if node.op in _STATELESS:
        return False
    library = graph.functions
    pending, seen = _functions_of(node), set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in library:
            return True  # a function the graph does not hold: nothing says it writes nothing
        for inner in library[name].node_def:
            if writes(inner.op):
                return True
            if inner.op in library:
                pending.append(inner.op)
            if inner.op not in _STATELESS:
                pending.extend(_functions_of(inner))
    return False


def _functions_of(node: object) -> list[str]:
    """The names of the functions a node's attrs name (branches, bodies, called functions)."""
    names = []
    for value in node.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func)
    return names


@functools.cache  # one answer per op type: asked of every node of a step's work
def writes(op: str) -> bool:
    """Whether an op of type `op` writes a variable (assigns, optimizers' updates, scatters)."""
    return op in ASSIGN_OPS or op.startswith(_APPLY_PREFIXES) or op.startswith(_SCATTER_PREFIXES)


def writers(graph: Graph) -> dict[str, str]:
    """Every node that writes a variable (assigns, optimizers' updates) -> that variable."""
    found = {}
    for node in graph:
        if (node.op in ASSIGN_OPS or node.op.startswith(_APPLY_PREFIXES)) and node.input and node.input[0][0] != "^":
            variable = resolve_variable(graph, graph.producer(node.name, 0)[0])
            if variable is not None:
                found[node.name] = variable
    return found
