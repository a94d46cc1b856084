"""Whether towers with their own copies of every variable train one model or several.

Per-tower copies are replicas of one model only when their training meets: the gradients
are combined across towers (summed, averaged, all-reduced) before a copy is updated. Towers
whose copies are each updated from their own tower alone (tf_cnn_benchmarks'
`--variable_update=independent`) are K trainings in one graph: synchronizing their batch
norm would couple them into something no single device trains.
"""

from __future__ import annotations

from bnrewrite.graph import Graph
from bnrewrite.match.towers import Towers
from bnrewrite.match.updates import writers


def trained_apart(graph: Graph, towers: Towers) -> str:
    """Why the towers are independent models, or "" when they may be replicas.

    Independent: every layer holds per-tower variables, and in every tower the writes of its
    scale/offset copies (an optimizer's, which start from the tower's own batch-norm
    gradients; an initializer's start from neither) have no other tower's batch norm
    upstream. A graph whose writes start from no batch norm (no optimizer) counts as replicas.
    """
    if any(group.lined_up_by == "shared variables" for group in towers.groups):
        return ""
    written: dict[str, list[str]] = {}
    for node, variable in writers(graph).items():
        written.setdefault(variable, []).append(node)
    own: list[set[str]] = [set() for _ in towers.ids]  # per tower: its sites and their gradients
    starts: list[list[str]] = [[] for _ in towers.ids]  # per tower: the writes of its scale/offset
    for group in towers.groups:
        for k, site in enumerate(group.sites):
            own[k].update((site.name, *site.grads, *site.variance_grads))
            for variable in (site.scale_var, site.offset_var):
                starts[k].extend(written.get(variable, ()) if variable else ())
    tower_of = {name: k for k, sites in enumerate(own) for name in sites}
    for k in range(len(towers.ids)):
        if _upstream_towers(graph, starts[k], tower_of) != {k}:
            return ""
    example = towers.groups[0].sites[0]
    return (
        f"the towers ({', '.join(towers.ids)}) train independent models: each updates its own copies of the "
        f"variables (e.g. {example.scale_var or example.offset_var}) from its own gradients alone, with no "
        "gradient combined across towers; synchronizing their batch norm would couple separate trainings, "
        "so there is nothing to synchronize"
    )


def _upstream_towers(graph: Graph, starts: list[str], tower_of: dict[str, int]) -> set[int]:
    """The towers whose batch-norm nodes (`tower_of`) are upstream of (or among) `starts`;
    the search stops once two are found."""
    found: set[int] = set()
    seen, stack = set(starts), list(starts)
    while stack and len(found) < 2:
        name = stack.pop()
        if name in tower_of:
            found.add(tower_of[name])
        for src, _ in graph.inputs(name):
            if src not in seen:
                seen.add(src)
                stack.append(src)
    return found
