"""Finding batch-norm sites: training-mode fused batch norm and the gradients that read it, and
tf.nn.moments feeding tf.nn.batch_normalization and the gradients of its mean and variance
(`normalization` reads that arithmetic's epsilon, scale and offset for the report). The records
it fills (`Site`, `Skip`, `Census`) are in `census.py`.

Why: the rewrite synchronizes only what it recognizes exactly; anything else keeps per-tower
statistics, and the user is told why.

Invariant: `scan` only reads the graph. Every training-mode fused batch norm it meets becomes a
`Site` or a `Skip` with the reason (one `Skip` per function for the function library), and so
does every tf.nn.moments pattern it recognizes (ghost batches, axes or keep_dims that differ, a
gradient reaching only one statistic: a `Skip`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_util

from bnrewrite.graph.index import Graph
from bnrewrite.graph.names import tensor_name
from bnrewrite.graph.nodes import MARK
from bnrewrite.graph.opcheck import check_attrs, check_batch_norm_shapes
from bnrewrite.match.census import Census, Site, Skip
from bnrewrite.match.tape_gradients import tape_entries

FUSED_FORWARD = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
FUSED_GRAD = frozenset({"FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"})
#: Ops whose attrs the rewrite reads (and copies into the nodes it builds).
_ATTRS_READ = FUSED_FORWARD | FUSED_GRAD | {"Mean"}
VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable", "_VarHandlesOp"})
#: Ops a variable's value passes through unchanged on its way to a consumer.
_READ_THROUGH = frozenset({
    "ReadVariableOp", "Identity", "Enter", "Switch", "RefIdentity", "RefEnter", "RefSwitch", "Cast", "Reshape",
})
#: Ops a batch statistic passes through, its values unchanged, on its way from tf.nn.moments
#: into tf.nn.batch_normalization.
_STATISTIC_THROUGH = frozenset({"Identity", "Squeeze", "Reshape", "ExpandDims", "Cast", "Switch"})


def resolve_variable(graph: Graph, node: str) -> str | None:
    """The variable whose values `node` carries, following reads, identities and reshapes."""
    seen = 0
    while node in graph and seen < 16:
        op = graph.node(node).op
        if op in VARIABLE_OPS:
            return node
        if op not in _READ_THROUGH or not graph.node(node).input:
            return None
        node, _ = graph.producer(node, 0)
        seen += 1
    return None


def follow_identities(graph: Graph, node: str, output: int) -> list[tuple[str, int]]:
    """Consumers of (node, output) as (consumer, slot), looking through Identity chains."""
    found = []
    # Depth first, in the order recursion would visit them, but with a stack of iterators: a
    # chain can be thousands of Identity ops long.
    stack = [iter(graph.consumers_of(node, output))]
    seen = {node}
    while stack:
        edge = next(stack[-1], None)
        if edge is None:
            stack.pop()
        elif graph.node(edge.consumer).op != "Identity":
            found.append((edge.consumer, edge.slot))
        elif edge.consumer not in seen:
            seen.add(edge.consumer)
            stack.append(iter(graph.consumers_of(edge.consumer, 0)))
    return found


def _attr(node: object, key: str, default: object) -> object:
    attrs = node.attr  # type: ignore[attr-defined]
    if key not in attrs:
        return default
    value = attrs[key]
    kind = value.WhichOneof("value")
    result = getattr(value, kind) if kind else default
    return result.decode() if isinstance(result, bytes) else result


def scan(graph: Graph, aliases: Mapping[str, Mapping[str, str]] | None = None) -> Census:
    """Every batch-norm op of `graph`. `aliases`: a gradient node -> the copies its step runs
    (bnrewrite.rewrite.step_copies): the Mean its scope names is that Mean's copy."""
    census = Census([], [], [], [])
    mean_gradients = _mean_gradients(graph, aliases or {})
    for node in graph:
        if MARK in node.attr:
            census.rewritten.append(node.name)
            continue
        if node.op in _ATTRS_READ:
            check_attrs(node)  # the rewrite builds its nodes from these attrs
            if node.op != "Mean":
                check_batch_norm_shapes(graph, node)  # the rewrite keeps it: TensorFlow must import it
        if node.op == "Mean":
            site, reason = _moments_site(graph, node, mean_gradients)
            if site is not None:
                census.sites.append(site)
            elif reason:
                census.skips.append(Skip(node.name, reason))
            continue
        if node.op == "SquaredDifference" and _is_weighted_moments(graph, node.name):
            census.skips.append(Skip(node.name, (
                "tf.nn.weighted_moments is not synchronized (the weights would have to be reduced too); "
                "this layer keeps per-tower statistics")))
            continue
        if node.op not in FUSED_FORWARD:
            continue
        if not _attr(node, "is_training", True):
            census.inference.append(node.name)
            continue
        site, reason = _fused_site(graph, node)
        if site is None:
            census.skips.append(Skip(node.name, reason))
        else:
            census.sites.append(site)
    census.skips.extend(_sites_in_functions(graph))
    census.inference.extend(_inference_in_functions(graph))
    return census


