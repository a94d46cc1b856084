"""Finding batch-norm sites: training-mode fused batch norm and the gradients that read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorflow.core.framework import types_pb2

from bnrewrite.graph import Device, Graph
from bnrewrite.nodes import MARK

FUSED_FORWARD = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
FUSED_GRAD = frozenset({"FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"})
VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable", "_VarHandlesOp"})
#: Ops a variable's value passes through unchanged on its way to a consumer.
_READ_THROUGH = frozenset({"ReadVariableOp", "Identity", "Enter", "Switch", "RefIdentity", "RefEnter", "RefSwitch", "Cast"})


@dataclass(frozen=True)
class Update:
    """An op that writes a batch statistic of a site into `variable`."""

    node: str
    variable: str
    statistic: str  # "mean" or "variance"


@dataclass(frozen=True)
class Site:
    """One training-mode batch norm op in one tower."""

    name: str
    op: str
    data_format: str
    dtype: int
    stat_dtype: int
    epsilon: float
    avg_factor: float
    device: Device
    grads: tuple[str, ...]
    scale_var: str | None
    offset_var: str | None
    channels: int | None = None
    updates: tuple[Update, ...] = field(default=())

    @property
    def channel_axis(self) -> int:
        return 1 if self.data_format.startswith("NC") else len(self.data_format) - 1

    @property
    def reduce_axes(self) -> list[int]:
        return [a for a in range(len(self.data_format)) if a != self.channel_axis]

    @property
    def dtype_name(self) -> str:
        return types_pb2.DataType.Name(self.dtype)[3:].lower()


@dataclass(frozen=True)
class Skip:
    node: str
    reason: str


@dataclass
class Census:
    """What a scan of the graph found, before towers are considered."""

    sites: list[Site]
    inference: list[str]
    rewritten: list[str]
    skips: list[Skip]


def resolve_variable(graph: Graph, node: str) -> str | None:
    """The variable whose value `node` carries, following reads and identities."""
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
    for edge in graph.consumers_of(node, output):
        consumer = graph.node(edge.consumer)
        if consumer.op == "Identity":
            found.extend(follow_identities(graph, edge.consumer, 0))
        else:
            found.append((edge.consumer, edge.slot))
    return found


def _attr(node: object, key: str, default: object) -> object:
    attrs = node.attr  # type: ignore[attr-defined]
    if key not in attrs:
        return default
    value = attrs[key]
    kind = value.WhichOneof("value")
    result = getattr(value, kind) if kind else default
    return result.decode() if isinstance(result, bytes) else result


def scan(graph: Graph) -> Census:
    census = Census([], [], [], [])
    for node in graph:
        if MARK in node.attr:
            census.rewritten.append(node.name)
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
    return census


def _channels(graph: Graph, variable: str | None) -> int | None:
    """The static length of a per-channel variable, when its op records a shape."""
    if variable is None or "shape" not in graph.node(variable).attr:
        return None
    dims = graph.node(variable).attr["shape"].shape.dim
    return dims[0].size if len(dims) == 1 and dims[0].size >= 0 else None


def _fused_site(graph: Graph, node: object) -> tuple[Site | None, str]:
    name = node.name  # type: ignore[attr-defined]
    grads = []
    for consumer, slot in follow_identities(graph, name, 3):
        op = graph.node(consumer).op
        if op in FUSED_GRAD:
            if slot != 3:
                return None, f"{consumer} reads reserve_space_1 at input {slot}, not as a gradient would"
            if not _attr(graph.node(consumer), "is_training", True):
                return None, f"its gradient {consumer} is in inference mode"
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
