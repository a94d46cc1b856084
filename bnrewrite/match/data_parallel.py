"""Whether towers are data-parallel replicas: copies of one model, each fed its own share of the
step's batch, each with its own loss and gradients, combined across copies.

Layers of one model (`batch_normalization`, `batch_normalization_1`), sub-networks chained into
each other (encoder/decoder, generator -> discriminator), separate networks (two streams, a mean
teacher) and one network applied twice inside one gradient computation (Siamese nets, a GAN's
discriminator on real and generated images) are not replicas: each of their batch norms
normalizes what the program gives it, and synchronizing them trains another program. Two facts
of the graph tell them apart, whatever the names:

1. replicas never read each other's activations: a batch norm of one tower that feeds (along
   data edges) a batch norm of another, or runs before it (control edges: the other waits on
   its moving-average updates), makes them layers of one computation, and synchronizing them
   would close a cycle;
2. on one device (or none), where only names told the towers apart, each tower's batch-norm
   gradients must come from a gradient computation of its own: every `tf.gradients` call (and
   tape) seeds its loss with ones made from constants and shapes alone (`Fill`, `OnesLike`, a
   tape's constant `ones`), so
   two towers whose gradients reach one seed were differentiated as one loss, whatever its
   arithmetic (a difference, a sum, weights, a mean over a concat: the walk goes on through
   values made of that seed and shapes). Towers on distinct devices need no such proof (Keras'
   `multi_gpu_model` takes one loss over all of them).

Invariant: "" only for towers that neither feed each other nor, on one device, share a seed.
Both checks are walks over the nodes the sites reach: linear in the graph.
"""

from __future__ import annotations

import math

from tensorflow.core.framework import types_pb2
from tensorflow.core.framework.node_def_pb2 import NodeDef
from tensorflow.python.framework import tensor_util

from bnrewrite.graph.index import Graph
from bnrewrite.graph.names import parse_input
from bnrewrite.graph.nodes import outer_node
from bnrewrite.match.census import Site

#: Ops whose output does not depend on their inputs' values (only on shapes, or nothing).
_VALUE_FREE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "OnesLike", "ZerosLike", "BroadcastArgs"})
_CONSTANT_OPS = frozenset({"Const", "HostConst"})
#: Ops that start a gradient computation: `tf.gradients`' default `grad_ys`, a tape's ones.
_SEED_OPS = frozenset({"Fill", "OnesLike"})
_FLOATS = frozenset({types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE})
#: Ops whose value is fed at run time even where their inputs are constants (Keras' learning phase).
_FED_OPS = frozenset({"PlaceholderWithDefault"})


def not_replicas(graph: Graph, sites: list[Site], tower: dict[str, str], ids: list[str], one_device: bool) -> str:
    """Why the towers `ids` (each site's in `tower`) are not data-parallel replicas, or "".
    `one_device`: the towers were told apart by name scope alone, so their gradients must
    also come from computations of their own."""
    reason = _chained(graph, sites, tower, ids)
    if reason or not one_device:
        return reason
    return _one_gradient_computation(graph, sites, tower, ids)


def _chained(graph: Graph, sites: list[Site], tower: dict[str, str], ids: list[str]) -> str:
    """Why some tower's batch norm feeds, or runs before, another tower's (the first such pair), or ""."""
    index = {t: k for k, t in enumerate(ids)}
    marks: dict[str, int] = {}
    for s in sites:
        for name in (s.name, s.variance):
            if name:
                marks[outer_node(name)] = marks.get(outer_node(name), 0) | 1 << index[tower[s.name]]
    # node -> the towers whose batch norms it reads, directly or not (data or control edges: a wait
    # on another tower's batch norm), pushed to its readers: a node's whole mask is known when the
    # order comes to it (an edge against the order, a loop's back-edge, carries nothing)
    upstream_of: dict[str, int] = dict.fromkeys(marks, 0)
    consumers = graph.consumers
    for name in graph.topological_order():
        upstream = upstream_of.get(name)
        if upstream is None:
            continue
        other = upstream & ~marks.get(name, -1)
        if other:
            fed = next(s for s in sites if name in (outer_node(s.name), outer_node(s.variance or s.name)))
            source = next(s for s in sites if other >> index[tower[s.name]] & 1)
            return (f"batch norm {source.name} feeds batch norm {fed.name} (or its moving-average updates run "
                    f"before it): they are layers of one computation (one model's layers, or networks chained into "
                    f"each other), not copies of a model on separate shares of the batch ({', '.join(ids)} were "
                    "taken for towers)")
        mask = upstream | marks.get(name, 0)
        if mask:
            for reader in consumers.get(name, ()):
                upstream_of[reader] = upstream_of.get(reader, 0) | mask
    return ""


