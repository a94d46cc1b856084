"""Whether towers with their own copies of every variable train one model or several.

Per-tower copies are replicas of one model only when their training meets per variable: a
copy's writer takes a value shaped like the variable that mixes several towers' gradients
(summed, averaged, all-reduced) or copies (parameter averaging, in the train op or a separate
op). A value that reaches a writer only through a rank-0 tensor (a global norm, a shared
learning rate or global_step, a loss summed for logging) mixes no element of one tower's copy
into another's: towers coupled only that way (or not at all: tf_cnn_benchmarks'
`--variable_update=independent`) are K trainings in one graph, and synchronizing their batch
norm would couple them into something no single device trains.
"""

from __future__ import annotations

from bnrewrite.graph.index import Graph
from bnrewrite.graph.names import parse_input
from bnrewrite.match.sites import VARIABLE_OPS
from bnrewrite.match.towers import Towers
from bnrewrite.match.updates import writers

#: All-reduces of the input graph (a trainer's own): their peers meet by keys, not edges, and
#: each output is the sum over every tower of the worker.
_ALL_REDUCE_OPS = frozenset({"NcclAllReduce", "CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3"})


def trained_apart(graph: Graph, towers: Towers, sync_groups: tuple[tuple[str, ...], ...]) -> str:
    """Why the towers of some sync group train separate models, or "" when each group may hold
    replicas of one.

    Towers are joined when a writer of one tower's scale/offset copy takes (by any input but the
    variable written) values of two or more towers: each tower's batch norms, their gradients
    and its copies (read) mark what flows from them, along data edges that are not rank-0.
    Refused: some sync group spans towers never joined, while every tower's copies are written
    from the tower itself (an optimizer); a graph without such writes (no optimizer, only
    initializers) shows no training and counts as replicas. One pass over the graph.
    """
    if any(group.lined_up_by == "shared variables" for group in towers.groups):
        return ""
    marks: dict[str, int] = {}  # node -> bit of the tower it belongs to
    copies: dict[str, int] = {}  # scale/offset variable -> its tower's index
    for group in towers.groups:
        for k, site in enumerate(group.sites):
            marks.update(dict.fromkeys((site.name, *site.grads, *site.variance_grads), 1 << k))
            copies.update({variable: k for variable in (site.scale_var, site.offset_var) if variable})
    marks.update({variable: 1 << k for variable, k in copies.items()})
    masks = _tower_masks(graph, marks, (1 << len(towers.ids)) - 1)
    trained = [False] * len(towers.ids)
    combined: set[int] = set()  # the towers of each writer that takes two or more (few distinct sets)
    for node, variable in writers(graph).items():
        k = copies.get(variable)
        if k is None:
            continue
        mask = 0
        for src, out in graph.inputs(node)[1:]:  # input 0: the variable written
            mask |= _carried(graph, masks, src, out, graph.node(node).op)
        trained[k] = trained[k] or bool(mask >> k & 1)
        if mask & (mask - 1):
            combined.add(mask | 1 << k)
    root = list(range(len(towers.ids)))
    for mask in combined:
        first = (mask & -mask).bit_length() - 1
        for j in range(first + 1, len(towers.ids)):
            if mask >> j & 1:
                _join(root, j, first)
    index = {tower: k for k, tower in enumerate(towers.ids)}
    if all(len({_find(root, index[t]) for t in group}) == 1 for group in sync_groups) or not all(trained):
        return ""
    models: dict[int, list[str]] = {}
    for k, tower in enumerate(towers.ids):
        models.setdefault(_find(root, k), []).append(tower)
    example = towers.groups[0].sites[0]
    variable = example.scale_var or example.offset_var
    if len(models) == len(towers.ids):
        return (
            f"the towers ({', '.join(towers.ids)}) train independent models: each updates its own copies of the "
            f"variables (e.g. {variable}) from its own gradients alone, with no gradient or copy combined across "
            "towers (a global norm, learning rate or step they share is a scalar and combines none); synchronizing "
            "their batch norm would couple separate trainings, so there is nothing to synchronize"
        )
    shown = "; ".join(", ".join(model) for model in models.values())
    return (
        f"the towers train {len(models)} separate models ({shown}): the copies of the variables (e.g. {variable}) "
        "are combined within each of these groups only; synchronizing batch norm across them would couple "
        "separate trainings: give group_size (--group-size) so that each sync group lies within one model"
    )


def _tower_masks(graph: Graph, marks: dict[str, int], everyone: int) -> dict[str, int]:
    """Per node, the bits of the towers whose marked nodes reach it along data edges that
    `_carried` lets through (nodes reached by none are left out); loop back-edges ignored.
    Shapes are looked up only for the inputs of a node that two towers or more reach, where
    a tower's scalar meets another tower's values: within one tower, a scalar stays that
    tower's (a scalar broadcast to a larger shape by a tower's own ops counts as that shape)."""
    masks: dict[str, int] = {}
    reached = set(marks)  # nodes that a marked node or one with a mask reads into (the others have none)
    consumers = graph.consumers
    for name in graph.topological_order():
        if name not in reached:
            continue
        node = graph.node(name)
        inputs = [(src, out) for src, out in map(parse_input, node.input) if out >= 0 and src in masks]
        mask = marks.get(name, 0)
        for src, _ in inputs:
            mask |= masks[src]
        if mask & (mask - 1):
            mask = marks.get(name, 0)
            for src, out in inputs:
                mask |= _carried(graph, masks, src, out, node.op)
        if mask and node.op in _ALL_REDUCE_OPS:
            mask = everyone
        if mask:
            masks[name] = mask
            reached.update(consumers.get(name, ()))
    return masks


def _carried(graph: Graph, masks: dict[str, int], src: str, out: int, consumer_op: str) -> int:
    """The towers tensor `src:out` carries into a consumer: none when it is rank 0 (a scalar
    mixes no element of a copy), but a variable's handle, read or written, is the variable."""
    mask = masks.get(src, 0)
    if not mask or consumer_op == "ReadVariableOp" or graph.node(src).op in VARIABLE_OPS:
        return mask
    return 0 if graph.static_shape(f"{src}:{out}") == () else mask


def _find(root: list[int], k: int) -> int:
    while root[k] != k:
        root[k] = root[root[k]]
        k = root[k]
    return k


def _join(root: list[int], a: int, b: int) -> None:
    root[_find(root, a)] = _find(root, b)
