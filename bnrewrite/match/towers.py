"""Telling towers apart and lining up the copies of each batch-norm layer across them.

A tower is what the graph shows: the device a site runs on when sites span several devices,
else the top name scope (MirroredStrategy's replica 0 has none: beside `replica_k` scopes,
the unscoped sites are `replica_0`). A worker of several (num_workers > 1) whose top scopes are
not replicas (layers of one computation: bn1 feeds bn2) has one tower, its whole graph. A layer is what its copies share: the variables they
read (scale, offset) or write (moving averages) when the towers share those; when every
tower has its own copies, `lineup.py` pairs them by the roles of their variables' names and,
failing that, by structure. A layer that every tower applies several times (a GAN's
discriminator, a Siamese net) becomes one group per application (`applications.py`).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

from bnrewrite.errors import NotReplicasError, NoTowersError, TowerMismatchError
from bnrewrite.graph.index import Graph
from bnrewrite.match.applications import split_applications
from bnrewrite.match.census import Site, Skip
from bnrewrite.match.data_parallel import not_replicas
from bnrewrite.match.lineup import line_up



@dataclass(frozen=True)
class LayerGroup:
    """The K copies of one batch-norm layer, one per tower, in tower order."""

    key: str  # the layer's name (one application's, for a layer each tower applies several times)
    sites: tuple[Site, ...]
    lined_up_by: str = "shared variables"  # or "variable roles", "names", "structure"


@dataclass(frozen=True)
class Towers:
    ids: tuple[str, ...]
    by: str
    groups: tuple[LayerGroup, ...]
    skips: tuple[Skip, ...]
    layout: str = ""  # how the towers hold the layers' variables, for the report
    applications: tuple[str, ...] = ()  # for the report: each layer applied several times per tower


def _natural(text: str) -> list[object]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


_REPLICA_SCOPE = re.compile(r"replica_\d+")


def tower_of(site: Site, by: str, replica_scopes: bool = False) -> str:
    """The tower of `site`; `replica_scopes`: other sites sit in `replica_k` scopes, and a
    site outside one belongs to replica 0 (tf.distribute names no scope for it)."""
    if by == "device":
        return str(site.device)
    top = site.name.split("/", 1)[0]
    return "replica_0" if replica_scopes and not _REPLICA_SCOPE.fullmatch(top) else top


def choose_tower_by(sites: list[Site], by: str) -> str:
    if by != "auto":
        return by
    devices = {s.device for s in sites if s.device.type}
    return "device" if len(devices) >= 2 else "scope"


def tower_map(sites: list[Site], by: str) -> dict[str, str]:
    """Site -> its tower, told apart by `by` ("auto" chosen as group_towers chooses)."""
    by = choose_tower_by(sites, by)
    replica_scopes = by == "scope" and any(_REPLICA_SCOPE.fullmatch(s.name.split("/", 1)[0]) for s in sites)
    return {s.name: tower_of(s, by, replica_scopes) for s in sites}


def group_towers(graph: Graph, sites: list[Site], by: str = "auto", min_towers: int = 2) -> Towers:
    """Assign every site a tower and group the copies of each layer.

    Groups that do not have exactly one copy in every tower, or whose copies differ in
    op, format, dtype or attributes, are skipped whole with the reason.
    """
    requested, by = by, choose_tower_by(sites, by)
    tower = tower_map(sites, by)
    ids = sorted(set(tower.values()), key=_natural)
    if len(ids) < min_towers or not ids:
        where = f"device {shown_tower(ids[0])}" if by == "device" and ids else f"scope {ids[0]!r}" if ids else "nowhere"
        raise NoTowersError(
            f"training batch norm found in only one tower ({where}, told apart by {by}); "
            "bnrewrite needs a graph replicated over 2 or more towers (devices or name scopes)"
        )
    if len(ids) >= 2:
        reason = not_replicas(graph, sites, tower, ids, one_device=requested == "auto" and by == "scope")
        if reason and min_towers == 1 and requested == "auto" and by == "scope":
            by, ids, tower = _one_tower(sites)
        elif reason:
            raise NotReplicasError(reason)
    variables = {s.name: _variables(s) for s in sites}
    users: dict[str, set[str]] = defaultdict(set)  # variable -> the towers whose sites use it
    for s in sites:
        for variable in variables[s.name]:
            users[variable].add(tower[s.name])
    buckets: dict[str, list[Site]] = defaultdict(list)
    own = []  # sites that use no variable every tower uses
    for s in sites:
        # A variable every tower uses names the layer (one tower's own variables, or updates
        # that some towers lack, would split it).
        shared = [variable for variable in variables[s.name] if len(users[variable]) == len(ids)]
        if shared:
            buckets["|".join(shared)].append(s)
        else:
            own.append(s)
    pairings, skips = line_up(graph, own, tower, ids, variables, by == "scope") if own else ([], [])
    candidates = [(_layer_name(key), members, "shared variables") for key, members in buckets.items()]
    candidates += [(_layer_name(p.key), p.sites, p.by) for p in pairings]
    candidates, unpaired, applied = split_applications(graph, candidates, tower, ids, by == "scope")
    skips.extend(unpaired)
    order = {name: i for i, name in enumerate(graph.names())}
    groups = []
    for name, members, how in candidates:
        reason = _mismatch(members, tower, ids)
        if reason:
            skips.extend(Skip(s.name, reason) for s in members)
            continue
        members = sorted(members, key=lambda s: ids.index(tower[s.name]))
        groups.append(LayerGroup(name, tuple(members), how))
    groups.sort(key=lambda g: order[g.sites[0].name])
    if not groups:
        raise TowerMismatchError(
            f"found towers {', '.join(map(shown_tower, ids))} but no batch-norm layer lines up across them: "
            f"{skips[0].node}: {skips[0].reason}"
        )
    return Towers(tuple(ids), by, tuple(groups), tuple(skips), _layout(groups, variables), tuple(applied))


def _one_tower(sites: list[Site]) -> tuple[str, list[str], dict[str, str]]:
    """(by, ids, each site's tower) for a worker of several whose name scopes are layers of one
    computation, not towers (bn1 feeds bn2): the worker's graph is its one tower, named by the
    sites' device ("" when they do not share one)."""
    devices = {str(s.device) for s in sites}
    only = devices.pop() if len(devices) == 1 else ""
    return "device", [only], dict.fromkeys((s.name for s in sites), only)


def _layout(groups: list[LayerGroup], variables: dict[str, list[str]]) -> str:
    """How the towers hold the synchronized layers' variables, in words."""
    shared = sum(g.lined_up_by == "shared variables" for g in groups)
    replicated = sum(bool(variables[g.sites[0].name]) for g in groups) - shared
    if not replicated:
        return "shared variables: one copy for all towers" if shared else "no variables: layers lined up by name or structure"
    if not shared:
        return "replicated variables: one copy per tower"
    return f"mixed: {shared} layer(s) with variables shared by the towers, {replicated} with one copy per tower"


def _variables(site: Site) -> list[str]:
    """The variables a site reads as scale and offset, then those its statistics update."""
    return [v for v in (site.scale_var, site.offset_var) if v is not None] + sorted({u.variable for u in site.updates})


def _layer_name(key: str) -> str:
    """The scope of the first shared variable in a group's key, else of its (tower-less) node name."""
    return key.split("|", 1)[0].rsplit("/", 1)[0]


def _mismatch(members: list[Site], tower: dict[str, str], ids: list[str]) -> str:
    seen: dict[str, list[str]] = defaultdict(list)
    for s in members:
        seen[tower[s.name]].append(s.name)
    twice = [t for t, names in seen.items() if len(names) > 1]
    if twice:
        counts = ", ".join(f"{len(seen.get(t, ()))} in {shown_tower(t)}" for t in ids)
        return (f"applied a different number of times in different towers ({counts}): the towers do not run the "
                "same network")
    missing = [t for t in ids if t not in seen]
    if missing:
        return f"missing from tower(s) {', '.join(map(shown_tower, missing))}"
    first = members[0]
    where = f"tower {shown_tower(tower[first.name])}"
    for s in members[1:]:
        there = f"tower {shown_tower(tower[s.name])} ({s.name})"
        for attr in ("op", "data_format", "dtype", "stat_dtype", "epsilon", "avg_factor", "channels"):
            if not _same(getattr(s, attr), getattr(first, attr)):
                return f"{attr} differs between towers ({getattr(first, attr)} in {where} vs {getattr(s, attr)} in {there})"
        if len(s.grads) != len(first.grads):
            return (f"has {len(first.grads)} gradient op(s) in {where} and {len(s.grads)} in {there}: trained in one "
                    "tower and not in the other")
    return ""


def _same(a: object, b: object) -> bool:
    """Equal, NaN counting as equal to NaN (an attr copied from one tower to the next)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def shown_tower(tower: str) -> str:
    """A tower id as messages show it: the towers of nodes without a device have an empty one."""
    return tower or "(no device)"
