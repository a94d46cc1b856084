"""The shape rules `ShapeInference` (bnrewrite.graph.shapes) applies, one function per op type:
(node, input shapes, producer of constant inputs) -> output shapes, each following TensorFlow's
own shape function for the op. Apart from the inference's walk so that each reads alone.
Invariant: a rule leaves unknown (-1, None) what attributes and constant inputs do not fix,
never a guess; attributes TensorFlow would refuse raise ValueError, IndexError or TypeError.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
from tensorflow.core.framework import attr_value_pb2, node_def_pb2, tensor_shape_pb2
from tensorflow.python.framework import tensor_util

from bnrewrite.graph.strided_slice import dense_spec, interval

NodeDef = node_def_pb2.NodeDef
Shape = tuple[int, ...] | None
#: The node of an input, if it is in the graph.
Producer = Callable[[int], NodeDef | None]
#: A rule: (node, input shapes, producer) -> output shapes.
Rule = Callable[[NodeDef, list[Shape], Producer], tuple[Shape, ...]]


def from_proto(proto: tensor_shape_pb2.TensorShapeProto) -> Shape:
    return None if proto.unknown_rank else tuple(d.size if d.size >= 0 else -1 for d in proto.dim)


def elements(shape: Shape) -> int | None:
    """The number of elements of a fully known shape, else None."""
    if shape is None or any(d < 0 for d in shape):
        return None
    return math.prod(shape)


def _attr(node: NodeDef, key: str) -> attr_value_pb2.AttrValue | None:
    """The attribute, or None: indexing a missing key would add it to the input's node."""
    return node.attr[key] if key in node.attr else None


def _ints(node: NodeDef, key: str, default: Sequence[int]) -> list[int]:
    value = _attr(node, key)
    return list(value.list.i) if value is not None and value.list.i else list(default)


def _int(node: NodeDef, key: str) -> int:
    value = _attr(node, key)
    return value.i if value is not None else 0


def _text(node: NodeDef, key: str, default: bytes) -> bytes:
    value = _attr(node, key)
    return value.s if value is not None and value.s else default


def _flag(node: NodeDef, key: str) -> bool:
    value = _attr(node, key)
    return value is not None and value.b


def _const(producer: Producer, i: int) -> np.ndarray | None:
    """Input i's value if a Const produces it."""
    node = producer(i)
    if node is None or node.op != "Const" or "value" not in node.attr:
        return None
    return tensor_util.MakeNdarray(node.attr["value"].tensor)


def _merge(dims: Sequence[int]) -> int:
    """One dimension that several must equal: the first known."""
    return next((d for d in dims if d >= 0), -1)


# --- rules: (node, input shapes, producer) -> output shapes ---------------------------------