def _is_weighted_moments(graph: Graph, squared: str) -> bool:
    """SquaredDifference(x, DivNoNan(sum(w*x), sum(w))), as tf.nn.weighted_moments builds it."""
    centre, _ = graph.producer(squared, 1)
    if graph.node(centre).op == "StopGradient":
        centre, _ = graph.producer(centre, 0)
    return graph.node(centre).op == "DivNoNan"


def _sites_in_functions(graph: Graph) -> list[Skip]:
    """Batch norm inside the function library (control flow v2 If/While, tf.function) is
    reported, not rewritten: its nodes live in FunctionDefs, outside the GraphDef's nodes."""
    if graph.library is None:
        return []
    skips = []
    for function in graph.library.function:  # type: ignore[attr-defined]
        ops = {node.op for node in function.node_def}
        training_fused = any(n.op in FUSED_FORWARD and _attr(n, "is_training", True) for n in function.node_def)
        if training_fused or {"Mean", "SquaredDifference"} <= ops:
            skips.append(Skip(
                f"function {function.signature.name}",
                "batch norm inside a function body (control flow v2 If/While or tf.function) is not rewritten; "
                "build the graph with tf.compat.v1.disable_control_flow_v2() to use Switch/Merge conditionals",
            ))
    return skips


def _inference_in_functions(graph: Graph) -> list[str]:
    """Inference-mode fused batch norm in the function library (a TF2 SavedModel's tf.function
    bodies, v2 branches), as `function <name>/<node>`: counted like that of the GraphDef's nodes."""
    if graph.library is None:
        return []
    return [
        f"function {function.signature.name}/{node.name}"
        for function in graph.library.function  # type: ignore[attr-defined]
        for node in function.node_def
        if node.op in FUSED_FORWARD and not _attr(node, "is_training", True)
    ]


_GRADIENTS_SCOPE = re.compile(r"gradients(_\d+)?$")
#: tf.GradientTape names a gradient's ops after the forward op's scope, under this one.
_TAPE_SCOPE = re.compile(r"(?:^|/)gradient_tape(?:_\d+)?/")


@dataclass
class _MeanGradients:
    """Per Mean op: the nodes where each gradient tf.gradients made for it takes in the
    incoming gradient (`entries`), and the gradient scopes made for it (`scopes`): a scope
    without an entry is a gradient bnrewrite cannot rewrite."""

    entries: dict[str, list[str]]
    scopes: dict[str, set[str]]


def _mean_gradients(graph: Graph, aliases: Mapping[str, Mapping[str, str]]) -> _MeanGradients:
    """TensorFlow names the gradient of op X `.../gradients[_N]/X_grad/...`. The gradient of a
    Mean takes the incoming gradient in with a Reshape (then a Tile, or with an unknown input
    shape a BroadcastTo), or, when nothing needs reshaping (tf.nn.moments, which keeps dims, on
    a batch of unknown size), with the BroadcastTo itself."""
    found = _MeanGradients({}, {})
    for name in graph.names():
        scope, _, op = name.rpartition("/")
        if not scope.endswith("_grad"):
            continue
        parts = scope.split("/")
        for i, part in enumerate(parts[:-1]):
            if _GRADIENTS_SCOPE.match(part):
                forward = "/".join(parts[i + 1:])[: -len("_grad")]
                forward = aliases.get(name, {}).get(forward, forward)
                break
        else:
            continue
        if forward not in graph or graph.node(forward).op != "Mean":
            continue
        found.scopes.setdefault(forward, set()).add(scope)
        if op == "Reshape" or (op == "BroadcastTo" and not graph.producer(name, 0)[0].startswith(scope + "/")):
            found.entries.setdefault(forward, []).append(name)  # not a BroadcastTo of that Reshape
    return found


