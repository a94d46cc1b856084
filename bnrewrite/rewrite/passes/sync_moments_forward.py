"""Forward, unfused: `tf.nn.moments` gives the moments of the global batch in every tower.

The Mean of x and the Mean of the squared differences are replaced by IdentityN nodes of
the same names that carry the global mean and (biased) variance from
`bnrewrite.rewrite.statistics.global_moments`, in the shape the Means had. Everything downstream
(`tf.nn.batch_normalization` or hand-written arithmetic, moving-average updates, the
StopGradient the variance's gradient reads) then sees global statistics unchanged.
"""

from __future__ import annotations

from bnrewrite.graph.index import Graph
from bnrewrite.graph.nodes import DT_DOUBLE, DT_FLOAT, DT_INT32, Builder, DType, identity_n
from bnrewrite.match.census import Site
from bnrewrite.rewrite.passes.record import PassRecord
from bnrewrite.rewrite.passes.sites import SiteContext, each_site, static_counts
from bnrewrite.rewrite.plan import Plan
from bnrewrite.rewrite.statistics import Moments, centred_moments, global_moments



def working_dtype(site: Site) -> int:
    """The dtype the statistics of a moments site are computed in: float64 for float64 data,
    else float32 (float16 and bfloat16 data sum in float32, as tf.nn.moments does)."""
    return DT_DOUBLE if site.dtype == DT_DOUBLE else DT_FLOAT


def moments_counts(ctx: SiteContext) -> tuple[int | None, tuple[int, ...] | None]:
    """(n, every member's n) of ctx's tower and layer when static (static_counts): the elements
    of x per element of the Mean."""
    return static_counts(ctx, 0, lambda copy: (copy.x, copy.name))


def sync_moments_forward(graph: Graph, plan: Plan) -> tuple[Graph, PassRecord]:
    return each_site(graph, plan, "sync_moments_forward", "moments", _rewrite_site)


def _rewrite_site(site: Site, ctx: SiteContext) -> None:
    graph, editor = ctx.graph, ctx.editor
    node = graph.node(site.name)
    b = ctx.builder(site.name, "sync_moments", node.device)
    work = working_dtype(site)
    count, counts = moments_counts(ctx)
    local, local_sum = centred_moments(b, node.input[0], site.dtype, site.reduce_axes, None, count, work)
    moments = global_moments(b, local, ctx.plan.collective(ctx.layer, 0, ctx.tower), counts, graph.static_elements(site.name), work)
    # the reduced dimensions kept are 1 in every tower: one reshape serves them all
    outputs = b.once(("moments_out", moments.mean, moments.variance), lambda: _outputs(b, site, moments, local_sum, work))
    for name, value in zip((site.name, site.variance), outputs):
        controls = [i for i in graph.node(name).input if i.startswith("^")]
        editor.replace(identity_n(name, [value, *controls], [site.dtype], graph.node(name).device, ctx.key))
        ctx.record.replaced.append(name)
    ctx.record.collectives.append(moments.collective)
    ctx.record.moments[site.name] = (moments.mean, moments.variance)


def _outputs(b: Builder, site: Site, moments: Moments, local_sum: str, work: int) -> list[str]:
    """The global mean and variance in the shape and dtype of the Means they replace."""
    shape = b.node("Shape", "keep_dims_shape", [local_sum], T=DType(work), out_type=DType(DT_INT32)) if site.keep_dims else ""
    outputs = []
    for value in (moments.mean, moments.variance):
        if site.keep_dims:
            value = b.reshape(f"{value.rsplit('/', 1)[1]}_kept", value, shape, work)
        outputs.append(b.cast(f"{value.rsplit('/', 1)[1]}_out", value, work, site.dtype))
    return outputs
