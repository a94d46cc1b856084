"""Building new NodeDefs inside one scope and on one device.

Attribute values are given as plain Python values; `DType` wraps a TensorFlow data type so
that `T=DType(DT_FLOAT)` is told apart from an integer attribute.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
from tensorflow.core.framework import attr_value_pb2, node_def_pb2, types_pb2
from tensorflow.python.framework import tensor_util

from bnrewrite.graph.edit import Editor

R = TypeVar("R")

DT_FLOAT = types_pb2.DT_FLOAT
DT_DOUBLE = types_pb2.DT_DOUBLE
DT_HALF = types_pb2.DT_HALF
DT_BFLOAT16 = types_pb2.DT_BFLOAT16
DT_INT32 = types_pb2.DT_INT32
DT_INT64 = types_pb2.DT_INT64

#: Marks every node bnrewrite creates or replaces; its value names the layer.
MARK = "_bnrewrite"
#: In a flattened function body's node names: `<If>/_fn_then/...` (see bnrewrite.rewrite.functions).
BODY_MARK = "/_fn_"


def outer_node(name: str) -> str:
    """The node of the main graph that holds `name` (the If/While call of a function body's node)."""
    return name.split(BODY_MARK, 1)[0]


@dataclass(frozen=True)
class DType:
    value: int


def dtype_name(dtype: int) -> str:
    return types_pb2.DataType.Name(dtype)[3:].lower()


def set_attr(node: node_def_pb2.NodeDef, key: str, value: object) -> None:
    attr = node.attr[key]
    if isinstance(value, DType):
        attr.type = value.value
    elif isinstance(value, bool):
        attr.b = value
    elif isinstance(value, int):
        attr.i = value
    elif isinstance(value, float):
        attr.f = value
    elif isinstance(value, (str, bytes)):
        attr.s = value.encode() if isinstance(value, str) else value
    elif isinstance(value, list) and all(isinstance(v, DType) for v in value):
        attr.list.type.extend(v.value for v in value)
    elif isinstance(value, attr_value_pb2.AttrValue):
        attr.CopyFrom(value)
    else:
        raise TypeError(f"unsupported attribute value for {key}: {value!r}")


#: The constants one pass has made: (device, function body, (dtype, shape, bytes)) -> node name.
#: Every synced layer needs the same few axes, shapes and scalars; one Const per value, device
#: and function body serves every layer there (it is named in the first layer that asked for
#: it), which keeps the rewritten graph, and the time to build and import it, small.
ConstPool = dict[tuple[str, str, tuple[str, tuple[int, ...], bytes]], str]


@dataclass
class Shared:
    """What the builders of one pass share: its constants, the sum node of each local
    all-reduce (its shared name -> the AddN every member adds its input to), the Pack of each
    local gather (its shared name -> the Pack and each member's inputs to it), what
    `Builder.once` built, and each layer's static counts ((layer, phase) -> tower -> (its count,
    its sync group's), see bnrewrite.rewrite.passes.sites.static_counts)."""

    consts: ConstPool = field(default_factory=dict)
    sums: dict[str, str] = field(default_factory=dict)
    gathers: dict[str, tuple[str, dict[int, list[str]]]] = field(default_factory=dict)
    built: dict[tuple[str, ...], Any] = field(default_factory=dict)
    counts: dict[tuple[int, int], dict[str, tuple[int | None, tuple[int, ...] | None]]] = field(default_factory=dict)


def _body_of(scope: str) -> str:
    """The flattened function body a scope lies in ('' for the graph itself): constants are
    shared only within one, since each body is written back to a FunctionDef of its own.

    Bodies are flattened under `<top-level If>/_fn_<branch>`, so the first mark ends the
    prefix (a gradient body's names repeat the forward body's further on).
    """
    mark = scope.find(BODY_MARK)
    if mark < 0:
        return ""
    end = scope.find("/", mark + len(BODY_MARK))
    return scope if end < 0 else scope[:end]


class Builder:
    """Adds nodes named `<scope>/<name>` on `device` to an Editor, each carrying MARK.

    Constants (and local all-reduces) are `shared` with the other builders of the same pass.
    """

    def __init__(self, editor: Editor, scope: str, device: str, layer: str, shared: Shared) -> None:
        self.editor = editor
        self.scope = scope
        self.device = device
        self.layer = layer
        self.shared = shared
        self._mark = layer.encode()

    def on(self, device: str) -> "Builder":
        """A builder of the same scope and layer that places its nodes on `device`."""
        return Builder(self.editor, self.scope, device, self.layer, self.shared)

    def once(self, key: tuple[str, ...], make: Callable[[], R]) -> R:
        """make() the first time this pass asks for `key` (a purpose and every tensor make reads),
        else that first result. Towers that read the same tensors (the local backend's one sum,
        and what derives from it) so share one copy, built by the first on its device; towers
        of other backends read tensors of their own and each build theirs."""
        if key not in self.shared.built:
            self.shared.built[key] = make()
        return self.shared.built[key]

    def node(self, op: str, name: str, inputs: Sequence[str], **attrs: object) -> str:
        """Add a node; returns its name (which is also its output-0 tensor)."""
        unique = self.editor.unique_name(f"{self.scope}/{name}")
        node = self.editor.new_node(op=op, name=unique, input=inputs, device=self.device)
        for key, value in attrs.items():
            set_attr(node, key, value)
        node.attr[MARK].s = self._mark
        self.editor.add(node)
        return unique

    def const(self, name: str, value: object, dtype: type = np.int32) -> str:
        array = np.asarray(value, dtype=dtype)
        value = (array.dtype.str, array.shape, array.tobytes())
        slot = (self.device, _body_of(self.scope), value)
        consts = self.shared.consts
        if slot not in consts:
            attr = _tensor_attr(*value)
            consts[slot] = self.node("Const", name, [], dtype=DType(attr.tensor.dtype), value=attr)
        return consts[slot]

    def cast(self, name: str, tensor: str, src: int, dst: int) -> str:
        if src == dst:
            return tensor
        return self.node("Cast", name, [tensor], SrcT=DType(src), DstT=DType(dst), Truncate=False)

    def binary(self, op: str, name: str, a: str, b: str, dtype: int) -> str:
        return self.node(op, name, [a, b], T=DType(dtype))

    def unary(self, op: str, name: str, a: str, dtype: int) -> str:
        return self.node(op, name, [a], T=DType(dtype))

    def reduce(self, op: str, name: str, tensor: str, axes: str, dtype: int, keep_dims: bool) -> str:
        """A reduction over `axes` with Sum's signature (Sum, EuclideanNorm, ...)."""
        return self.node(op, name, [tensor, axes], T=DType(dtype), Tidx=DType(DT_INT32), keep_dims=keep_dims)

    def reduce_sum(self, name: str, tensor: str, axes: str, dtype: int, keep_dims: bool) -> str:
        return self.reduce("Sum", name, tensor, axes, dtype, keep_dims)

    def reshape(self, name: str, tensor: str, shape: str, dtype: int) -> str:
        return self.node("Reshape", name, [tensor, shape], T=DType(dtype), Tshape=DType(DT_INT32))

    def count(self, name: str, tensor: str, axes: str, tensor_dtype: int, dtype: int) -> str:
        """Number of elements of `tensor` reduced per channel, as a [1] tensor of `dtype`."""
        shape = self.node("Shape", f"{name}/shape", [tensor], T=DType(tensor_dtype), out_type=DType(DT_INT32))
        zero = self.const(f"{name}/zero", 0)
        picked = self.node(
            "GatherV2", f"{name}/gather", [shape, axes, zero],
            Tparams=DType(DT_INT32), Tindices=DType(DT_INT32), Taxis=DType(DT_INT32), batch_dims=0,
        )
        keep = self.const(f"{name}/axis", [0])
        total = self.node("Prod", f"{name}/prod", [picked, keep], T=DType(DT_INT32), Tidx=DType(DT_INT32), keep_dims=True)
        return self.cast(name, total, DT_INT32, dtype)

    def split_count(self, name: str, packed: str, dtype: int) -> tuple[str, list[str]]:
        """[n, a_1..a_C, b_1..b_C] -> (n as a [1] tensor, [a, b]) after an all-reduce."""
        sizes = self.const(f"{name}/sizes", [1, -1])
        parts = self.node("SplitV", name, [packed, sizes, self.const(f"{name}/axis", 0)], T=DType(dtype), Tlen=DType(DT_INT32), num_split=2)
        return parts, self.split_pairs(name, f"{parts}:1", dtype)

    def split_pairs(self, name: str, packed: str, dtype: int) -> list[str]:
        """[a_1..a_C, b_1..b_C] -> [a, b]."""
        halves = self.node("Split", f"{name}/halves", [self.const(f"{name}/axis", 0), packed], T=DType(dtype), num_split=2)
        return [halves, f"{halves}:1"]

    def per_channel(self, name: str, vector: str, shape: Sequence[int], dtype: int) -> str:
        """A [C] vector reshaped to `shape` to line up with the data; as it is when `shape` is
        empty (channels last: it broadcasts already)."""
        return self.reshape(name, vector, self.const(f"{name}/shape", list(shape)), dtype) if shape else vector

    def concat(self, name: str, tensors: Sequence[str], dtype: int) -> str:
        axis = self.const(f"{name}/axis", 0)
        return self.node("ConcatV2", name, [*tensors, axis], T=DType(dtype), N=len(tensors), Tidx=DType(DT_INT32))


def identity_n(name: str, inputs: list[str], types: list[int], device: str, layer: str) -> node_def_pb2.NodeDef:
    """An IdentityN carrying the layer's mark: in the place and under the name of a replaced op
    (its consumers keep reading it), or holding outputs moved off an op that stays."""
    node = node_def_pb2.NodeDef(op="IdentityN", name=name, device=device)
    node.input.extend(inputs)
    set_attr(node, "T", [DType(t) for t in types])
    set_attr(node, MARK, layer)
    return node


@functools.lru_cache(maxsize=4096)
def _tensor_attr(dtype: str, shape: tuple[int, ...], data: bytes) -> attr_value_pb2.AttrValue:
    """The AttrValue of a constant, made once per value: the same axes, shapes and scalars
    recur in every layer. Shared: `set_attr` copies it into the node."""
    attr = attr_value_pb2.AttrValue()
    attr.tensor.CopyFrom(tensor_util.make_tensor_proto(np.frombuffer(data, dtype).reshape(shape)))
    return attr