def _const_value(graph: Graph, name: str) -> object:
    node = graph.node(name)
    return tensor_util.MakeNdarray(node.attr["value"].tensor) if node.op == "Const" else None


def _moments_site(graph: Graph, variance: object, gradients: _MeanGradients) -> tuple[Site | None, str]:
    """`variance` = Mean(SquaredDifference(x, [StopGradient](mean)), axes), mean = Mean(x, axes)."""
    squared, _ = graph.producer(variance.name, 0)  # type: ignore[attr-defined]
    if graph.node(squared).op != "SquaredDifference":
        return None, ""
    x, x_out = graph.producer(squared, 0)
    mean, _ = graph.producer(squared, 1)
    if graph.node(mean).op == "StopGradient":
        mean, _ = graph.producer(mean, 0)
    mean_node = graph.node(mean)
    if mean_node.op != "Mean" or graph.producer(mean, 0) != (x, x_out):
        return None, ""
    ghost = _ghost_batch_size(graph, x)
    if ghost:
        return None, (f"ghost batch normalization (virtual_batch_size={ghost}) normalizes sub-batches of {ghost} "
                      "examples on purpose; not synchronized, this layer keeps per-tower statistics")
    axes = _const_value(graph, graph.producer(mean, 1)[0])
    if axes is None or not np.array_equal(axes, _const_value(graph, graph.producer(variance.name, 1)[0])):  # type: ignore[attr-defined]
        return None, f"moments of {mean} over axes that are not constant, or differ for mean and variance"
    keep_dims = bool(_attr(mean_node, "keep_dims", False))
    if keep_dims != bool(_attr(variance, "keep_dims", False)):
        return None, f"mean and variance of {mean} differ in keep_dims"
    grads = sorted(gradients.entries.get(mean, []))
    variance_grads = sorted(gradients.entries.get(variance.name, []))  # type: ignore[attr-defined]
    paired = tape_entries(graph, squared)  # every gradient's, by structure: tf.GradientTape's have no `_grad` scope
    scoped = gradients.scopes.get(mean) or gradients.scopes.get(variance.name)  # type: ignore[attr-defined]
    if not scoped:
        grads, variance_grads = paired
    elif len(paired[0]) > len(grads):
        return None, (f"{mean} has {len(paired[0])} gradients, {len(grads)} of them by tf.gradients: the others (a "
                      "tf.GradientTape's) are not synchronized beside them; left unsynced")
    if len(grads) != len(variance_grads):
        return None, f"the gradient reaches only one of mean and variance of {mean}; left unsynced"
    for op, entries in ((mean, grads), (variance.name, variance_grads)) if scoped else ():  # type: ignore[attr-defined]
        if len(entries) != len(gradients.scopes.get(op, ())):
            return None, (f"a gradient of {op} takes the incoming gradient in by ops bnrewrite does not know (no "
                          f"Reshape or BroadcastTo under {sorted(gradients.scopes[op])[0]}); left unsynced, as "
                          "synchronizing its forward pass alone would train it wrongly")
    if not grads and any(_TAPE_SCOPE.search(reader) for reader in graph.consumers.get(x, ())):
        return None, (f"the gradient of {mean} was built by tf.GradientTape (ops under gradient_tape/ read {x}) in a "
                      "form bnrewrite does not know (no Sub of its SquaredDifference's inputs waiting on the variance's "
                      "gradient, or no one mean gradient beside it); left unsynced, as synchronizing its forward pass "
                      "alone would train it wrongly")
    dtype = int(_attr(mean_node, "T", types_pb2.DT_FLOAT))
    scale_var, offset_var = _affine_variables(graph, variance.name)  # type: ignore[attr-defined]
    site = Site(
        name=mean,
        op="Moments",
        data_format="axes=" + ",".join(str(int(a)) for a in np.atleast_1d(axes)),
        dtype=dtype,
        stat_dtype=dtype,
        epsilon=0.0,
        avg_factor=1.0,
        device=graph.device(mean),
        grads=tuple(grads),
        scale_var=scale_var,
        offset_var=offset_var,
        kind="moments",
        variance=variance.name,  # type: ignore[attr-defined]
        axes=tuple(int(a) for a in np.atleast_1d(axes)),
        keep_dims=keep_dims,
        variance_grads=tuple(variance_grads),
        x=tensor_name(x, x_out),
    )
    return site, ""


