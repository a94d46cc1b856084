"""Backward: the gradient ops of every synced layer give dx for the global batch of N examples.

What: dx = scale * rstd * (dy - sum(dy)/N - x_hat * sum(dy * x_hat)/N), both sums over every
tower by one all-reduce. Channels last (float32, float16): an inference-mode FusedBatchNormGradV3
gives scale * rstd * dy and the local sums, an inference-mode FusedBatchNormV3 the correction;
else elementwise passes. Why: the fewest nodes and launches (docs/performance.md). N is a
constant when static, else the all-reduce carries the counts; what reads only the all-reduce and
the global moments is built once per layer under the local backend (Builder.once). Invariant:
the gradient op becomes an IdentityN of its name; d(scale), d(offset) stay tower-local; every
op added here that reads the scale runs before d(scale) by data edges (a reference variable's
read aliases the buffer its update writes in place, and Grappler drops control edges:
tests/test_variable_reads.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from bnrewrite.graph.index import Graph
from bnrewrite.graph.nodes import DT_FLOAT, Builder, DType, identity_n
from bnrewrite.match.census import Site
from bnrewrite.rewrite.collectives import all_reduce
from bnrewrite.rewrite.passes.record import PassRecord
from bnrewrite.rewrite.passes.sites import SiteContext, each_site, static_counts, takes_kernels
from bnrewrite.rewrite.plan import Plan
from bnrewrite.rewrite.statistics import reciprocal_std

F = DT_FLOAT


def sync_backward(graph: Graph, plan: Plan) -> tuple[Graph, PassRecord]:
    return each_site(graph, plan, "sync_backward", "fused", _rewrite_grads)


def _rewrite_grads(site: Site, ctx: SiteContext) -> None:
    for phase, grad in enumerate(site.grads, start=1):
        _rewrite_grad(grad, site, ctx, phase)
        ctx.record.replaced.append(grad)


def _rewrite_grad(grad: str, site: Site, ctx: SiteContext, phase: int) -> None:
    node = ctx.graph.node(grad)
    if takes_kernels(site):
        _rewrite_grad_with_kernels(grad, site, ctx, phase)
        return
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
    rstd = b.cast("rstd", saved_rstd, U, F)
    sum_dy = b.reduce_sum("sum_dy", dyf, axes, F, False)
    mean = b.once(("mean_b", saved_mean), lambda: b.per_channel("mean_b", b.cast("mean", saved_mean, U, F), shape, F))
    centred = b.binary("Sub", "centred", b.cast("x_float", x, T, F), mean, F)
    sum_dy_xc = b.reduce_sum("sum_dy_xc", b.binary("Mul", "dy_xc", dyf, centred, F), axes, F, False)
    # scale * rstd and d(scale) = sum(dy * (x - mean)) * rstd by one product, so that d(scale)
    # comes after every read of the scale by data (module docstring)
    products = b.binary("Mul", "rstd_products", b.node("Pack", "scale_and_sum", [b.cast("scale", scale, U, F), sum_dy_xc],
                                                           T=DType(F), N=2, axis=0), rstd, F)
    unpacked = b.node("Unpack", "gain", [products], T=DType(F), num=2, axis=0)
    gain, dscale_float = unpacked, f"{unpacked}:1"
    dy_gain = b.binary("Mul", "dy_gain", dyf, b.per_channel("gain_b", gain, shape, F), F)
    collective = ctx.plan.collective(ctx.layer, phase, ctx.tower)
    static = _static_total(ctx, phase)
    if static is None:  # the all-reduce carries the counts
        packed = b.concat("sums", [b.count("count", x, axes, T, F), sum_dy, sum_dy_xc], F)
    else:
        packed = b.concat("sums", [sum_dy, sum_dy_xc], F)
    reduce_name = all_reduce(b, "all_reduce", packed, F, collective)
    minus_mean_dy, proj = b.once(("factors", reduce_name, rstd), lambda: _global_factors(b, reduce_name, rstd, static))
    ctx.record.collectives.append(reduce_name)

    # gain * (dy - mean_dy - (x - mean) * proj), as dy * gain (taken before the all-reduce)
    # - (x - mean) * (proj * gain) - gain * mean_dy
    xc_gain = b.per_channel("xc_gain_b", b.binary("Mul", "xc_gain", proj, gain, F), shape, F)
    dy_gain_minus_xc = b.binary("Sub", "dy_gain_minus_xc", dy_gain, b.binary("Mul", "xc_proj", centred, xc_gain, F), F)
    constant = b.per_channel("constant_b", b.binary("Mul", "constant", minus_mean_dy, gain, F), shape, F)
    dx = b.cast("dx", b.binary("AddV2", "dx_float", dy_gain_minus_xc, constant, F), F, T)
    dscale = b.cast("dscale_stat", dscale_float, F, U)
    _replace(grad, b, dx, dscale, b.cast("doffset_stat", sum_dy, F, U), controls, site, ctx)


def _global_factors(b: Builder, reduced: str, rstd: str, static: int | None) -> tuple[str, str]:
    """(-mean(dy), rstd^2 mean(dy (x - mean))) over the global batch, from the all-reduced
    [sum dy, sum dy (x - mean)], led by N when not `static`."""
    rstd_sq = b.binary("Mul", "rstd_sq", rstd, rstd, F)
    if static is None:
        total, (gsum_dy, gsum_dy_xc) = b.split_count("global", reduced, F)
        mean_dy = b.binary("DivNoNan", "mean_dy", gsum_dy, total, F)
        proj = b.binary("DivNoNan", "projection", b.binary("Mul", "dy_xc_rstd_sq", gsum_dy_xc, rstd_sq, F), total, F)
    else:  # products with 1/N
        gsum_dy, gsum_dy_xc = b.split_pairs("global", reduced, F)
        inverse = b.const("reciprocal_total", 1.0 / static, np.float32)
        mean_dy = b.binary("Mul", "mean_dy", gsum_dy, inverse, F)
        proj = b.binary("Mul", "projection", gsum_dy_xc, b.binary("Mul", "rstd_sq_per_example", rstd_sq, inverse, F), F)
    return b.unary("Neg", "minus_mean_dy", mean_dy, F), proj


def _rewrite_grad_with_kernels(grad: str, site: Site, ctx: SiteContext, phase: int) -> None:
    """The kernel path (module docstring): channels last, an inference-mode FusedBatchNormGradV3
    for gain * dy and the local [sum dy * x_hat, sum dy], one all-reduce, and an inference-mode
    FusedBatchNormV3 for the correction -gain * (x_hat * mean(dy * x_hat) + mean(dy))."""
    node = ctx.graph.node(grad)
    dy, x, scale, mean, variance = node.input[:5]  # sync_forward left the variance in reserve_space_2
    controls = [i for i in node.input if i.startswith("^")]
    b = ctx.builder(grad, "sync_bn_grad", ctx.graph.node(site.name).device)
    attrs = {"epsilon": site.epsilon, "data_format": "NHWC", "T": DType(site.dtype), "U": DType(F)}
    empty = b.const("empty", np.zeros([0], np.float32), np.float32)
    rstd = reciprocal_std(b, variance, site.epsilon)
    gain = b.binary("Mul", "gain", scale, rstd, F)
    # fed gain and a unit variance (epsilon 0), the kernel reads the scale only through gain, so
    # d(scale) = sum(dy * (x - mean)) * rstd comes after every read of the scale by data
    unit = (b.const("ones", np.ones([site.channels], np.float32), np.float32) if site.channels else
            b.once(("ones", rstd), lambda: b.unary("OnesLike", "ones", rstd, F)))
    local = b.node("FusedBatchNormGradV3", "local", [dy, x, gain, mean, unit, empty], is_training=False, **{**attrs, "epsilon": 0.0})
    sum_dy_xhat, sum_dy = b.binary("Mul", "sum_dy_xhat", f"{local}:1", rstd, F), f"{local}:2"
    collective = ctx.plan.collective(ctx.layer, phase, ctx.tower)
    static = _static_total(ctx, phase)
    if static is not None:
        packed = b.node("Pack", "sums", [sum_dy_xhat, sum_dy], T=DType(F), N=2, axis=0)
    else:  # the all-reduce carries the counts
        packed = b.concat("sums", [b.count("count", x, b.const("axes", site.reduce_axes), site.dtype, F), sum_dy_xhat, sum_dy], F)
    reduced = all_reduce(b, "all_reduce", packed, F, collective)
    ctx.record.collectives.append(reduced)
    per_example = b.once(("per_example", reduced), lambda: _per_example(b, reduced, static))
    corrections = b.node("Unpack", "corrections", [b.binary("Mul", "scaled_sums", per_example, gain, F)], T=DType(F), num=2, axis=0)
    correction = b.node("FusedBatchNormV3", "correction", [x, corrections, f"{corrections}:1", mean, variance],
                        exponential_avg_factor=1.0, is_training=False, **attrs)
    dx = b.binary("AddV2", "dx", local, correction, site.dtype)
    _replace(grad, b, dx, sum_dy_xhat, sum_dy, controls, site, ctx)


def _per_example(b: Builder, reduced: str, static: int | None) -> str:
    """-[sum dy * x_hat, sum dy] / N over the global batch, from the all-reduced sums, led by N
    when not `static`."""
    if static is not None:
        return b.binary("Mul", "minus_sums_per_example", reduced, b.const("minus_reciprocal_total", -1.0 / static, np.float32), F)
    total, pair = b.split_count("global", reduced, F)
    per_example = b.unary("Neg", "minus_reciprocal_total", b.unary("Reciprocal", "reciprocal_total", total, F), F)
    return b.binary("Mul", "minus_sums_per_example", b.node("Pack", "global_sums", pair, T=DType(F), N=2, axis=0), per_example, F)


def _replace(grad: str, b: Builder, dx: str, dscale: str, doffset: str, controls: list[str], site: Site, ctx: SiteContext) -> None:
    """The gradient op becomes an IdentityN of (dx, d(scale), d(offset), empty reserve spaces).
    Its consumers keep their names; the order d(scale) needs comes from its own inputs: in the
    step Grappler makes, the IdentityN no longer holds d(scale) back until dx is done."""
    T, U = site.dtype, site.stat_dtype
    empty = b.cast("empty_u", b.const("empty", np.zeros([0], np.float32), np.float32), F, U)
    ctx.editor.replace(identity_n(grad, [dx, dscale, doffset, empty, empty] + controls, [T, U, U, U, U], b.device, ctx.key))


def _static_total(ctx: SiteContext, phase: int) -> int | None:
    """The layer's global count N when static (bnrewrite.rewrite.passes.sites.static_counts), from the x
    and scale each copy's gradient `phase` reads."""
    def x_and_scale(copy: Site) -> Sequence[str] | None:
        return ctx.graph.node(copy.grads[phase - 1]).input[1:3] if len(copy.grads) >= phase else None

    counts = static_counts(ctx, phase, x_and_scale)[1]
    return sum(counts) if counts else None
