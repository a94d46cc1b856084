"""What TensorFlow's import would reject in a node, found from the op's registered OpDef
without importing the graph: an op it does not know, attr values missing, of the wrong kind
or an unknown or disallowed dtype or string, inputs out of order, too many or too few, or
reading an output their producer does not have, or of a dtype they do not take; and a fused
batch norm whose static input shapes its shape function rejects.

The rewrite reads batch-norm attrs (epsilon, T, ...) to build new nodes and keeps every
other node as it is, so a malformed node must be an error here, not an exception in a
pass or an output TensorFlow cannot import. Not checked (the import's shape inference, at
a cost the rewrite's time budget has no room for): the shapes of ops other than batch norms.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from functools import cache
from typing import Any, NamedTuple

from tensorflow.core.framework import types_pb2

from bnrewrite.errors import GraphValidationError
from bnrewrite.graph.index import Graph

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
    #: (attr, required, its AttrValue field or None for a list, allowed strings, allowed dtypes, minimum)
    attrs: tuple[tuple[str, bool, str | None, frozenset[bytes], frozenset[int], int | None], ...]
    takes: "_Types"  # the dtypes of its inputs (_arg_types): their count is the number of data inputs
    gives: "_Types"  # likewise for its outputs


_VALID_TYPES = frozenset(types_pb2.DataType.values()) - {types_pb2.DT_INVALID}


@cache
def _spec(op: str) -> _Spec | None:
    op_def = _op_def(op)
    if op_def is None:
        return None
    defaults = {a.name: a.default_value for a in op_def.attr if a.HasField("default_value")}

    attrs = tuple(
        (a.name, a.name not in defaults, None if a.type.startswith("list(") else _KIND.get(a.type),
         frozenset(a.allowed_values.list.s) if a.type == "string" else frozenset(),
         (frozenset(a.allowed_values.list.type) or _VALID_TYPES) & _VALID_TYPES if a.type == "type" else frozenset(),
         a.minimum if a.type == "int" and a.has_minimum else None)
        for a in op_def.attr)
    return _Spec(op_def, attrs, _arg_types(op_def.input_arg, defaults), _arg_types(op_def.output_arg, defaults))


_REF = 100  # DataType of a reference to dtype t: t + _REF (DT_FLOAT_REF = DT_FLOAT + 100)

#: An OpDef arg, compiled: (fixed dtype, type attr, number attr, type-list attr, _REF for a
#: reference else 0, default dtype, default count, default dtype list).
_Arg = tuple[int, str, str, str, int, int, int, tuple[int, ...]]


class _Types(NamedTuple):
    """The dtypes of an op's inputs (or outputs), one per tensor, compiled from its args for
    _types_of: the same in every node (`fixed`); or set by one type attr (`attr`, with its
    default), or by type and number attrs (`keys`: (attr, is a number, default)), the dtypes
    for each value met memoized; or read per arg (a type-list attr)."""

    fixed: tuple[int, ...] | None
    attr: str
    default: int
    keys: tuple[tuple[str, bool, int], ...]
    memo: dict[Any, tuple[int, ...]]
    args: tuple[_Arg, ...]


def _arg_types(args: Any, defaults: dict[str, Any]) -> _Types:
    """Compile OpDef `args` (input_arg or output_arg) into _Types; `defaults`: attr -> default AttrValue."""
    compiled = tuple(
        (arg.type, arg.type_attr, arg.number_attr, arg.type_list_attr, _REF if arg.is_ref else 0,
         default.type if default is not None else 0, count.i if count is not None else 0,
         tuple(default.list.type) if default is not None else ())
        for arg in args
        for default, count in [(defaults.get(arg.type_attr or arg.type_list_attr), defaults.get(arg.number_attr))])
    if any(listed for _, _, _, listed, *_ in compiled):
        return _Types(None, "", 0, (), {}, compiled)
    keys = {(attr, False, default): None for _, attr, _, _, _, default, _, _ in compiled if attr}
    keys.update({(number, True, count): None for _, _, number, _, _, _, count, _ in compiled if number})
    if not keys:
        return _Types(_dtypes(None, compiled, len(compiled)), "", 0, (), {}, ())  # type: ignore[arg-type]
    if len(keys) == 1 and not next(iter(keys))[1]:
        (attr, _, default), = keys
        return _Types(None, attr, default, (), {}, compiled)
    return _Types(None, "", 0, tuple(keys), {}, compiled)


def _types_of(node: Any, types: _Types, limit: int) -> "tuple[int, ...] | _Untold":
    """The dtypes, one per tensor, that args `types` (_arg_types) take or give in `node`: from
    its attrs, else the OpDef's defaults; 0 for one that cannot be told. More than `limit`
    tensors (an attr sizing an arg): _Untold, their number only."""
    if types.fixed is not None:
        return types.fixed
    attrs = node.attr
    if types.attr:
        key: Any = attrs[types.attr].type if types.attr in attrs else types.default
    elif types.keys:
        key = tuple((attrs[name].i if number else attrs[name].type) if name in attrs else default
                    for name, number, default in types.keys)
    else:
        return _dtypes(node, types.args, limit)
    made = types.memo.get(key)
    if made is None:
        made = _dtypes(node, types.args, limit)
        if type(made) is tuple:
            types.memo[key] = made
    return made


class _Untold:
    """The dtypes of more tensors than are worth listing (an attr sizing an arg, which a
    NodeDef of a few bytes can set to millions): their number, each one's dtype untold (0)."""

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        return 0


#: Output dtypes listed per producer: beyond, only their number is kept (_Untold).
_LISTED = 256


