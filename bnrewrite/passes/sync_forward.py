"""Forward: every copy of a layer normalizes with the statistics of the global batch.

Each tower's local moments (elementwise passes, or for large channels-last CPU activations and
float16 a training-mode FusedBatchNormV3 whose y goes unused; see bnrewrite.passes.sites for
the choice) are combined by `bnrewrite.statistics.global_moments` in one float64 all-reduce.
A fused op stays, under its name, in inference mode fed the global moments, so Grappler still
fuses a following ReLU into it; what the graph read of outputs 1-5 (moving averages, the
gradient's reserve spaces) comes from an IdentityN `<op>/statistics` beside it, and reserve
space 3 carries the global count N to sync_backward. With exponential_avg_factor != 1, inside
function bodies, and for small float32 activations (normalized by two passes from the local
deviations, which the IdentityN passes on for sync_backward), the op itself becomes an
IdentityN of its name. Invariant: every consumer of the original op reads, under the same
tensor name, what the training op would give for the global batch.
Why each path, with figures: docs/performance-history.md ("Kernels or passes").
"""


from __future__ import annotations

import numpy as np

from tensorflow.core.framework.node_def_pb2 import NodeDef

from bnrewrite.functions import in_body
from bnrewrite.graph import Graph
from bnrewrite.names import tensor_name
from bnrewrite.match.census import Site
from bnrewrite.nodes import DT_DOUBLE, DT_FLOAT, MARK, Builder, DType, identity_n, set_attr
from bnrewrite.passes.record import PassRecord
from bnrewrite.passes.sites import (DEVIATIONS_ATTR, SiteContext, each_site, kernel_sized, passes_sized, static_counts,
                                   statistics_node)
from bnrewrite.plan import Plan
from bnrewrite.statistics import Local, centred_moments, global_moments

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
    small, deviations = passes_sized(ctx.graph, site, x), ""
    count, total = static_counts(ctx, 0, lambda copy: ctx.graph.node(copy.name).input[:2])
    kernels = kernel_sized(ctx.graph, site, x)
    if kernels:
        local = _kernel_moments(b, x, scale, offset, site, count)
    else:
        local, _, deviations = centred_moments(b, x, T, site.reduce_axes, site.channel_shape, keep_deviations=small, count=count)
    moments = global_moments(b, local, ctx.plan.collective(ctx.layer, 0, ctx.tower), total)
    mean, var = moments.mean, moments.variance
    eps = b.const("epsilon", site.epsilon, np.float32)
    # reserve_space_2 holds what the gradient reads: the variance on the kernel path, else 1/std
    spread = var if kernels else b.unary("Rsqrt", "rstd", b.binary("AddV2", "variance_eps", var, eps, F), F)
    norm_attrs: dict[str, object] = {
        "epsilon": site.epsilon, "data_format": site.data_format, "is_training": False,
        "exponential_avg_factor": 1.0, "T": DType(T),
    }
    if site.op != "FusedBatchNorm":
        norm_attrs["U"] = DType(U)
    batch_mean = _blend(b, "batch_mean", mean, mean_in, site)
    batch_var = _blend(b, "batch_variance", moments.variance_unbiased, var_in, site)
    statistics = [b.cast(f"out_{i}", t, F, U) for i, t in enumerate((batch_mean, batch_var, mean, spread))]
    if site.op == "FusedBatchNormV3":  # reserve_space_3: the global count, so gradients need not count again
        statistics.append(b.const("empty", np.zeros([0], np.float32), np.float32) if total is not None and U == F
                          else b.cast("count_u", b.cast("count_float", moments.count, DT_DOUBLE, F), F, U))
    if small:
        # Normalized from the deviations the local moments took: the gradient reads them too.
        shift = b.binary("Sub", "shift", mean, local.mean, F)
        y = _normalize_by_passes(b, deviations, scale, offset, shift, spread, U)
        replaced = identity_n(site.name, [y, *statistics, deviations, shift, *controls],
                              [T] + [U] * len(statistics) + [F, F], node.device, key)
        set_attr(replaced, DEVIATIONS_ATTR, len(statistics) + 1)
        editor.replace(replaced)
    elif not in_body(site.name):
        # The op stays, in inference mode fed the global moments; outputs 1-5 move to the
        # statistics, so that Grappler still fuses a following ReLU into it.
        inputs = [x, scale, offset, b.cast("mean_u", mean, F, U), b.cast("variance_u", var, F, U)]
        editor.replace(_marked(site.op, site.name, inputs + controls, node.device, key, norm_attrs))
        _move_statistics(ctx, site.name, statistics + controls, U)
    else:
        y = b.node(site.op, "normalize", [x, scale, offset, b.cast("mean_u", mean, F, U), b.cast("variance_u", var, F, U)], **norm_attrs)
        editor.replace(identity_n(site.name, [y, *statistics, *controls], [T] + [U] * len(statistics), node.device, key))
    ctx.record.replaced.append(site.name)
    ctx.record.collectives.append(moments.collective)
    ctx.record.moments[site.name] = (mean, var)


