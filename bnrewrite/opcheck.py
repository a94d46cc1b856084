"""What TensorFlow's import would reject in a node, found from the op's registered OpDef
without importing the graph: an op it does not know, attr values missing, of the wrong kind
or an unknown or disallowed dtype or string, inputs out of order, too many or too few, or
reading an output their producer does not have; and a fused batch norm whose static input
shapes its shape function rejects.

The rewrite reads batch-norm attrs (epsilon, T, ...) to build new nodes and keeps every
other node as it is, so a malformed node must be an error here, not an exception in a
pass or an output TensorFlow cannot import. Not checked (the import's own work, at a cost
the rewrite's time budget has no room for): the dtype each edge carries, and the shapes of
ops other than batch norms.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

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
        if attr.name in node.attr:
            _check_attr(node, attr)


def _check_attr(node: Any, attr: Any) -> None:
    """Raise GraphValidationError when `node`'s value of OpDef attr `attr` (present) does not fit it."""
    value = node.attr[attr.name]
    kind = value.WhichOneof("value")
    if kind == "placeholder":  # a function body's attr, bound when it is called
        return
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
    if attr.type == "int" and attr.has_minimum and value.i < attr.minimum:
        raise GraphValidationError(
            f"node {node.name!r} ({node.op}): attr {attr.name} is {value.i}; {node.op} takes at least {attr.minimum}")


class _Spec(NamedTuple):
    """What check_nodes checks in a node of one registered op, compiled from its OpDef once
    into plain values (reading OpDef protos per node would cost more than the check)."""

    op_def: Any
    inputs: int  # data inputs of the input args of a fixed size
    sized: tuple[tuple[str, bool, int], ...]  # (attr, is a type list, default) of input args sized by an attr
    outputs: int  # likewise for the output args
    out_sized: tuple[tuple[str, bool, int], ...]
    #: (attr, required, its AttrValue field or None for a list, allowed strings, allowed dtypes, minimum)
    attrs: tuple[tuple[str, bool, str | None, frozenset[bytes], frozenset[int], int | None], ...]


_VALID_TYPES = frozenset(types_pb2.DataType.values()) - {types_pb2.DT_INVALID}


@cache
def _spec(op: str) -> _Spec | None:
    op_def = _op_def(op)
    if op_def is None:
        return None
    defaults = {a.name: a.default_value for a in op_def.attr if a.HasField("default_value")}

    def sized(args: Any) -> tuple[tuple[str, bool, int], ...]:
        return tuple(
            (arg.number_attr, False, defaults[arg.number_attr].i if arg.number_attr in defaults else 0) if arg.number_attr
            else (arg.type_list_attr, True,
                  len(defaults[arg.type_list_attr].list.type) if arg.type_list_attr in defaults else 0)
            for arg in args if arg.number_attr or arg.type_list_attr)

    ins, outs = sized(op_def.input_arg), sized(op_def.output_arg)
    attrs = tuple(
        (a.name, a.name not in defaults, None if a.type.startswith("list(") else _KIND.get(a.type),
         frozenset(a.allowed_values.list.s) if a.type == "string" else frozenset(),
         (frozenset(a.allowed_values.list.type) or _VALID_TYPES) & _VALID_TYPES if a.type == "type" else frozenset(),
         a.minimum if a.type == "int" and a.has_minimum else None)
        for a in op_def.attr)
    return _Spec(op_def, len(op_def.input_arg) - len(ins), ins, len(op_def.output_arg) - len(outs), outs, attrs)


def _check_compiled(node: Any, spec: _Spec) -> None:
    """check_attrs from the compiled spec, plus every attr without a default present."""
    attrs = node.attr
    for name, required, field, strings, types, minimum in spec.attrs:
        if name not in attrs:
            if required:
                raise GraphValidationError(
                    f"node {node.name!r} ({node.op}): attr {name} is missing; {node.op} has no default for it")
            continue
        value = attrs[name]
        kind = value.WhichOneof("value")
        if field is None and kind in ("list", None) or kind == field and (
                not strings or value.s in strings) and (not types or value.type in types) and (
                minimum is None or value.i >= minimum):
            continue
        _check_attr(node, next(a for a in spec.op_def.attr if a.name == name))  # raises, with the message


def _check_colocation(graph: Graph, node: Any) -> None:
    """TensorFlow's import rejects a colocation (`_class: loc:@name`) with a node not in the graph."""
    for entry in node.attr["_class"].list.s:
        if entry.startswith(b"loc:@") and entry[5:].decode(errors="replace") not in graph:
            raise GraphValidationError(
                f"node {node.name!r} is to be colocated with {entry[5:].decode(errors='replace')!r}, which does not exist")


