"""Where the gradients of `tf.nn.moments` take their incoming gradients in, found by structure.

`tf.gradients` scopes the gradient of op X as `.../gradients/X_grad/` (sites.py reads that);
`tf.GradientTape` names it after X's own scope (`gradient_tape/bn/moments/Reshape_1`), the
mean's and the variance's gradients side by side, so only structure tells them apart. Both
build the same ops. The gradient of a Mean divides: RealDiv(Tile(Reshape(g)), count) for a
static shape, RealDiv(BroadcastTo([Reshape](g), Shape), count) otherwise; its entry is the
Tile or BroadcastTo, whose input 0 is the incoming gradient (reshaped to the kept dims).

- the variance's: SquaredDifference(x, c)'s gradient computes `x - c` anew, a Sub of exactly
  those inputs that waits (a control input) on the incoming gradient: the variance's RealDiv.
- the mean's: the Sub's product goes into x's gradient, the sum (AddN) of every path's
  gradient to x; the mean's RealDiv is the one input there of that form, dividing by the same
  count as the variance's (static shapes: equal constants).

A gradient computation gives one pair; a form that does not match gives none, and the site
is left to sites.py's refusal (never synchronized forward only).
"""

from __future__ import annotations

from bnrewrite.graph.index import Graph
from bnrewrite.graph.names import parse_input

_DIVIDES = frozenset({"RealDiv", "Div"})
_SPREADS = frozenset({"Tile", "BroadcastTo"})
_SUMS = frozenset({"AddN", "AddV2", "Add"})


def tape_entries(graph: Graph, squared: str) -> tuple[list[str], list[str]]:
    """(the mean's entries, the variance's), one pair per gradient computation, for the moments
    whose variance reads SquaredDifference `squared`; ([], []) when a pair cannot be told."""
    node = graph.node(squared)
    operands = [parse_input(spec) for spec in node.input[:2]]
    means, variances = [], []
    for sub in graph.consumers.get(operands[0][0], ()):
        found = _pair(graph, sub, operands)
        if found is None:
            continue
        means.append(found[0])
        variances.append(found[1])
    return means, variances


def _pair(graph: Graph, sub: str, operands: list[tuple[str, int]]) -> tuple[str, str] | None:
    """The (mean, variance) entries of the gradient whose SquaredDifference gradient made `sub`."""
    node = graph.node(sub)
    if node.op != "Sub" or graph.inputs(sub) != operands:
        return None
    # one wait is the variance's gradient; others come from a `control_dependencies` the
    # gradient was built under (`with control_dependencies(UPDATE_OPS): minimize(loss)`)
    waits = [spec[1:] for spec in node.input if spec.startswith("^") and _entry(graph, spec[1:]) is not None]
    if len(waits) != 1:
        return None
    variance_divide = waits[0]
    found = set()
    for product in graph.consumers.get(sub, ()):
        if graph.node(product).op != "Mul":
            continue
        for total in graph.consumers.get(product, ()):
            if graph.node(total).op not in _SUMS:
                continue
            found.update(src for src, _ in graph.inputs(total) if src != product
                         and _entry(graph, src) is not None and _same_count(graph, src, variance_divide))
    if len(found) != 1:
        return None
    return _entry(graph, found.pop()), _entry(graph, variance_divide)  # type: ignore[return-value]


def _entry(graph: Graph, divide: str) -> str | None:
    """The Tile or BroadcastTo a Mean's gradient RealDiv `divide` divides, if it is one."""
    if graph.node(divide).op not in _DIVIDES:
        return None
    spread, _ = graph.producer(divide, 0)
    return spread if graph.node(spread).op in _SPREADS else None


def _same_count(graph: Graph, divide: str, other: str) -> bool:
    """Whether two gradient RealDivs may divide by one count: equal constants, or not both constant."""
    counts = [graph.node(graph.producer(name, 1)[0]) for name in (divide, other)]
    if all(c.op == "Const" for c in counts):
        return counts[0].attr["value"].SerializeToString() == counts[1].attr["value"].SerializeToString()
    return not any(c.op == "Const" for c in counts)