def _normalize_by_passes(b: Builder, deviations: str, scale: str, offset: str, shift: str, rstd: str, U: int) -> str:
    """(x - mean) * gain + offset as deviations * gain + (offset - shift * gain), where the
    deviations are x's from the tower's own mean and `shift` the global mean minus that:
    two passes over float32 channels-last data, both terms centred (x * a + b would cancel at a
    large |mean|/std)."""
    gain = b.binary("Mul", "gain", b.cast("scale_f", scale, U, F), rstd, F)
    bias = b.binary("Sub", "bias", b.cast("offset_f", offset, U, F), b.binary("Mul", "shift_gain", shift, gain, F), F)
    return b.binary("AddV2", "normalize", b.binary("Mul", "scaled", deviations, gain, F), bias, F)


def _marked(op: str, name: str, inputs: list[str], device: str, key: str, attrs: dict[str, object]) -> NodeDef:
    """A node that takes the place and name of a replaced one, carrying the mark."""
    node = NodeDef(op=op, name=name, input=inputs, device=device)
    for attr, value in attrs.items():
        set_attr(node, attr, value)
    set_attr(node, MARK, key)
    return node


def _move_statistics(ctx: SiteContext, site: str, inputs: list[str], dtype: int) -> None:
    """Outputs 1-5 of `site` move to an IdentityN beside it, of `inputs` (the new outputs,
    then the op's control edges): whatever read them reads that. The op's output 0 keeps
    only its own consumers (usually a Relu), so that Grappler's remapper fuses the two on
    CPU as it did the training op: it fuses no op whose other outputs are read."""
    moved = ctx.editor.unique_name(statistics_node(site))
    outputs = [i for i in inputs if not i.startswith("^")]
    ctx.editor.add(identity_n(moved, inputs, [dtype] * len(outputs), ctx.graph.node(site).device, ctx.key))
    for output in range(1, len(outputs) + 1):
        for edge in ctx.graph.consumers_of(site, output):
            ctx.editor.mutable(edge.consumer).input[edge.slot] = tensor_name(moved, output - 1)


def _kernel_moments(b: Builder, x: str, scale: str, offset: str, site: Site, count: int | None) -> Local:
    """The local moments from a training-mode FusedBatchNormV3 (channels last), whose y goes
    unused: its mean, and its Bessel-corrected variance, n - 1 times which is M2."""
    empty = b.const("empty", np.zeros([0], np.float32), np.float32)
    local = b.node("FusedBatchNormV3", "local_moments", [x, scale, offset, empty, empty], epsilon=site.epsilon,
                   data_format="NHWC", is_training=True, exponential_avg_factor=1.0, T=DType(site.dtype), U=DType(F))
    variance = b.cast("local_variance64", f"{local}:2", F, DT_DOUBLE)
    if count is not None:
        return Local(count, f"{local}:1", variance, count - 1.0)
    n = b.count("count", x, b.const("axes", site.reduce_axes), site.dtype, DT_DOUBLE)
    return Local(n, f"{local}:1", variance, b.binary("Sub", "count_minus_one", n, b.const("one64", 1.0, np.float64), DT_DOUBLE))


def _blend(b: Builder, name: str, value: str, running: str, site: Site) -> str:
    """(1-f)*running + f*value, as FusedBatchNormV3 does with exponential_avg_factor f."""
    f = site.avg_factor
    if f == 1.0:
        return value
    running_f = b.cast(f"{name}/running", running, site.stat_dtype, F)
    keep = b.binary("Mul", f"{name}/keep", running_f, b.const(f"{name}/one_minus_factor", 1.0 - f, np.float32), F)
    new = b.binary("Mul", f"{name}/new", value, b.const(f"{name}/factor", f, np.float32), F)
    return b.binary("AddV2", name, keep, new, F)