def _one_gradient_computation(graph: Graph, sites: list[Site], tower: dict[str, str], ids: list[str]) -> str:
    """Why the towers' batch-norm gradients do not come from one gradient computation per tower, or ""."""
    value_free: dict[str, bool] = {}
    forward: set[str] = set()  # value-free nodes the forward pass reads: no gradient's seed
    _ancestors(graph, {_walkable(graph, n) for s in sites for n in (s.name, s.variance) if n}, value_free, forward)
    seeds: dict[str, set[str]] = {}
    for t in ids:
        grads = {_walkable(graph, n) for s in sites if tower[s.name] == t for n in (*s.grads, *s.variance_grads)}
        if not grads:
            return (f"tower {t} has no gradient of its own batch norms while they run in training mode (a teacher "
                    f"or target network, or separate models), and on one device nothing but names tells "
                    f"{', '.join(ids)} apart: not taken for data-parallel towers; give --tower-by scope "
                    "(tower_by='scope') if they are")
        found: set[str] = set()
        _ancestors(graph, grads, value_free, found)
        seeds[t] = found - forward
    owner: dict[str, str] = {}
    for t in ids:
        for seed in sorted(seeds[t], key=lambda name: (graph.node(name).op not in _SEED_OPS, name)):
            if seed in owner and owner[seed] != t:
                return (f"towers {owner[seed]} and {t} take their batch-norm gradients from one gradient computation "
                        f"(both from {seed}): one loss over both (a sum, a difference, any arithmetic), as a network applied "
                        "twice (Siamese, a "
                        "discriminator on real and generated data) or separate networks trained together; on one "
                        "device that is not data parallelism: each replica computes its own loss and gradients. "
                        "Give --tower-by scope (tower_by='scope') if they are replicas")
            owner[seed] = t
    return ""


def _walkable(graph: Graph, name: str) -> str:
    """`name` where the graph holds it (a flattened branch's node), else the call that holds it."""
    return name if name in graph else outer_node(name)


def _ancestors(graph: Graph, starts: set[str], value_free: dict[str, bool], seeds: set[str]) -> None:
    """Adds to `seeds` the value-free computed nodes (not constants) among the data ancestors of
    `starts`: those reached through data, and the value-free ones above them up to the seed a
    gradient computation starts from (a summed loss's branches take values made of the one seed
    and shapes: `Fill` -> `add_grad`, `Mul` by a constant weight, a concat's `Slice`)."""
    seen, stack = set(starts), [(name, False) for name in starts]
    while stack:
        name, within = stack.pop()  # within: a value-free node, whose data inputs are not walked
        for spec in graph.node(name).input:
            src, out = parse_input(spec)
            if out < 0 or src in seen:
                continue
            free = _value_free(graph, src, value_free)
            if within and not free:
                continue
            seen.add(src)
            if free and graph.node(src).op in _CONSTANT_OPS:
                if _ones(graph.node(src)):  # a tape's seed: `ones` folded to a constant for a scalar loss
                    seeds.add(src)
                continue
            if free:
                seeds.add(src)
            stack.append((src, free))


def _ones(node: NodeDef) -> bool:
    """Whether a constant holds a few floating-point ones and nothing else (what
    `tf.GradientTape` seeds a scalar loss with in graph mode)."""
    tensor = node.attr["value"].tensor if "value" in node.attr else None
    if tensor is None or tensor.dtype not in _FLOATS or math.prod(d.size for d in tensor.tensor_shape.dim) > 16:
        return False
    value = tensor_util.MakeNdarray(tensor)
    return bool(value.size) and bool((value == 1).all())


def _value_free(graph: Graph, name: str, memo: dict[str, bool]) -> bool:
    """Whether `name`'s output is made from constants and shapes alone (memoized, iterative)."""
    stack, expanded = [name], set()
    while stack:
        current = stack[-1]
        if current in memo:
            stack.pop()
            continue
        node = graph.node(current)
        if node.op in _FED_OPS:
            memo[current] = False
            stack.pop()
            continue
        if node.op in _CONSTANT_OPS or node.op in _VALUE_FREE_OPS:
            memo[current] = True
            stack.pop()
            continue
        sources = [src for src, out in map(parse_input, node.input) if out >= 0]
        if not sources:
            memo[current] = False  # a placeholder, variable, iterator: data
            stack.pop()
            continue
        pending = [src for src in sources if src not in memo]
        if pending and current not in expanded:
            expanded.add(current)
            stack.extend(pending)
            continue
        stack.pop()  # inputs still open on the way back wait on this node (a loop): data, not constants
        memo[current] = not pending and all(memo[src] for src in sources)
    return memo[name]