def _count(node: Any, fixed: int, sized: tuple[tuple[str, bool, int], ...]) -> int:
    """How many tensors args take: `fixed` plus those sized by an attr of `node` (or its default)."""
    for name, is_list, default in sized:
        if name not in node.attr:
            fixed += default
        else:
            fixed += len(node.attr[name].list.type) if is_list else node.attr[name].i
    return fixed


_UNKNOWN = 1 << 62


def check_nodes(graph: Graph) -> None:
    """Raise GraphValidationError for the first node TensorFlow's import would reject for its
    NodeDef alone, though the rewrite copies it unchanged: an op neither registered nor a
    function of the graph's library, a data input after a control input, an input reading an
    output its producer does not have (`x:999`), a number of data inputs or a missing or
    ill-kinded attr its OpDef does not allow, a colocation with a node that does not exist.
    Not checked: the dtypes an edge carries, and shapes (but see check_batch_norm_shapes). One pass over the nodes and edges; each op's OpDef
    is compiled once and a producer's output count worked out once."""
    library = graph.library
    functions = {f.signature.name for f in library.function} if library is not None else set()
    counts: dict[str, int] = {}  # producer -> its output count (a large number when unknown)
    for node in graph:
        spec = _spec(node.op)
        if spec is None and node.op not in functions:
            raise GraphValidationError(
                f"node {node.name!r}: op {node.op!r} is neither a TensorFlow op nor a function of the graph's library "
                "(a custom op? bnrewrite can only rewrite graphs TensorFlow imports)")
        data, control = 0, False
        for spec_ in node.input:
            if spec_.startswith("^"):
                control = True
                continue
            if control:
                raise GraphValidationError(f"node {node.name!r}: data input {spec_!r} comes after a control input")
            data += 1
            src, sep, index = spec_.rpartition(":")  # parse_input, inline: this runs once per edge
            if sep and index.isdigit():
                output = int(index)
            else:
                src, output = spec_, 0
            count = counts.get(src)
            if count is None:
                if src not in graph:
                    continue
                producer = graph.node(src)
                known = _spec(producer.op)
                count = counts[src] = _UNKNOWN if known is None else _count(producer, known.outputs, known.out_sized)
            if output >= count:
                have = f"has {count} output{'s' if count != 1 else ''}" if count else "has no outputs"
                raise GraphValidationError(f"node {node.name!r} reads {spec_!r}, but {src!r} ({graph.node(src).op}) {have}")
        if "_class" in node.attr:
            _check_colocation(graph, node)
        if spec is None:
            continue
        _check_compiled(node, spec)
        expected = _count(node, spec.inputs, spec.sized) if spec.sized else spec.inputs
        if data != expected:
            raise GraphValidationError(
                f"node {node.name!r} ({node.op}) has {data} data input{'s' if data != 1 else ''}; {node.op} takes {expected}")


_FIVE_D = (b"NDHWC", b"NCDHW")


def check_batch_norm_shapes(graph: Graph, node: Any) -> None:
    """Raise GraphValidationError where the static shapes of a fused batch norm's inputs (or
    its gradient's) break TensorFlow's shape function for the op, which the import runs: x (and
    the gradient's dy) of the rank data_format says, scale, offset and, unless the op computes
    them, mean and variance vectors of x's channel count. The rewrite keeps such an op; only
    shapes known statically (Graph.static_shape) are compared. Call after check_attrs."""
    data_format = node.attr["data_format"].s if "data_format" in node.attr else b"NHWC"
    rank = 5 if data_format in _FIVE_D else 4
    channel_axis = data_format.find(b"C")
    gradient = node.op.startswith("FusedBatchNormGrad")
    if gradient:
        tensors, vectors = (0, 1), (2,)
    else:
        is_training = node.attr["is_training"].b if "is_training" in node.attr else True
        factor = node.attr["exponential_avg_factor"].f if "exponential_avg_factor" in node.attr else 1.0
        tensors, vectors = (0,), (1, 2) if is_training and factor == 1.0 else (1, 2, 3, 4)
    channels, seen = -1, ""
    for slot in (*tensors, *vectors):
        if slot >= len(node.input):
            return
        shape = graph.static_shape(node.input[slot])
        if shape is None:
            continue
        want = 1 if slot in vectors else rank
        if len(shape) != want:
            raise GraphValidationError(
                f"node {node.name!r} ({node.op}): input {slot} {node.input[slot]!r} has shape {list(shape)}, "
                f"of rank {len(shape)}; it takes rank {want}" + ("" if want == 1 else f" (data_format {data_format.decode()})"))
        size = shape[0] if slot in vectors else shape[channel_axis]
        if size >= 0 and channels >= 0 and size != channels:
            raise GraphValidationError(
                f"node {node.name!r} ({node.op}): input {slot} {node.input[slot]!r} has {size} channels where {seen} has "
                f"{channels} (data_format {data_format.decode()})")
        if size >= 0 and channels < 0:
            channels, seen = size, repr(node.input[slot])
