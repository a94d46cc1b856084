"""Forward: every copy of a layer normalizes with the statistics of the global batch.

What: the local moments (channels last, float32/float16: a training-mode FusedBatchNormV3 whose
y goes unused; else elementwise passes) combine by `bnrewrite.rewrite.statistics.global_moments`; the op
stays, in inference mode fed the global mean and variance, and what read its outputs 1-5 reads
the global tensors (reserve_space_2: the variance on the kernel path, else 1/std, for
sync_backward). Why: the fewest nodes (docs/performance.md); Grappler still fuses a following
ReLU. Invariant: every consumer reads what the training op would give for the global batch.
"""


from __future__ import annotations

import numpy as np

from tensorflow.core.framework.node_def_pb2 import NodeDef

from bnrewrite.graph.index import Graph
from bnrewrite.graph.nodes import DT_DOUBLE, DT_FLOAT, MARK, Builder, DType, identity_n, set_attr
from bnrewrite.match.census import Site
from bnrewrite.rewrite.functions import in_body
from bnrewrite.rewrite.passes.record import PassRecord
from bnrewrite.rewrite.passes.sites import SiteContext, each_site, static_counts, takes_kernels
from bnrewrite.rewrite.plan import Plan
from bnrewrite.rewrite.statistics import Local, centred_moments, global_moments, reciprocal_std

F = DT_FLOAT


def sync_forward(graph: Graph, plan: Plan) -> tuple[Graph, PassRecord]:
    return each_site(graph, plan, "sync_forward", "fused", _rewrite_site)


def _rewrite_site(site: Site, ctx: SiteContext) -> None:
    editor, key = ctx.editor, ctx.key
    node = ctx.graph.node(site.name)
    x, scale, offset, mean_in, var_in = node.input[:5]
    controls = [i for i in node.input if i.startswith("^")]
    b = ctx.builder(site.name, "sync_bn", node.device)
    T, U = site.dtype, site.stat_dtype
    count, counts = static_counts(ctx, 0, lambda copy: ctx.graph.node(copy.name).input[:2])
    total = sum(counts) if counts else None
    kernels = takes_kernels(site)
    if kernels:
        local = _kernel_moments(b, x, scale, offset, site, count)
    else:
        local, _ = centred_moments(b, x, T, site.reduce_axes, site.channel_shape, count=count)
    moments = global_moments(b, local, ctx.plan.collective(ctx.layer, 0, ctx.tower), counts, ctx.graph.static_elements(scale))
    mean, var = moments.mean, moments.variance
    # reserve_space_2 holds what the gradient reads: the variance on the kernel path, else 1/std
    spread = var if kernels else reciprocal_std(b, var, site.epsilon)
    norm_attrs: dict[str, object] = {
        "epsilon": site.epsilon, "data_format": site.data_format, "is_training": False,
        "exponential_avg_factor": 1.0, "T": DType(T),
    }
    if site.op != "FusedBatchNorm":
        norm_attrs["U"] = DType(U)
    batch_mean = _blend(b, "batch_mean", mean, mean_in, site)
    batch_var = _blend(b, "batch_variance", moments.variance_unbiased, var_in, site)
    statistics = [b.cast(f"out_{i}", t, F, U) for i, t in enumerate((batch_mean, batch_var, mean, spread))]
    if site.op == "FusedBatchNormV3":  # reserve_space_3: unused by the gradient (it knows or sums the count)
        statistics.append(b.cast("empty_u", b.const("empty", np.zeros([0], np.float32), np.float32), F, U))
    if site.avg_factor == 1.0 and not in_body(site.name):
        # The op stays under its name, so that Grappler still fuses a following ReLU into it, and
        # what it gives read by name is the training op's: fed the Bessel-corrected variance u,
        # with its scale raised by sqrt((u + e') / (v + e)) to normalize by the biased v; e' = e
        # N/(N-1) makes that the constant sqrt(N/(N-1)) when N is static. What read outputs 1-5
        # reads the global tensors.
        fed_var = statistics[1]
        if total is not None:
            norm_attrs["epsilon"] = site.epsilon * total / (total - 1.0)
            ratio = b.const("root_bessel", np.sqrt(total / (total - 1.0)), np.float32)
        else:
            ratio = b.once(("std_ratio", fed_var, var), lambda: _std_ratio(b, fed_var, var, site.epsilon))
        fed = [x, b.binary("Mul", "scale_fed", scale, ratio, U), offset, b.cast("mean_u", mean, F, U), fed_var]
        editor.replace(_marked(site.op, site.name, fed + controls, node.device, key, norm_attrs))
        _move_statistics(ctx, site.name, statistics)
    else:  # an IdentityN of its name gives outputs 1-5 (blends; function bodies)
        fed = [x, scale, offset, b.cast("mean_u", mean, F, U), b.cast("variance_u", var, F, U)]
        y = b.node(site.op, "normalize", fed, **norm_attrs)
        editor.replace(identity_n(site.name, [y, *statistics, *controls], [T] + [U] * len(statistics), node.device, key))
    ctx.record.replaced.append(site.name)
    ctx.record.collectives.append(moments.collective)
    ctx.record.moments[site.name] = (mean, var)


