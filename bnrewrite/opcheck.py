"""What TensorFlow's import would reject in a node, found from the op's registered OpDef
without importing the graph: attr values of the wrong kind, an unknown or disallowed dtype
or string, an input reading an output its producer does not have.

The rewrite reads batch-norm attrs (epsilon, T, ...) to build new nodes and keeps every
other node as it is, so a malformed value must be an error here, not an exception in a
pass or an output TensorFlow cannot import.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from tensorflow.core.framework import types_pb2

from bnrewrite.errors import GraphValidationError
from bnrewrite.graph import Graph

#: OpDef attr type -> the AttrValue field that holds it.
_KIND = {"float": "f", "int": "i", "string": "s", "bool": "b", "type": "type", "shape": "shape",
         "tensor": "tensor", "func": "func"}
_KIND_NAME = {field: kind for kind, field in _KIND.items()} | {"list": "list", "placeholder": "placeholder"}


@cache
def _op_def(op: str) -> Any:
    from tensorflow.python.framework import op_def_registry

    return op_def_registry.get(op)


def _type_name(value: int) -> str:
    return types_pb2.DataType.Name(value) if value in types_pb2.DataType.values() else f"unknown dtype {value}"


def check_attrs(node: Any) -> None:
    """Raise GraphValidationError when an attr of `node` does not fit its op's OpDef: a value
    of another kind (epsilon as a string), a dtype that is no DataType or that the op does not
    take. Ops TensorFlow does not register (functions) are not checked."""
    op_def = _op_def(node.op)
    if op_def is None:
        return
    for attr in op_def.attr:
        if attr.name not in node.attr:
            continue
        value = node.attr[attr.name]
        kind = value.WhichOneof("value")
        if kind == "placeholder":  # a function body's attr, bound when it is called
            continue
        expected = "list" if attr.type.startswith("list(") else _KIND.get(attr.type)
        if expected is not None and kind != expected and not (expected == "list" and kind is None):
            raise GraphValidationError(
                f"node {node.name!r} ({node.op}): attr {attr.name} holds a {_KIND_NAME.get(kind or '', 'empty')} value where "
                f"{node.op} takes a {attr.type}")
        if attr.type == "string" and attr.allowed_values.list.s and value.s not in attr.allowed_values.list.s:
            takes = ", ".join(v.decode() for v in attr.allowed_values.list.s)
            raise GraphValidationError(
                f"node {node.name!r} ({node.op}): attr {attr.name} is {value.s[:40]!r}; {node.op} takes {takes}")
        if attr.type == "type":
            allowed = attr.allowed_values.list.type
            if value.type not in types_pb2.DataType.values() or value.type == types_pb2.DT_INVALID or (
                    allowed and value.type not in allowed):
                takes = ", ".join(_type_name(t) for t in allowed) if allowed else "a valid dtype"
                raise GraphValidationError(
                    f"node {node.name!r} ({node.op}): attr {attr.name} is {_type_name(value.type)}; "
                    f"{node.op} takes {takes}")


def _outputs(node: Any) -> int | None:
    """How many outputs `node` has, from its OpDef (None for an op TensorFlow does not register)."""
    op_def = _op_def(node.op)
    if op_def is None:
        return None
    count = 0
    for arg in op_def.output_arg:
        if arg.number_attr:
            count += _int_attr(node, op_def, arg.number_attr)
        elif arg.type_list_attr:
            count += len(node.attr[arg.type_list_attr].list.type) if arg.type_list_attr in node.attr else 0
        else:
            count += 1
    return count


def _int_attr(node: Any, op_def: Any, name: str) -> int:
    if name in node.attr:
        return node.attr[name].i
    return next((a.default_value.i for a in op_def.attr if a.name == name), 0)


_UNKNOWN = 1 << 62


def check_output_indices(graph: Graph) -> None:
    """Raise GraphValidationError for an input that reads an output its producer does not have
    (`x:999`). One pass over the data edges; a producer's output count is worked out once."""
    counts: dict[str, int] = {}  # producer -> its output count (a large number when unknown)
    for node in graph:
        for spec in node.input:
            if spec.startswith("^"):
                continue
            src, sep, index = spec.rpartition(":")  # parse_input, inline: this runs once per edge
            if sep and index.isdigit():
                output = int(index)
            else:
                src, output = spec, 0
            count = counts.get(src)
            if count is None:
                if src not in graph:
                    continue
                known = _outputs(graph.node(src))
                count = counts[src] = _UNKNOWN if known is None else known
            if output >= count:
                have = f"has {count} output{'s' if count != 1 else ''}" if count else "has no outputs"
                raise GraphValidationError(f"node {node.name!r} reads {spec!r}, but {src!r} ({graph.node(src).op}) {have}")
