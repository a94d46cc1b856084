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

    Independent: every layer holds per-tower variables, each tower's scale/offset copies are
    written (by an optimizer) and nothing upstream of those writes belongs to another
    tower's batch norm. A graph without such writes (no optimizer) counts as replicas.
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
    if not all(starts):
        return ""
    for k, tower in enumerate(towers.ids):
        foreign = set().union(*(sites for j, sites in enumerate(own) if j != k))
        if _reaches(graph, starts[k], foreign):
            return ""
    example = towers.groups[0].sites[0]
    return (
        f"the towers ({', '.join(towers.ids)}) train independent models: each updates its own copies of the "
        f"variables (e.g. {example.scale_var or example.offset_var}) from its own gradients alone, with no "
        "gradient combined across towers; synchronizing their batch norm would couple separate trainings, "
        "so there is nothing to synchronize"
    )


def _reaches(graph: Graph, starts: list[str], targets: set[str]) -> bool:
    """Whether a node of `targets` is upstream of (or among) `starts`."""
    seen, stack = set(starts), list(starts)
    while stack:
        name = stack.pop()
        if name in targets:
            return True
        for src, _ in graph.inputs(name):
            if src not in seen:
                seen.add(src)
                stack.append(src)
    return False