def _ghost_batch_size(graph: Graph, x: str) -> int | None:
    """V when `x` is the batch split into virtual batches, Reshape(inputs, concat([V, -1],
    shape[1:])), as Keras's virtual_batch_size does (moments then run per virtual batch)."""
    while graph.node(x).op in ("Identity", "Cast"):
        x = graph.producer(x, 0)[0]
    if graph.node(x).op != "Reshape":
        return None
    shape = graph.producer(x, 1)[0]
    if graph.node(shape).op != "ConcatV2":
        return None
    head = _const_value(graph, graph.producer(shape, 0)[0])
    if head is None or np.shape(head) != (2,) or head[1] != -1 or head[0] < 1:
        return None
    return int(head[0])


def _affine_variables(graph: Graph, variance: str) -> tuple[str | None, str | None]:
    """(scale, offset) variables of the tf.nn.batch_normalization that `variance` feeds, which
    computes inv = Rsqrt(variance + epsilon) [* scale] and y = x * inv + (offset - mean * inv).

    They tell the copies of a layer apart from other layers whatever the towers' names are.
    """
    scale = offset = None
    for add in _reached(graph, variance, _ADD):
        for rsqrt in _reached(graph, add, _RSQRT, through=frozenset()):
            inverses = [rsqrt]
            for mul in _reached(graph, rsqrt, _MUL):
                variable = _variable_operand(graph, mul)
                if variable is not None:
                    scale = scale or variable
                    inverses.append(mul)
            for mul in (m for inverse in inverses for m in _reached(graph, inverse, _MUL)):
                for sub in _reached(graph, mul, _SUB, through=frozenset()):
                    if graph.producer(sub, 1)[0] == mul:
                        offset = offset or resolve_variable(graph, graph.producer(sub, 0)[0])
    return scale, offset


@dataclass(frozen=True)
class Normalization:
    """What the tf.nn.batch_normalization a moments site's statistics feed reads and gives:
    tensor names (scale and offset "" when it takes none)."""

    y: str
    scale: str
    offset: str
    epsilon: float


def normalization(graph: Graph, site: Site) -> Normalization | None:
    """The tf.nn.batch_normalization of a moments site, y = x * inv + (offset - mean * inv) with
    inv = Rsqrt(variance + epsilon) [* scale] (each of its terms maybe cast to x's dtype), on the
    x the site's moments take; None for other arithmetic."""
    x = graph.inputs(site.name)[0]
    for add in _reached(graph, site.variance, _ADD):
        epsilon = _scalar(graph, graph.inputs(add))
        for rsqrt in (r for r in _reached(graph, add, _RSQRT, through=frozenset()) if epsilon is not None):
            inverses = [(rsqrt, "")] + [(mul, tensor_name(*other)) for mul in _reached(graph, rsqrt, _MUL, through=_CAST)
                                        for other in graph.inputs(mul) if other[0] != rsqrt]
            for inverse, scale in inverses:
                for mul in _reached(graph, inverse, _MUL, through=_CAST):
                    if x not in graph.inputs(mul):
                        continue
                    for y in _reached(graph, mul, _ADD, through=frozenset()):
                        term = next((i for i in graph.inputs(y) if i[0] != mul), (mul, 0))
                        offset = _behind(graph, term[0], _CAST)
                        if graph.node(offset).op == "Sub":
                            return Normalization(tensor_name(y), scale, tensor_name(*graph.inputs(offset)[0]), epsilon)
                        if graph.node(offset).op == "Neg":
                            return Normalization(tensor_name(y), scale, "", epsilon)
    return None


def _scalar(graph: Graph, inputs: list[tuple[str, int]]) -> float | None:
    """The value of the one scalar constant among `inputs` (through casts), else None."""
    values = [v for v in (_const_value(graph, _behind(graph, name, _CAST)) for name, _ in inputs) if v is not None]
    return float(values[0]) if len(values) == 1 and np.size(values[0]) == 1 else None


def _behind(graph: Graph, node: str, through: frozenset[str]) -> str:
    """The node a chain of `through` ops starting at `node` passes on."""
    for _ in range(4):
        if graph.node(node).op not in through or not graph.inputs(node):
            break
        node = graph.inputs(node)[0][0]
    return node