def _dtypes(node: Any, args: Iterable[_Arg], limit: int) -> "tuple[int, ...] | _Untold":
    """_types_of for args read one by one (`node` None: args whose dtypes no attr sets)."""
    attrs = node.attr if node is not None else {}
    runs: list[tuple[int, int]] = []  # (dtype, count)
    for dtype, type_attr, number_attr, list_attr, ref, default, count, default_list in args:
        if list_attr:
            listed = attrs[list_attr].list.type if list_attr in attrs else default_list
            runs.extend((t + ref if 0 < t < _REF else 0, 1) for t in listed)
            continue
        if type_attr:
            dtype = attrs[type_attr].type if type_attr in attrs else default
        if number_attr and number_attr in attrs:
            count = attrs[number_attr].i
        runs.append((dtype + ref if 0 < dtype < _REF else 0, max(count, 0) if number_attr else 1))
    total = sum(count for _, count in runs)
    if total > limit:
        return _Untold(min(total, sys.maxsize))
    return tuple(dtype for dtype, count in runs for _ in range(count))


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


def check_nodes(graph: Graph) -> None:
    """Raise GraphValidationError for the first node TensorFlow's import would reject though
    the rewrite copies it unchanged: an op neither registered nor a function of the graph's
    library, a missing or ill-kinded attr its OpDef does not allow, a data input after a
    control input, an input reading an output its producer does not have (`x:999`) or of a
    dtype it does not take, a number of data inputs its OpDef does not allow, a colocation
    with a node that does not exist. Not checked: shapes (but see check_batch_norm_shapes).
    One pass over the nodes and edges; each op's OpDef is compiled once and each producer's
    output dtypes worked out once."""
    library = graph.library
    signatures = {f.signature.name: _signature(f.signature) for f in library.function} if library is not None else {}
    gives: dict[str, tuple[int, ...] | _Untold | None] = {}  # producer -> its output dtypes (None: not even their count)
    for node in graph:
        spec = _spec(node.op)
        if spec is not None:
            _check_compiled(node, spec)
            takes = spec.takes.fixed if spec.takes.fixed is not None else _types_of(node, spec.takes, len(node.input))
        elif node.op in signatures:
            signature = signatures[node.op]
            takes = () if signature is None else _types_of(node, signature[0], len(node.input))
        else:
            raise GraphValidationError(
                f"node {node.name!r}: op {node.op!r} is neither a TensorFlow op nor a function of the graph's library "
                "(a custom op? bnrewrite can only rewrite graphs TensorFlow imports)")
        data, control, known = 0, False, len(takes)
        for spec_ in node.input:
            if spec_.startswith("^"):
                control = True
                continue
            if control:
                raise GraphValidationError(f"node {node.name!r}: data input {spec_!r} comes after a control input")
            slot = data
            data += 1
            src, sep, index = spec_.rpartition(":")  # parse_input, inline: this runs once per edge
            if sep and index.isdigit():
                output = int(index)
            else:
                src, output = spec_, 0
            made = gives.get(src, _NOT_YET)
            if made is _NOT_YET:
                if src not in graph:
                    continue
                made = gives[src] = _gives(graph.node(src), signatures)
            if made is None:
                continue
            if output >= len(made):
                count = len(made)
                have = f"has {count} output{'s' if count != 1 else ''}" if count else "has no outputs"
                raise GraphValidationError(f"node {node.name!r} reads {spec_!r}, but {src!r} ({graph.node(src).op}) {have}")
            if slot < known and takes[slot] != made[output]:
                _check_edge(node, slot, takes[slot], src, output, made[output])
        if "_class" in node.attr:
            _check_colocation(graph, node)
        if spec is not None and data != known:
            raise GraphValidationError(
                f"node {node.name!r} ({node.op}) has {data} data input{'s' if data != 1 else ''}; {node.op} takes {known}")


_NOT_YET: Any = object()


def _check_edge(node: Any, slot: int, expected: int, src: str, output: int, actual: int) -> None:
    """Raise GraphValidationError when input `slot` of `node`, which takes dtype `expected`,
    reads `src:output` of another dtype, `actual`, and TensorFlow's import would refuse it: it
    passes a reference feeding an input of its base dtype (read through it), never a value
    feeding a reference input; nor is refused an edge of a dtype that cannot be told (0)."""
    if actual - _REF == expected or not actual or not expected:
        return
    raise GraphValidationError(
        f"node {node.name!r} ({node.op}) input {slot} reads '{src}:{output}' of {_dtype_name(actual)}, "
        f"where it takes {_dtype_name(expected)}")


def _signature(signature: Any) -> tuple[_Types, _Types] | None:
    """A library function's input and output dtypes (_arg_types), from its signature; None
    when an arg's count depends on how it is called (a number or type-list attr)."""
    if any(arg.number_attr or arg.type_list_attr for arg in (*signature.input_arg, *signature.output_arg)):
        return None
    return _arg_types(signature.input_arg, {}), _arg_types(signature.output_arg, {})


def _gives(node: Any, signatures: dict[str, tuple[_Types, _Types] | None]) -> tuple[int, ...] | _Untold | None:
    """The dtypes of `node`'s outputs (0 for one that cannot be told); None when not even their
    number is known (a function whose args are sized when it is called)."""
    spec = _spec(node.op)
    if spec is not None:
        return _types_of(node, spec.gives, _LISTED)
    signature = signatures.get(node.op)
    return None if signature is None else _types_of(node, signature[1], _LISTED)


def _dtype_name(dtype: int) -> str:
    """DT_FLOAT_REF -> float_ref, as TensorFlow's messages write it."""
    return types_pb2.DataType.Name(dtype)[3:].lower() if dtype in types_pb2.DataType.values() else f"dtype {dtype}"


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
