"""One group per application of a layer that each tower applies several times.

A GAN's discriminator judges real and generated images, a Siamese net embeds both images of a
pair: each tower applies the same layer (the same variables) m times, each time to a batch of
its own. One device fed every tower's examples normalizes each application over all of them,
so each application is synchronized with its counterparts in the other towers, never with the
layer's other applications. Two things the graph shows tell the counterparts:

1. names: a site's name without the parts that name a tower (`tower_0/D_1/bn` -> `D_1/bn`);
   every tower runs the same code, so TensorFlow uniquifies each application's scope alike;
2. structure: the op types a few steps upstream of the site, which already lined-up layers
   it runs after (the discriminator's application to generated images runs after the
   generator's layers, its second layer after its own first), and which inputs (placeholders,
   input pipelines) its data comes from, by name with the tower parts taken out (a Siamese
   net's first image or its second).

When both decide they must agree. When neither does (MirroredStrategy's replica 0 sits beside
the calls that built the model, so its applications are `encoder_2`, `encoder_3` where replica 1's
are `encoder`, `encoder_1`, and a symmetric network reads inputs named alike), a third tells:

3. scope numbering: TensorFlow numbers a scope entered again in the order the code enters it,
   and every tower runs the same code, so the application numbered k-th in one tower goes with
   the k-th in every other. It applies when the copies' names differ only in those numbers.

Applications that none tells apart, or that names and structure pair differently, are skipped
with the reason rather than paired by a guess.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable

from bnrewrite.graph.index import Graph
from bnrewrite.graph.ops import DATA_SOURCE_OPS
from bnrewrite.match.census import Site, Skip
from bnrewrite.match.lineup import DEPTH, role, structure

#: A layer's name, its copies and what lined them up (towers.py's candidate groups).
Candidate = tuple[str, list[Site], str]
#: A name component's scope number: `encoder_3` is the fourth `encoder` TensorFlow made.
_NUMBERED = re.compile(r"(.*?)(?:_(\d+))?")


def split_applications(
    graph: Graph, candidates: list[Candidate], tower: dict[str, str], ids: list[str], scope_towers: bool,
) -> tuple[list[Candidate], list[Skip], list[str]]:
    """`candidates` with every layer applied m > 1 times in every tower replaced by m groups,
    one per application (named after the application's own scope); the skips of those whose
    applications cannot be told apart; a line for the report on each layer split. Layers
    applied a different number of times in different towers are left for towers.py to skip."""
    repeated: list[Candidate] = []
    kept: list[Candidate] = []
    for candidate in candidates:
        (repeated if _applied(candidate[1], tower, ids) > 1 else kept).append(candidate)
    if not repeated:
        return candidates, [], []
    group_of = {s.name: i for i, (_, members, _) in enumerate(kept) for s in members}
    everything = [s.name for _, members, _ in candidates for s in members]
    applied = [s.name for _, members, _ in repeated for s in members]
    upstream = graph.ancestors_among(applied, everything)
    fed_by = graph.ancestors_among(applied, [node.name for node in graph if node.op in DATA_SOURCE_OPS])
    memo: dict[tuple[str, int], str] = {}

    def scope_of(s: Site) -> str | None:
        return tower[s.name] if scope_towers else None

    def signature(s: Site) -> str:
        after = sorted({group_of[a] for a in upstream[s.name] if a in group_of and tower[a] == tower[s.name]})
        data = sorted({role(source, scope_of(s)) for source in fed_by[s.name]})
        return f"{structure(graph, s.name, DEPTH, memo)}|{after}|{data}"

    def by_name(s: Site) -> str:
        return role(s.name, scope_of(s))

    rank = {name: i for i, name in enumerate(graph.sorted_topologically(applied))}
    skips: list[Skip] = []
    split: list[str] = []
    for name, members, how in sorted(repeated, key=lambda c: min(rank[s.name] for s in c[1])):
        named, structured = _pair(members, tower, ids, by_name), _pair(members, tower, ids, signature)
        numbered = [] if named or structured else _by_numbering(members, tower, ids, by_name)
        if named and structured and _as_sets(named) != _as_sets(structured):
            reason = "its names and its structure pair them differently"
        elif not named and not structured and not numbered:
            reason = "neither their names, their structure nor their scopes' numbering tell which goes with which"
        else:
            pairs = named or structured or numbered
            labels = _application_names(name, pairs, by_name)
            for label, copies in zip(labels, pairs):
                group_of.update((s.name, len(kept)) for s in copies)
                kept.append((label, copies, how))
            told = ("names and structure" if named and structured else "names" if named else
                    "structure" if structured else "the order of their scopes' numbers")
            split.append(f"{name} ({len(pairs)}: {', '.join(labels)}; told apart by {told})")
            continue
        count = _applied(members, tower, ids)
        skips.extend(Skip(s.name, f"applied {count} times in each tower (one network applied to several batches, "
                                  f"e.g. a discriminator on real and on generated images), and {reason}; left "
                                  "unsynced rather than paired by a guess") for s in members)
    return kept, skips, split


def _applied(members: list[Site], tower: dict[str, str], ids: list[str]) -> int:
    """How many times every tower applies the layer whose copies are `members`; 0 when towers differ."""
    counts: dict[str, int] = defaultdict(int)
    for s in members:
        counts[tower[s.name]] += 1
    found = {counts.get(t, 0) for t in ids}
    return found.pop() if len(found) == 1 else 0


def _pair(members: list[Site], tower: dict[str, str], ids: list[str], key: Callable[[Site], str]) -> list[list[Site]]:
    """The applications, each its copies in tower order, when `key` gives every application
    one copy in every tower; else []."""
    by_key: dict[str, list[Site]] = defaultdict(list)
    for s in members:
        by_key[key(s)].append(s)
    pairs = []
    for copies in by_key.values():
        if sorted(tower[s.name] for s in copies) != sorted(ids):
            return []
        pairs.append(sorted(copies, key=lambda s: ids.index(tower[s.name])))
    return pairs


def _by_numbering(members: list[Site], tower: dict[str, str], ids: list[str],
                  by_name: Callable[[Site], str]) -> list[list[Site]]:
    """The applications paired by rank: in each tower its copies in the order of their scopes'
    numbers (`encoder_2` before `encoder_3`), when every copy's name (without tower parts) is
    the same but for those numbers; else []."""
    per_tower: dict[str, list[tuple[list[int], str]]] = defaultdict(list)
    bases = set()
    for s in members:
        parts = [_NUMBERED.fullmatch(part).groups() for part in by_name(s).split("/")]  # type: ignore[union-attr]
        bases.add(tuple(base for base, _ in parts))
        per_tower[tower[s.name]].append(([int(n or 0) for _, n in parts], s.name))
    if len(bases) != 1:
        return []
    site = {s.name: s for s in members}
    ranked = [sorted(per_tower[t]) for t in ids]
    if any(a[0] == b[0] for copies in ranked for a, b in zip(copies, copies[1:])):
        return []
    return [[site[name] for _, name in copies] for copies in zip(*ranked)]


def _as_sets(pairs: list[list[Site]]) -> set[frozenset[str]]:
    return {frozenset(s.name for s in copies) for copies in pairs}


def _application_names(layer: str, pairs: list[list[Site]], by_name: Callable[[Site], str]) -> list[str]:
    """Each application's name: the scope of its first tower's copy without the tower parts
    (`D/bn`, `D_1/bn`) when those differ and end as `layer` does; else `layer`, numbered."""
    scopes = [by_name(copies[0]).rsplit("/", 1)[0] for copies in pairs]
    last = layer.rsplit("/", 1)[-1]
    if len(set(scopes)) == len(scopes) and all(scope.rsplit("/", 1)[-1] == last for scope in scopes):
        return scopes
    return [f"{layer} (application {j} of {len(pairs)})" for j in range(1, len(pairs) + 1)]
