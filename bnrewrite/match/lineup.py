"""Lining up the copies of a layer across towers that share no variable.

Trainers with replicated variables (tf.distribute.MirroredStrategy, the TF benchmarks'
`--variable_update=replicated`) give every tower its own copy of every variable, so the
shared variables that `towers.py` lines layers up by are not there. Two things the graph
shows still pair the copies:

1. roles: the names of the variables a copy uses (else its own name) with the parts that
   name a tower or a replica taken out: `v1/bn/gamma` and `bn/gamma/replica_1` become
   `bn/gamma`; failing that, also the `_k` of a uniquified outermost scope (`model_1/bn/gamma`).
   A role held by exactly one site in every tower pairs those sites (by m sites in every
   tower when each tower's m use the very same variables: one layer applied m times, which
   `applications.py` splits).
2. structure, for the sites whose roles do not pair (a naming convention nobody foresaw): the
   op types and variable shapes a few steps upstream of the site. Sites of one tower with the
   same structure are told apart by their order along data dependencies; when they do not
   depend on each other (parallel branches), nothing in the graph decides which copy goes with
   which, and they are skipped with the reason rather than paired by a guess.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from bnrewrite.graph.index import Graph
from bnrewrite.match.census import Site, Skip
from bnrewrite.match.sites import VARIABLE_OPS

#: A name component that names a tower or replica: tower_1, replica_1, v1, clone_2, gpu_0, ...
TOWER_PART = re.compile(r"(?:tower|replica|clone|gpu|cpu|device|worker|shard|v)_?\d+", re.IGNORECASE)
_UNIQUIFIED = re.compile(r"_\d+$")
#: How many steps upstream of a site its structure looks (site <- conv <- read <- variable).
DEPTH = 3


@dataclass(frozen=True)
class Pairing:
    """The copies of one layer and what paired them."""

    key: str
    sites: list[Site]  # one per tower; towers.py puts them in tower order
    by: str  # "variable roles", "names" or "structure"


def role(name: str, tower_scope: str | None = None, uniquified: bool = False) -> str:
    """`name` without the components that name a tower or replica (and without `tower_scope`,
    the tower's own top-level scope, when towers are told apart by scope); `uniquified`: also
    without the `_k` that TensorFlow appends to an outermost scope entered again (`model_1`)."""
    parts = name.split("/")
    if tower_scope is not None and parts[0] == tower_scope:
        parts = parts[1:]
    parts = [p for p in parts if not TOWER_PART.fullmatch(p)]
    if uniquified and parts:
        parts[0] = _UNIQUIFIED.sub("", parts[0])
    return "/".join(parts)


def line_up(
    graph: Graph, sites: list[Site], tower: dict[str, str], ids: list[str], variables: dict[str, list[str]],
    scope_towers: bool,
) -> tuple[list[Pairing], list[Skip]]:
    """Pair `sites` (none of which uses a variable every tower uses) across the towers `ids`:
    by roles, then by roles that also ignore uniquified outermost scopes (for what is left: it
    would merge top-level layers `bn` and `bn_1`), then by structure.

    `variables`: each site's variables; `scope_towers`: towers are top-level name scopes."""
    pairings, rest = [], sites
    for uniquified in (False, True):
        by_role: dict[str, list[Site]] = defaultdict(list)
        for s in rest:
            scope = tower[s.name] if scope_towers else None
            key = "|".join(role(v, uniquified=uniquified) for v in variables[s.name])
            by_role[key or role(s.name, scope, uniquified)].append(s)
        rest = []
        for key, members in by_role.items():
            if sorted(tower[s.name] for s in members) == sorted(ids) or _applied_alike(members, tower, ids, variables):
                pairings.append(Pairing(key, members, "variable roles" if variables[members[0].name] else "names"))
            else:
                rest.extend(members)
    structured, skips = _by_structure(graph, rest, tower, ids, variables)
    return pairings + structured, skips


def _applied_alike(members: list[Site], tower: dict[str, str], ids: list[str], variables: dict[str, list[str]]) -> bool:
    """Whether every tower applies one layer of its own the same number of times (> 1) among
    `members`: its sites there use the very same variables (applications.py pairs them)."""
    per_tower: dict[str, list[Site]] = defaultdict(list)
    for s in members:
        per_tower[tower[s.name]].append(s)
    if sorted(per_tower) != sorted(ids) or len({len(sites) for sites in per_tower.values()}) != 1:
        return False
    return all(len(sites) > 1 and variables[sites[0].name]
               and all(variables[s.name] == variables[sites[0].name] for s in sites) for sites in per_tower.values())


def _by_structure(
    graph: Graph, sites: list[Site], tower: dict[str, str], ids: list[str], variables: dict[str, list[str]],
) -> tuple[list[Pairing], list[Skip]]:
    """Pair sites whose roles did not: by structure, then by order along data dependencies."""
    memo: dict[tuple[str, int], str] = {}
    buckets: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    site_of = {s.name: s for s in sites}
    for s in sites:
        buckets[structure(graph, s.name, DEPTH, memo)][tower[s.name]].append(s.name)
    pairings, skips = [], []
    for per_tower in buckets.values():
        ordered = {t: graph.sorted_topologically(per_tower.get(t, ())) for t in ids}
        reason = _unpairable(graph, ordered)
        if reason:
            skips.extend(Skip(name, reason) for names in ordered.values() for name in names)
            continue
        for copies in zip(*ordered.values()):
            first = site_of[copies[0]]
            key = "|".join(role(v) for v in variables[first.name]) or role(first.name, tower[first.name])
            pairings.append(Pairing(key, [site_of[name] for name in copies], "structure"))
    return pairings, skips


def _unpairable(graph: Graph, ordered: dict[str, list[str]]) -> str:
    """Why the sites of one structure, per tower in topological order, cannot be paired
    across towers ("" if they can)."""
    missing = [t for t, names in ordered.items() if not names]
    if missing:
        return f"missing from tower(s) {', '.join(missing)}"
    if len({len(names) for names in ordered.values()}) > 1:
        seen = ", ".join(f"{len(names)} in {t}" for t, names in ordered.items())
        return (f"towers hold different numbers of batch-norm sites of this structure ({seen}) and their names "
                "do not pair them; this layer keeps per-tower statistics")
    for names in ordered.values():
        if any(not graph.depends_on(later, earlier) for earlier, later in zip(names, names[1:])):
            return (f"{len(names)} batch-norm sites of one tower have the same structure, do not depend on each "
                    "other, and their names do not pair them with the other towers' copies; left unsynced "
                    "rather than paired by a guess")
    return ""


def structure(graph: Graph, name: str, depth: int, memo: dict[tuple[str, int], str]) -> str:
    """The op types (and variable shapes) `depth` steps upstream of `name` along data inputs:
    the same for every tower's copy of a layer, whatever the towers' names."""
    key = (name, depth)
    if key in memo:
        return memo[key]
    node = graph.node(name)
    label = node.op
    if node.op in VARIABLE_OPS:
        label += str([d.size for d in node.attr["shape"].shape.dim]) if "shape" in node.attr else ""
    elif depth:
        label += "(" + ",".join(f"{structure(graph, src, depth - 1, memo)}:{out}" for src, out in graph.inputs(name)) + ")"
    memo[key] = label
    return label
