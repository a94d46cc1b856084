"""The loop the sync passes share: visit every site of one kind, tower by tower."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Callable, Sequence

from bnrewrite.graph.edit import Editor
from bnrewrite.graph.index import Graph
from bnrewrite.graph.nodes import DT_FLOAT, DT_HALF, Builder, Shared
from bnrewrite.match.census import Site
from bnrewrite.rewrite.passes.record import PassRecord
from bnrewrite.rewrite.plan import Plan


@dataclass(frozen=True)
class SiteContext:
    """What a site rewrite needs besides the site: where to write and which keys to use."""

    editor: Editor
    graph: Graph
    plan: Plan
    layer: int  # index of the site's layer group: its all-reduce keys derive from it
    tower: str
    key: str  # the layer's name, marked on every new node
    record: PassRecord
    shared: Shared  # by every site of the pass

    def builder(self, next_to: str, suffix: str, device: str) -> Builder:
        """A Builder for new nodes in a fresh scope beside `next_to`, on `device`."""
        return Builder(self.editor, layer_scope(self.editor, next_to, suffix), device, self.key, self.shared)


def each_site(graph: Graph, plan: Plan, name: str, kind: str, rewrite: Callable[[Site, SiteContext], None]) -> tuple[Graph, PassRecord]:
    """Run `rewrite` on every synced site of `kind`; returns the new graph and the record."""
    record = PassRecord(name)
    editor = Editor(graph)
    shared = Shared()
    for layer, group in enumerate(plan.groups):
        if group.sites[0].kind != kind:
            continue
        for tower, site in zip(plan.towers.ids, group.sites):
            rewrite(site, SiteContext(editor, graph, plan, layer, tower, group.key, record, shared))
    result = editor.finish()
    record.added = len(result) - len(graph)
    return result, record


def layer_scope(editor: Editor, node_name: str, suffix: str) -> str:
    """A fresh scope beside `node_name` (inside the layer's own name scope)."""
    return editor.unique_name(posixpath.join(posixpath.dirname(node_name), suffix))


#: Fused sites of these types take fused batch-norm kernels (sync_forward, sync_backward) when
#: channels last. Not bfloat16: the backward's kernels round its two terms of dx to 8 bits
#: apart, beyond what its oracle allows; float16 keeps 11 bits.
KERNEL_DTYPES = frozenset({DT_FLOAT, DT_HALF})


def takes_kernels(site: Site) -> bool:
    """Whether a fused site's rewrite uses fused batch-norm kernels (a training-mode op for the
    local moments, inference-mode ones for dx) rather than elementwise passes: float32 or float16,
    channels last (the CPU has no inference-mode gradient kernel for channels first)."""
    return site.dtype in KERNEL_DTYPES and site.data_format == "NHWC"


def static_count(graph: Graph, x: str, scale: str) -> int | None:
    """How many elements of `x` a fused batch norm reduces per channel (N*H*W), when the static
    shapes of x and of its [C] `scale` tell (recorded or inferred: Graph.static_elements)."""
    elements, channels = graph.static_elements(x), graph.static_elements(scale)
    return elements // channels if elements is not None and channels else None


def static_counts(ctx: SiteContext, phase: int, x_and_scale: Callable[[Site], Sequence[str] | None]) -> tuple[int | None, tuple[int, ...] | None]:
    """(n, counts) for ctx's tower in its layer (fused sites) and `phase` (0 forward, j+1 gradient j):
    the static_count of the x and scale tensors `x_and_scale` picks from a copy's site (None:
    the copy has none), and every member's of its sync group in member order when all of them are
    in this graph (one worker) and known, and sum above 1 (the unbiased variance divides by N - 1);
    else None, and the count then travels in the all-reduce. Worked out once per layer and phase."""
    key = (ctx.layer, phase)
    known = ctx.shared.counts.get(key)
    if known is None:
        plan = ctx.plan
        counts: dict[str, int | None] = {}
        for tower, site in zip(plan.towers.ids, plan.groups[ctx.layer].sites):
            picked = x_and_scale(site)
            counts[tower] = static_count(ctx.graph, *picked) if picked else None
        known = ctx.shared.counts[key] = {}
        for members in plan.sync_groups:
            group = tuple(counts.get(tower) for tower in members)
            static = plan.options.num_workers == 1 and None not in group and sum(group) > 1  # type: ignore[arg-type]
            for tower in members:
                known[tower] = (counts.get(tower), group if static else None)  # type: ignore[assignment]
    return known.get(ctx.tower, (None, None))
