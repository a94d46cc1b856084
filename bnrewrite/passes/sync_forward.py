"""Forward: every copy of a layer normalizes with the statistics of the global batch.

Each tower reduces its slice to (n, n*m, M2 + n*m^2) per channel, where m and M2 are the
local mean and sum of squared deviations computed around m. One all-reduce in float64
sums them; mean = S/N and M2 = SS - S*mean. This is Chan's parallel combine
(M2 = sum M2_i + sum n_i (m_i - mean)^2) with the between-group term expanded: because each
M2_i is centred locally and the expansion runs in float64, the cancellation costs
(|mean|/std)^2 * 1e-16, far below float32 rounding even for |mean|/std = 1e4.

The training op is replaced by an IdentityN of the same name whose outputs are:
y (an inference-mode fused batch norm fed the global moments), the global batch mean and
Bessel-corrected variance (blended with the running inputs when exponential_avg_factor is
not 1, as the op does), then reserve spaces carrying the global mean and 1/sqrt(var+eps),
which `sync_backward` reads.
"""

from __future__ import annotations

import posixpath

import numpy as np

from bnrewrite.collectives import all_reduce
from bnrewrite.graph import Editor, Graph
from bnrewrite.match.sites import Site
from bnrewrite.nodes import DT_DOUBLE, DT_FLOAT, Builder, DType, identity_n
from bnrewrite.passes.record import PassRecord
from bnrewrite.plan import Plan

D, F = DT_DOUBLE, DT_FLOAT


def sync_forward(graph: Graph, plan: Plan) -> tuple[Graph, PassRecord]:
    record = PassRecord("sync_forward")
    editor = graph.edit()
    before = len(graph)
    for layer, group in enumerate(plan.groups):
        for tower, site in zip(plan.towers.ids, group.sites):
            reduce_name = _rewrite_site(editor, graph, site, plan, layer, tower, group.key)
            record.replaced.append(site.name)
            record.collectives.append(reduce_name)
    result = editor.finish()
    record.added = len(result) - before
    return result, record


def layer_scope(editor: Editor, node_name: str, suffix: str) -> str:
    """A fresh scope beside `node_name` (inside the layer's own name scope)."""
    return editor.unique_name(posixpath.join(posixpath.dirname(node_name), suffix))


def _rewrite_site(editor: Editor, graph: Graph, site: Site, plan: Plan, layer: int, tower: str, key: str) -> str:
    node = graph.node(site.name)
    x, scale, offset, mean_in, var_in = node.input[:5]
    controls = [i for i in node.input if i.startswith("^")]
    b = Builder(editor, layer_scope(editor, site.name, "sync_bn"), node.device, key)
    T, U = site.dtype, site.stat_dtype
    axes = b.const("axes", site.reduce_axes)

    xf = b.cast("x_float", x, T, F)
    n = b.count("count", x, axes, T, D)
    one = b.const("one", 1.0, np.float32)
    n_safe = b.binary("Maximum", "count_safe", b.cast("count_float", n, D, F), one, F)
    local_mean = b.binary("RealDiv", "local_mean", b.reduce_sum("local_sum", xf, axes, F, True), n_safe, F)
    centred = b.binary("Sub", "centred", xf, local_mean, F)
    m2 = b.reduce_sum("local_m2", b.unary("Square", "squared", centred, F), axes, F, True)
    flat = b.const("flat", [-1])
    m64 = b.cast("local_mean64", b.reshape("local_mean_flat", local_mean, flat, F), F, D)
    m2_64 = b.cast("local_m2_64", b.reshape("local_m2_flat", m2, flat, F), F, D)
    s = b.binary("Mul", "sum64", n, m64, D)
    ss = b.binary("AddV2", "sumsq64", m2_64, b.binary("Mul", "mean_sq64", s, m64, D), D)
    packed = b.concat("moments", [n, s, ss], D)
    reduce_name = all_reduce(b, "all_reduce", packed, D, plan.collective(layer, 0, tower))

    total, (gsum, gsumsq) = b.split_count("global", reduce_name, D)
    one64 = b.const("one64", 1.0, np.float64)
    total_safe = b.binary("Maximum", "global_count_safe", total, one64, D)
    mean64 = b.binary("RealDiv", "mean64", gsum, total_safe, D)
    zero64 = b.const("zero64", 0.0, np.float64)
    m2g = b.binary("Maximum", "m2", b.binary("Sub", "m2_raw", gsumsq, b.binary("Mul", "sum_mean", gsum, mean64, D), D), zero64, D)
    var64 = b.binary("RealDiv", "variance64", m2g, total_safe, D)
    bessel = b.binary("Maximum", "bessel_count", b.binary("Sub", "count_minus_one", total, one64, D), one64, D)
    var_unbiased = b.cast("variance_unbiased", b.binary("RealDiv", "variance_unbiased64", m2g, bessel, D), D, F)
    mean = b.cast("mean", mean64, D, F)
    var = b.cast("variance", var64, D, F)
    eps = b.const("epsilon", site.epsilon, np.float32)
    rstd = b.unary("Rsqrt", "rstd", b.binary("AddV2", "variance_eps", var, eps, F), F)

    norm_attrs: dict[str, object] = {
        "epsilon": site.epsilon, "data_format": site.data_format, "is_training": False,
        "exponential_avg_factor": 1.0, "T": DType(T),
    }
    if site.op != "FusedBatchNorm":
        norm_attrs["U"] = DType(U)
    y = b.node(site.op, "normalize", [x, scale, offset, b.cast("mean_u", mean, F, U), b.cast("variance_u", var, F, U)], **norm_attrs)

    batch_mean = _blend(b, "batch_mean", mean, mean_in, site)
    batch_var = _blend(b, "batch_variance", var_unbiased, var_in, site)
    outputs = [y, *(b.cast(f"out_{i}", t, F, U) for i, t in enumerate((batch_mean, batch_var, mean, rstd)))]
    if site.op == "FusedBatchNormV3":
        outputs.append(outputs[-1])
    replacement = identity_n(site.name, outputs + controls, [T] + [U] * (len(outputs) - 1), node.device, key)
    editor.replace(replacement)
    return reduce_name


def _blend(b: Builder, name: str, value: str, running: str, site: Site) -> str:
    """(1-f)*running + f*value, as FusedBatchNormV3 does with exponential_avg_factor f."""
    f = site.avg_factor
    if f == 1.0:
        return value
    running_f = b.cast(f"{name}/running", running, site.stat_dtype, F)
    keep = b.binary("Mul", f"{name}/keep", running_f, b.const(f"{name}/one_minus_factor", 1.0 - f, np.float32), F)
    new = b.binary("Mul", f"{name}/new", value, b.const(f"{name}/factor", f, np.float32), F)
    return b.binary("AddV2", name, keep, new, F)

