"""Backward: the gradient ops of every synced layer give dx for the global batch.

With x_hat = (x - mean) * rstd over the global batch of N examples,
    dx = scale * rstd * (dy - sum(dy)/N - x_hat * sum(dy * x_hat)/N),
where both sums run over every tower. Each tower sums dy and dy*(x - mean) locally, one
all-reduce adds them up, and the rest is elementwise. N comes from the forward pass through
reserve_space_3 (FusedBatchNormV3); for the older ops the all-reduce carries the counts too.
d(scale) and d(offset) stay tower-local: the graph already averages them across towers, and
since every tower's dy is K times its share of the averaged loss, that average is exact;
they wait for dx (control edges), as inside the fused kernel, so that an optimizer's update of
a reference variable's scale cannot overwrite it before dx has read it.
A FusedBatchNormGrad alone cannot do this: it treats the batch statistics as its own.
The gradient op is replaced by an IdentityN of the same name, so its consumers are unchanged.
"""

from __future__ import annotations

import numpy as np

from bnrewrite.collectives import all_reduce
from bnrewrite.functions import through_identity
from bnrewrite.graph import Graph, parse_input
from bnrewrite.match.sites import Site
from bnrewrite.nodes import DT_FLOAT, DType, identity_n
from bnrewrite.passes.record import PassRecord
from bnrewrite.passes.sites import SiteContext, each_site
from bnrewrite.plan import Plan

F = DT_FLOAT


def sync_backward(graph: Graph, plan: Plan) -> tuple[Graph, PassRecord]:
    return each_site(graph, plan, "sync_backward", "fused", _rewrite_grads)


def _rewrite_grads(site: Site, ctx: SiteContext) -> None:
    for phase, grad in enumerate(site.grads, start=1):
        _rewrite_grad(grad, site, ctx, phase)
        ctx.record.replaced.append(grad)


def _rewrite_grad(grad: str, site: Site, ctx: SiteContext, phase: int) -> None:
    editor, key = ctx.editor, ctx.key
    node = ctx.graph.node(grad)
    dy, x, scale, saved_mean, saved_rstd = node.input[:5]
    controls = [i for i in node.input if i.startswith("^")]
    # On the tower's device, wherever tf.gradients put the gradient: an all-reduce needs
    # one member per tower device.
    device = ctx.graph.node(site.name).device
    b = ctx.builder(grad, "sync_bn_grad", device)
    T, U = site.dtype, site.stat_dtype
    axes = b.const("axes", site.reduce_axes)
    shape = site.channel_shape

    dyf = b.cast("dy_float", dy, T, F)
    xf = b.cast("x_float", x, T, F)
    mean = b.cast("mean", saved_mean, U, F)
    rstd = b.cast("rstd", saved_rstd, U, F)
    centred = b.binary("Sub", "centred", xf, b.per_channel("mean_b", mean, shape, F), F)
    sum_dy = b.reduce_sum("sum_dy", dyf, axes, F, False)
    sum_dy_xc = b.reduce_sum("sum_dy_xc", b.binary("Mul", "dy_xc", dyf, centred, F), axes, F, False)
    collective = ctx.plan.collective(ctx.layer, phase, ctx.tower)
    counted = _forward_count(ctx.graph, grad, site)
    if counted is not None:
        reduce_name = all_reduce(b, "all_reduce", b.concat("sums", [sum_dy, sum_dy_xc], F), F, collective)
        total, (gsum_dy, gsum_dy_xc) = b.cast("count", counted, U, F), b.split_pairs("global", reduce_name, F)
    else:
        packed = b.concat("sums", [b.count("count", x, axes, T, F), sum_dy, sum_dy_xc], F)
        reduce_name = all_reduce(b, "all_reduce", packed, F, collective)
        total, (gsum_dy, gsum_dy_xc) = b.split_count("global", reduce_name, F)
    ctx.record.collectives.append(reduce_name)

    mean_dy = b.binary("DivNoNan", "mean_dy", gsum_dy, total, F)
    rstd_sq = b.binary("Mul", "rstd_sq", rstd, rstd, F)
    proj = b.binary("DivNoNan", "projection", b.binary("Mul", "dy_xc_rstd_sq", gsum_dy_xc, rstd_sq, F), total, F)
    gain = b.binary("Mul", "gain", b.cast("scale", scale, U, F), rstd, F)
    inner = b.binary(
        "Sub", "dy_minus_proj",
        b.binary("Sub", "dy_minus_mean", dyf, b.per_channel("mean_dy_b", mean_dy, shape, F), F),
        b.binary("Mul", "xc_proj", centred, b.per_channel("projection_b", proj, shape, F), F),
        F,
    )
    dx = b.cast("dx", b.binary("Mul", "dx_float", inner, b.per_channel("gain_b", gain, shape, F), F), F, T)
    # d(scale) and d(offset) wait for dx, as they did inside the fused kernel: with reference
    # variables `scale` aliases the variable's buffer, which the optimizer's update of the scale
    # (fed by d(scale)) would otherwise be free to overwrite before dx has read it.
    after_dx = f"^{dx}"
    dscale = b.node("Identity", "dscale", [b.cast("dscale_stat", b.binary("Mul", "dscale_float", sum_dy_xc, rstd, F), F, U), after_dx], T=DType(U))
    doffset = b.node("Identity", "doffset", [b.cast("doffset_stat", sum_dy, F, U), after_dx], T=DType(U))
    empty = b.cast("empty", b.const("empty_float", np.zeros([0], np.float32), np.float32), F, U)
    outputs = [dx, dscale, doffset, empty, empty]
    editor.replace(identity_n(grad, outputs + controls, [T, U, U, U, U], device, key))


def _forward_count(graph: Graph, grad: str, site: Site) -> str | None:
    """The global count N that `sync_forward` left in reserve_space_3, when this gradient
    reads it there (FusedBatchNormGradV3); None: the all-reduce carries the counts instead."""
    node = graph.node(grad)
    if node.op != "FusedBatchNormGradV3" or len(graph.inputs(grad)) < 6:
        return None
    spec = node.input[5]
    return spec if through_identity(graph, parse_input(spec)) == (site.name, 5) else None