def _same(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    return (ins[0],)


def _attr_shape(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    value = _attr(node, "shape")
    return () if value is None else (from_proto(value.shape),)


def _const_shape(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    value = _attr(node, "value")
    return () if value is None else (from_proto(value.tensor.tensor_shape),)


def _read_variable(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    handle = producer(0)
    return _attr_shape(handle, ins, producer) if handle is not None and handle.op == "VarHandleOp" else ()


def _scalar(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    return ((),)


def _broadcast(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    """TensorFlow's broadcasting of two shapes (BroadcastBinaryOpOutputShapeFn)."""
    x, y = ins[0], ins[1]
    if x is None or y is None:
        return (None,)
    rank = max(len(x), len(y))
    x, y = (1,) * (rank - len(x)) + x, (1,) * (rank - len(y)) + y
    out = []
    for a, b in zip(x, y):
        if a < 0 or b < 0:
            out.append(a if a > 1 else b if b > 1 else b if a == 1 else a if b == 1 else -1)
        elif a == 1 or b == 1:
            out.append(b if a == 1 else a)
        elif a == b:
            out.append(a)
        else:
            raise ValueError(f"{node.name}: shapes do not broadcast")
    return (tuple(out),)


def _add_n(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    """All inputs have one shape: each dimension is whichever input knows it."""
    known = [s for s in ins if s is not None]
    if not known or len({len(s) for s in known}) > 1:
        return (None,)
    return (tuple(_merge(dims) for dims in zip(*known)),)


def _spatial(node: NodeDef, x: Shape) -> tuple[bool, int, int, int, int] | None:
    """(channels first, batch, height, width, channels) of a 4-d activation, by data_format."""
    layout = _text(node, "data_format", b"NHWC")
    if x is None or len(x) != 4 or layout not in (b"NHWC", b"NCHW"):
        return None
    first = layout == b"NCHW"
    n, c, h, w = x if first else (x[0], x[3], x[1], x[2])
    return first, n, h, w, c


def _window(size: int, k: int, stride: int, dilation: int, padding: bytes, pads: Sequence[int]) -> int:
    """An output dimension of a windowed op (GetWindowedOutputSizeFromDimsV2)."""
    if size < 0 or k < 0:
        return -1
    effective = (k - 1) * dilation + 1
    if padding == b"SAME":
        return (size + stride - 1) // stride
    if padding == b"VALID":
        out = (size - effective + stride) // stride
    elif padding == b"EXPLICIT":
        out = (size + pads[0] + pads[1] - effective + stride) // stride
    else:
        raise ValueError(f"padding {padding!r}")
    if out < 0:
        raise ValueError("window larger than the input")
    return out


def _layout(first: bool, n: int, h: int, w: int, c: int) -> tuple[int, ...]:
    return (n, c, h, w) if first else (n, h, w, c)


def _hw(first: bool, values: Sequence[int]) -> tuple[int, int]:
    """The height and width entries of a per-dimension attribute in data_format order."""
    return (values[2], values[3]) if first else (values[1], values[2])


def _conv(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    x, f = _spatial(node, ins[0]), ins[1]
    if x is None or f is None or len(f) != 4:
        return (None,)
    first, n, h, w, _ = x
    strides, dilations = _ints(node, "strides", ()), _ints(node, "dilations", (1, 1, 1, 1))
    padding = _text(node, "padding", b"")
    pads = _ints(node, "explicit_paddings", (0,) * 8)
    rows, cols = _hw(first, range(4))
    (sh, sw), (dh, dw) = _hw(first, strides), _hw(first, dilations)
    if node.op == "DepthwiseConv2dNative":
        out_c = f[2] * f[3] if f[2] >= 0 and f[3] >= 0 else -1
    else:
        out_c = f[3]
    out_h = _window(h, f[0], sh, dh, padding, pads[2 * rows:2 * rows + 2])
    out_w = _window(w, f[1], sw, dw, padding, pads[2 * cols:2 * cols + 2])
    return (_layout(first, n, out_h, out_w, out_c),)


def _pool(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    x = _spatial(node, ins[0])
    if x is None:
        return (None,)
    first, n, h, w, c = x
    ksize, strides = _ints(node, "ksize", ()), _ints(node, "strides", ())
    if len(ksize) != 4 or len(strides) != 4 or ksize[0] != 1 or ksize[1 if first else 3] != 1:
        return (None,)  # pooling across examples or channels: not followed here
    padding = _text(node, "padding", b"")
    (kh, kw), (sh, sw) = _hw(first, ksize), _hw(first, strides)
    return (_layout(first, n, _window(h, kh, sh, 1, padding, ()), _window(w, kw, sw, 1, padding, ()), c),)


def _bias_add(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    x, bias = ins[0], ins[1]
    if x is None or bias is None or len(bias) != 1 or len(x) < 2:
        return (x,)
    axis = 1 if _text(node, "data_format", b"NHWC") == b"NCHW" else len(x) - 1
    return (x[:axis] + (_merge((x[axis], bias[0])),) + x[axis + 1:],)


def _fused_batch_norm(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    """y as x, then the batch statistics and the first two reserve spaces: vectors of x's
    channel count (merged with scale's); V3's third reserve space is left unknown."""
    x, scale = ins[0], ins[1] if len(ins) > 1 else None
    data_format = _text(node, "data_format", b"NHWC")
    channels = [x[data_format.find(b"C")]] if x is not None and len(x) == len(data_format) else []
    if scale is not None and len(scale) == 1:
        channels.append(scale[0])
    vector = (_merge(channels),) if channels else (-1,)
    return (x, vector, vector, vector, vector, *((None,) if node.op == "FusedBatchNormV3" else ()))


def _reduce(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    x, axes = ins[0], _const(producer, 1)
    keep = _flag(node, "keep_dims")
    if x is None or axes is None:
        return (None if x is None or not keep else (-1,) * len(x),)
    rank = len(x)
    reduced = set()
    for a in np.asarray(axes).reshape(-1).tolist():
        if not -rank <= a < rank:
            raise ValueError("reduction axis out of range")
        reduced.add(a % rank)
    if keep:
        return (tuple(1 if i in reduced else d for i, d in enumerate(x)),)
    return (tuple(d for i, d in enumerate(x) if i not in reduced),)


def _reshape(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    target = _const(producer, 1)
    if target is None:  # the rank, if the shape argument's length is known
        size = ins[1]
        return (None if size is None or len(size) != 1 or size[0] < 0 else (-1,) * size[0],)
    dims = [int(d) for d in np.asarray(target).reshape(-1)]
    free = [i for i, d in enumerate(dims) if d == -1]
    if len(free) > 1 or any(d < -1 for d in dims):
        raise ValueError("bad reshape target")
    if free:
        total, rest = elements(ins[0]), math.prod(d for d in dims if d >= 0)
        if total is not None and rest > 0:
            if total % rest:
                raise ValueError("reshape does not divide")
            dims[free[0]] = total // rest
    return (tuple(dims),)


def _transpose(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    x, perm = ins[0], _const(producer, 1)
    if perm is None:
        return (None if x is None else (-1,) * len(x),)
    order = [int(p) for p in np.asarray(perm).reshape(-1)]
    if x is None:
        return ((-1,) * len(order),)
    if sorted(order) != list(range(len(x))):
        raise ValueError("bad permutation")
    return (tuple(x[p] for p in order),)


def _pad(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    x, paddings = ins[0], _const(producer, 1)
    if paddings is None:
        return (None if x is None else (-1,) * len(x),)
    pairs = np.asarray(paddings).reshape(-1, 2).tolist()
    if x is not None and len(x) != len(pairs):
        raise ValueError("paddings do not match the rank")
    x = x if x is not None else (-1,) * len(pairs)
    return (tuple(d + before + after if d >= 0 else -1 for d, (before, after) in zip(x, pairs)),)


def _known_ranks(shapes: Sequence[Shape]) -> list[tuple[int, ...]] | None:
    """The shapes, if every rank is known and the same."""
    known = [s for s in shapes if s is not None]
    return known if known and len(known) == len(shapes) and len({len(s) for s in known}) == 1 else None


def _concat(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    count = len(ins) - 1
    axis, parts = _const(producer, count), _known_ranks(ins[:count])
    if axis is None or parts is None:
        return (None,)
    rank, a = len(parts[0]), int(axis)
    if not -rank <= a < rank:
        raise ValueError("concat axis out of range")
    a %= rank
    out = []
    for i, dims in enumerate(zip(*parts)):
        out.append((sum(dims) if all(d >= 0 for d in dims) else -1) if i == a else _merge(dims))
    return (tuple(out),)


def _mat_mul(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    a, b = ins[0], ins[1]
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return (None,)
    rows = a[1] if _flag(node, "transpose_a") else a[0]
    cols = b[0] if _flag(node, "transpose_b") else b[1]
    return ((rows, cols),)


def _expand_dims(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    x, dim = ins[0], _const(producer, 1)
    if x is None or dim is None or np.size(dim) != 1:
        return (None,)
    d = int(np.asarray(dim).reshape(-1)[0])
    if not -len(x) - 1 <= d <= len(x):
        raise ValueError("expand_dims axis out of range")
    d = d if d >= 0 else d + len(x) + 1
    return (x[:d] + (1,) + x[d:],)


def _squeeze(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    x = ins[0]
    if x is None:
        return (None,)
    axes = {a % len(x) for a in _ints(node, "squeeze_dims", ())}
    if not axes:
        if any(d < 0 for d in x):
            return (None,)  # an unknown dimension might be 1
        axes = {i for i, d in enumerate(x) if d == 1}
    return (tuple(d for i, d in enumerate(x) if i not in axes),)


def _switch(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    return (ins[0], ins[0])


def _merge_op(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    """Output 0 is whichever input is ready: only what all inputs agree on is known."""
    parts = _known_ranks(ins)
    if parts is None:
        return (None, ())
    return (tuple(dims[0] if len(set(dims)) == 1 else -1 for dims in zip(*parts)), ())


def _axis(value: np.ndarray | None, rank: int) -> int | None:
    """A constant scalar axis in [-rank, rank), made non-negative; None when not a constant."""
    if value is None or np.size(value) != 1:
        return None
    a = int(np.asarray(value).reshape(-1)[0])
    if not -rank <= a < rank:
        raise ValueError("axis out of range")
    return a % rank


def _split(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    """num_split equal parts along a constant axis (split_dim is input 0, the value input 1)."""
    x, count = ins[1], _int(node, "num_split")
    if x is None:
        return (None,) * count
    a = _axis(_const(producer, 0), len(x))
    if a is None:
        return ((-1,) * len(x),) * count
    if x[a] >= 0 and x[a] % count:
        raise ValueError("split does not divide")
    return (x[:a] + (x[a] // count if x[a] >= 0 else -1,) + x[a + 1:],) * count


def _split_v(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    """Parts of constant sizes (one may be -1: the rest) along a constant axis (input 2)."""
    x, count = ins[0], _int(node, "num_split")
    if x is None:
        return (None,) * count
    a, sizes = _axis(_const(producer, 2), len(x)), _const(producer, 1)
    if a is None:
        return ((-1,) * len(x),) * count
    if sizes is None:
        return (x[:a] + (-1,) + x[a + 1:],) * count
    dims = [int(d) for d in np.asarray(sizes).reshape(-1)]
    free = [i for i, d in enumerate(dims) if d == -1]
    if len(dims) != count or len(free) > 1 or any(d < -1 for d in dims):
        raise ValueError("bad size_splits")
    if x[a] >= 0:
        rest = x[a] - sum(d for d in dims if d >= 0)
        if rest < 0 or rest and not free:
            raise ValueError("size_splits do not add up")
        if free:
            dims[free[0]] = rest
    return tuple(x[:a] + (d,) + x[a + 1:] for d in dims)


def _unpack(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    """`num` tensors, the input without dimension `axis`."""
    x, count = ins[0], _int(node, "num")
    if x is None:
        return (None,) * count
    a = _axis(np.array(_int(node, "axis")), len(x))
    if x[a] >= 0 and x[a] != count:
        raise ValueError("unstack count differs from the dimension")
    return (x[:a] + x[a + 1:],) * count


def _slice(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    """Constant sizes (-1: to the end, which needs a constant begin and a known dimension)."""
    x, begin, size = ins[0], _const(producer, 1), _const(producer, 2)
    rank = len(x) if x is not None else ins[1][0] if ins[1] is not None and len(ins[1]) == 1 else -1
    if size is None:
        return (None if rank < 0 else (-1,) * rank,)
    sizes = [int(d) for d in np.asarray(size).reshape(-1)]
    starts = None if begin is None else [int(d) for d in np.asarray(begin).reshape(-1)]
    if x is not None and len(sizes) != len(x) or starts is not None and len(starts) != len(sizes):
        raise ValueError("slice rank differs")
    out = []
    for i, d in enumerate(sizes):
        if d >= 0:
            out.append(d)
        elif d == -1 and x is not None and x[i] >= 0 and starts is not None:
            out.append(x[i] - starts[i])
        elif d == -1:
            out.append(-1)
        else:
            raise ValueError("bad slice size")
    return (tuple(out),)


def _strided_slice(node: NodeDef, ins: list[Shape], producer: Producer) -> tuple[Shape, ...]:
    """TensorFlow's ValidateStridedSliceOp on constant strides (begin and end may be unknown):
    the ellipsis expanded, new and shrunk axes placed, each dimension's interval clamped."""
    x, strides = ins[0], _const(producer, 3)
    if x is None or strides is None or np.ndim(strides) != 1:
        return (None,)
    steps = [int(d) for d in strides]
    begin, end = (_const(producer, i) for i in (1, 2))
    begin_at = None if begin is None else [int(d) for d in np.asarray(begin).reshape(-1)]
    end_at = None if end is None else [int(d) for d in np.asarray(end).reshape(-1)]
    masks = {key: _int(node, key)
             for key in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    dense = dense_spec(len(x), steps, begin_at, end_at, masks)
    sizes = [interval(x[i], *spec, begin_at is not None and end_at is not None) for i, spec in enumerate(dense[0])]
    return (tuple(1 if g == "new" else sizes[g] for g in dense[1] if g != "shrink"),)


_UNARY = (
    "Identity", "Snapshot", "StopGradient", "PreventGradient", "CheckNumerics", "Cast", "ZerosLike", "OnesLike",
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Softplus", "Softsign", "Sigmoid", "Tanh", "Neg", "Abs", "Square",
    "Sqrt", "Rsqrt", "Reciprocal", "Exp", "Log", "Log1p", "Floor", "Ceil", "Round", "Sign", "Erf", "Softmax",
    "LogSoftmax", "LRN",
)
_BINARY = (
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "Pow", "SquaredDifference",
    "FloorDiv", "FloorMod",
)
RULES: dict[str, Rule] = {
    **dict.fromkeys(_UNARY, _same),
    **dict.fromkeys(_BINARY, _broadcast),
    **dict.fromkeys(("Placeholder", "PlaceholderWithDefault", "VariableV2", "Variable"), _attr_shape),
    **dict.fromkeys(("Conv2D", "DepthwiseConv2dNative"), _conv),
    **dict.fromkeys(("MaxPool", "AvgPool"), _pool),
    **dict.fromkeys(("BiasAdd", "BiasAddV1"), _bias_add),
    **dict.fromkeys(("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"), _fused_batch_norm),
    **dict.fromkeys(("Mean", "Sum", "Max", "Min", "Prod", "EuclideanNorm"), _reduce),
    **dict.fromkeys(("Pad", "PadV2", "MirrorPad"), _pad),
    "Const": _const_shape,
    "ReadVariableOp": _read_variable,
    "AddN": _add_n,
    "L2Loss": _scalar,
    "Reshape": _reshape,
    "Transpose": _transpose,
    "ConcatV2": _concat,
    "MatMul": _mat_mul,
    "ExpandDims": _expand_dims,
    "Squeeze": _squeeze,
    "Switch": _switch,
    "Merge": _merge_op,
    "Split": _split,
    "SplitV": _split_v,
    "Unpack": _unpack,
    "Slice": _slice,
    "StridedSlice": _strided_slice,
}