_CAST = frozenset({"Cast", "Identity"})


_ADD = frozenset({"Add", "AddV2"})
_RSQRT = frozenset({"Rsqrt"})
_MUL = frozenset({"Mul"})
_SUB = frozenset({"Sub"})


def _reached(graph: Graph, start: str, ops: frozenset[str], through: frozenset[str] = _STATISTIC_THROUGH) -> list[str]:
    """Nodes of `ops` that read `start`, directly or through a few `through` ops."""
    found, frontier, seen = [], [start], {start}
    for _ in range(4):
        nxt = []
        for reader in (r for node in frontier for r in graph.consumers.get(node, ())):
            if reader in seen:
                continue
            seen.add(reader)
            op = graph.node(reader).op
            if op in ops:
                found.append(reader)
            elif op in through:
                nxt.append(reader)
        frontier = nxt
    return found


def _variable_operand(graph: Graph, node: str) -> str | None:
    """The variable one of the data inputs of `node` carries, if any."""
    return next(filter(None, (resolve_variable(graph, src) for src, _ in graph.inputs(node))), None)


def _channels(graph: Graph, variable: str | None) -> int | None:
    """The static length of a per-channel variable, when its op records a shape."""
    if variable is None or "shape" not in graph.node(variable).attr:
        return None
    dims = graph.node(variable).attr["shape"].shape.dim
    return dims[0].size if len(dims) == 1 and dims[0].size >= 0 else None


def _grad_mismatch(graph: Graph, forward: str, grad: str, slot: int) -> str:
    """Why `grad` is not the gradient of `forward` as tf.gradients builds it ("" if it is)."""
    inputs = graph.inputs(grad)
    if slot != 3 or len(inputs) < 5:
        return f"{grad} reads reserve_space_1 at input {slot} of {len(inputs)}, not as a gradient would"
    if not _attr(graph.node(grad), "is_training", True):
        return f"its gradient {grad} is in inference mode"
    if any(src == forward for src, _ in inputs[:3]) or inputs[1] != graph.inputs(forward)[0]:
        return f"{grad} does not read the op's input x and an incoming gradient as tf.gradients builds it"
    if _behind_identities(graph, inputs[4]) != (forward, 4):
        return f"{grad} reads {inputs[4][0]}:{inputs[4][1]} as reserve_space_2, not the op's output 4"
    return ""


def _behind_identities(graph: Graph, tensor: tuple[str, int]) -> tuple[str, int]:
    """The tensor an Identity chain (of any length) passes on."""
    seen = set()
    while tensor[0] in graph and tensor[0] not in seen and graph.node(tensor[0]).op == "Identity":
        seen.add(tensor[0])
        inputs = graph.inputs(tensor[0])
        if not inputs:
            break
        tensor = inputs[0]
    return tensor


def _fused_site(graph: Graph, node: object) -> tuple[Site | None, str]:
    name = node.name  # type: ignore[attr-defined]
    if len(graph.inputs(name)) != 5:
        return None, f"has {len(graph.inputs(name))} data inputs instead of 5 (x, scale, offset, mean, variance)"
    grads = []
    for consumer, slot in follow_identities(graph, name, 3):
        op = graph.node(consumer).op
        if op in FUSED_GRAD:
            reason = _grad_mismatch(graph, name, consumer, slot)
            if reason:
                return None, reason
            grads.append(consumer)
    data_format = str(_attr(node, "data_format", "NHWC"))
    if data_format not in ("NHWC", "NCHW", "NDHWC", "NCDHW"):
        return None, f"data_format {data_format} is not supported"
    dtype = int(_attr(node, "T", types_pb2.DT_FLOAT))
    scale_var = resolve_variable(graph, graph.producer(name, 1)[0])
    site = Site(
        name=name,
        op=node.op,  # type: ignore[attr-defined]
        data_format=data_format,
        dtype=dtype,
        stat_dtype=int(_attr(node, "U", types_pb2.DT_FLOAT)),
        epsilon=float(_attr(node, "epsilon", 1e-4)),
        avg_factor=float(_attr(node, "exponential_avg_factor", 1.0)),
        device=graph.device(name),
        grads=tuple(sorted(grads)),
        scale_var=scale_var,
        offset_var=resolve_variable(graph, graph.producer(name, 2)[0]),
        channels=_channels(graph, scale_var),
    )
    return site, ""