def _std_ratio(b: Builder, fed_var: str, var: str, epsilon: float) -> str:
    """sqrt((fed_var + e) / (var + e)): what raises the scale to normalize by var when fed fed_var."""
    eps = b.const("epsilon", epsilon, np.float32)
    return b.unary("Sqrt", "std_ratio", b.binary("RealDiv", "variance_ratio", b.binary("AddV2", "fed_eps", fed_var, eps, F),
                                                  b.binary("AddV2", "variance_eps", var, eps, F), F), F)


def _marked(op: str, name: str, inputs: list[str], device: str, key: str, attrs: dict[str, object]) -> NodeDef:
    """A node that takes the place and name of a replaced one, carrying the mark."""
    node = NodeDef(op=op, name=name, input=inputs, device=device)
    for attr, value in attrs.items():
        set_attr(node, attr, value)
    set_attr(node, MARK, key)
    return node


def _move_statistics(ctx: SiteContext, site: str, statistics: list[str]) -> None:
    """Whatever read outputs 1-5 of `site` reads `statistics` instead. The op's output 0 keeps
    only its own consumers (usually a Relu), so that Grappler's remapper fuses the two on CPU as
    it did the training op: it fuses no op whose other outputs are read."""
    for edge in ctx.graph.consumers_of(site):
        if 1 <= edge.output <= len(statistics):
            ctx.editor.mutable(edge.consumer).input[edge.slot] = statistics[edge.output - 1]


def _kernel_moments(b: Builder, x: str, scale: str, offset: str, site: Site, count: int | None) -> Local:
    """The local moments from a training-mode FusedBatchNormV3 (channels last), whose y goes
    unused: its mean, and its Bessel-corrected variance."""
    empty = b.const("empty", np.zeros([0], np.float32), np.float32)
    local = b.node("FusedBatchNormV3", "local_moments", [x, scale, offset, empty, empty], epsilon=site.epsilon,
                   data_format="NHWC", is_training=True, exponential_avg_factor=1.0, T=DType(site.dtype), U=DType(F))
    n = count if count is not None else b.count("count", x, b.const("axes", site.reduce_axes), site.dtype, DT_DOUBLE)
    return Local(n, f"{local}:1", f"{local}:2", unbiased=True)


def _blend(b: Builder, name: str, value: str, running: str, site: Site) -> str:
    """(1-f)*running + f*value, as FusedBatchNormV3 does with exponential_avg_factor f."""
    f = site.avg_factor
    if f == 1.0:
        return value
    running_f = b.cast(f"{name}/running", running, site.stat_dtype, F)
    keep = b.binary("Mul", f"{name}/keep", running_f, b.const(f"{name}/one_minus_factor", 1.0 - f, np.float32), F)
    new = b.binary("Mul", f"{name}/new", value, b.const(f"{name}/factor", f, np.float32), F)
    return b.binary("AddV2", name, keep, new, F)

