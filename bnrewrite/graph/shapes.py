"""Static shapes of a GraphDef's tensors, inferred from the graph itself.

A GraphDef saved without `_output_shapes` (`graph.as_graph_def()`, a bare .pb) still tells
the shapes the rewrite's decisions need (how many elements a batch-norm input has per tower):
placeholders, variables and constants carry theirs in attributes, and the ops between them
and a batch norm (convolutions, pools, elementwise ops, reshapes, reductions, splits and
slices...) fix the rest.
`ShapeInference` propagates them upstream-first from the tensors asked about, visiting each
ancestor once and only through ops it knows: an op it does not know, a missing attribute or a
non-constant shape argument leaves the shape unknown (None), never a guess. Each rule follows
TensorFlow's own shape function for the op, so what it infers is what a tf.Graph records.
A node's recorded `_output_shapes`, where present, is taken as it is.

A shape is a tuple of dimensions, -1 for an unknown one, or None for an unknown rank.
"""

from __future__ import annotations

import functools
from typing import Callable

from bnrewrite.graph.names import parse_input
from bnrewrite.graph.shape_rules import RULES, NodeDef, Shape, from_proto


class ShapeInference:
    """Output shapes of the nodes `node(name)` returns (None: no such node), inferred on demand
    and kept: asking about a tensor visits its ancestors not asked about before, iteratively."""

    def __init__(self, node: Callable[[str], NodeDef | None]) -> None:
        self._node = node
        self._shapes: dict[str, tuple[Shape, ...]] = {}

    def shape(self, name: str, output: int = 0) -> Shape:
        shapes = self._shapes.get(name)
        if shapes is None:
            self._infer(name)
            shapes = self._shapes[name]
        return shapes[output] if 0 <= output < len(shapes) else None

    def _infer(self, root: str) -> None:
        shapes, expanded, stack = self._shapes, set(), [root]
        while stack:
            name = stack[-1]
            if name in shapes:
                stack.pop()
                continue
            node = self._node(name)
            rule = None if node is None else RULES.get(node.op)
            if node is None or "_output_shapes" in node.attr or rule is None:
                shapes[name] = _recorded(node)
                stack.pop()
                continue
            inputs = [parse_input(spec) for spec in node.input if not spec.startswith("^")]
            pending = [src for src, _ in inputs if src not in shapes]
            if pending and name not in expanded:
                expanded.add(name)
                stack.extend(pending)
                continue
            stack.pop()
            if pending:  # back with inputs still open: they wait on this node (a loop)
                shapes[name] = ()
                continue
            known = [shapes[src][out] if out < len(shapes[src]) else None for src, out in inputs]
            try:
                shapes[name] = rule(node, known, functools.partial(self._producer, inputs))
            except (ValueError, IndexError, TypeError, ZeroDivisionError):  # attributes TensorFlow would refuse
                shapes[name] = ()


    def _producer(self, inputs: list[tuple[str, int]], i: int) -> NodeDef | None:
        """The node whose output 0 is data input i (a Const that shape arguments come from)."""
        return self._node(inputs[i][0]) if i < len(inputs) and inputs[i][1] == 0 else None


def _recorded(node: NodeDef | None) -> tuple[Shape, ...]:
    if node is None or "_output_shapes" not in node.attr:
        return ()
    return tuple(from_proto(s) for s in node.attr["_output_shapes"].list.shape)
