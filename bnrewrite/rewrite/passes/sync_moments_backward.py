"""Backward, unfused: the gradients of `tf.nn.moments` become those of the global moments.

The existing gradient of mean = Mean(x) divides the incoming gradient g_m by the local
count n_i (it takes g_m in at `mean_grad/Reshape`, or `mean_grad/BroadcastTo` for an input of
unknown shape); the gradient of the variance does the same with g_v before multiplying by
2(x - mean). The exact gradient of the global moments needs sum(g_m)/N and sum(g_v)/N
over all towers (each tower's g is K times its share of the averaged loss, as for fused
batch norm). One all-reduce of [n_i, g_m, g_v] gives the sums and N, and the incoming
gradients are replaced by sum(g) * n_i / N, so the existing division leaves sum(g)/N (n_i / N
a constant, and no count in the all-reduce, when every count is static).
"""

from __future__ import annotations

from bnrewrite.errors import PassError
from bnrewrite.graph.index import Graph
from bnrewrite.graph.nodes import DT_INT32, Builder, DType
from bnrewrite.match.census import Site
from bnrewrite.rewrite.collectives import all_reduce
from bnrewrite.rewrite.functions import in_body
from bnrewrite.rewrite.passes.record import PassRecord
from bnrewrite.rewrite.passes.sites import SiteContext, each_site
from bnrewrite.rewrite.passes.sync_moments_forward import moments_counts, working_dtype
from bnrewrite.rewrite.plan import Plan
from bnrewrite.rewrite.statistics import NUMPY_TYPES


def sync_moments_backward(graph: Graph, plan: Plan) -> tuple[Graph, PassRecord]:
    return each_site(graph, plan, "sync_moments_backward", "moments", _rewrite_site)


def _rewrite_site(site: Site, ctx: SiteContext) -> None:
    graph, editor = ctx.graph, ctx.editor
    device = graph.node(site.name).device  # the tower's: one all-reduce member per tower device
    work = working_dtype(site)
    for phase, entries in enumerate(zip(site.grads, site.variance_grads), start=1):
        b = ctx.builder(entries[0], "sync_moments_grad", device)
        flat = b.const("flat", [-1])
        incoming = [graph.node(e).input[0] for e in entries]
        local = [b.cast(f"g{i}_float", b.reshape(f"g{i}_flat", g, flat, site.dtype), site.dtype, work) for i, g in enumerate(incoming)]
        key = ctx.plan.collective(ctx.layer, phase, ctx.tower)
        n, counts = moments_counts(ctx)
        if counts is not None:  # n_i / N a constant, no count in the all-reduce
            reduced = all_reduce(b, "all_reduce", b.concat("sums", local, work), work, key)
            sums = b.once(("sums", reduced), lambda: b.split_pairs("global", reduced, work))
            share = b.const("share", [n / sum(counts)], NUMPY_TYPES[work])
        else:
            count = _local_count(b, graph, entries[0], site.x, site, work)
            reduced = all_reduce(b, "all_reduce", b.concat("sums", [count, *local], work), work, key)
            total, sums = b.once(("sums", reduced), lambda: b.split_count("global", reduced, work))
            share = b.binary("DivNoNan", "share", count, total, work)
        for i, (entry, g, summed) in enumerate(zip(entries, incoming, sums)):
            shape = b.node("Shape", f"g{i}_shape", [g], T=DType(site.dtype), out_type=DType(DT_INT32))
            scaled = b.cast(f"g{i}_scaled", b.binary("Mul", f"g{i}_share", summed, share, work), work, site.dtype)
            editor.mutable(entry).input[0] = b.reshape(f"g{i}_global", scaled, shape, site.dtype)
            ctx.record.replaced.append(entry)
        ctx.record.collectives.append(reduced)


def _local_count(b: Builder, graph: Graph, entry: str, x: str, site: Site, work: int) -> str:
    """n_i as a [1] tensor of dtype `work`: from x, or, in a gradient function that cannot see x, from
    the denominator the existing `mean_grad/truediv` divides by."""
    if not in_body(entry):
        return b.count("count", x, b.const("axes", site.reduce_axes), site.dtype, work)
    divide = entry.rsplit("/", 1)[0] + "/truediv"
    if divide not in graph or graph.node(divide).op not in ("RealDiv", "Div"):
        raise PassError(f"no {divide} beside {entry}: cannot tell the local count inside a gradient function")
    denominator = graph.node(divide).input[1]
    return b.reshape("count", b.cast("count_float", denominator, site.dtype, work), b.const("count_shape", [1]), work)
