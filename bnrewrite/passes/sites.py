"""The loop the sync passes share: visit every site of one kind, tower by tower."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Callable, Sequence

from bnrewrite.functions import in_body
from bnrewrite.graph import Graph
from bnrewrite.graph_edit import Editor
from bnrewrite.names import tensor_name
from bnrewrite.match.census import Site
from bnrewrite.nodes import DT_FLOAT, DT_HALF, Builder, Shared
from bnrewrite.passes.record import PassRecord
from bnrewrite.plan import Plan


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


def statistics_node(site: str) -> str:
    """Where sync_forward puts a fused site's outputs 1-5 when the op itself stays to
    normalize: sync_backward finds the global count there."""
    return f"{site}/statistics"


#: Attribute of the IdentityN that replaces a fused site normalized by passes (sync_forward):
#: the index of its output carrying x's deviations from the tower's own mean; the next output is
#: the global mean minus that mean. Its gradients read these instead of taking deviations again.
DEVIATIONS_ATTR = "_bnrewrite_deviations"


def deviations(graph: Graph, site: Site) -> tuple[str, str] | None:
    """(deviations, shift) that sync_forward left on `site`, if any, for its gradients (which
    read the op's x: matching makes sure). Not inside function bodies: a gradient's body
    reaches the forward's tensors only through its arguments."""
    node = graph.node(site.name)
    if DEVIATIONS_ATTR not in node.attr or in_body(site.name):
        return None
    index = node.attr[DEVIATIONS_ATTR].i
    return tensor_name(site.name, index), tensor_name(site.name, index + 1)


#: float32 activations of at least this many elements per tower take fused batch-norm kernels
#: instead of elementwise passes for the local moments and dx; those known to be smaller are
#: normalized by passes too (where the crossover lies: docs/performance-history.md, "Kernels or passes").
KERNEL_MIN_ELEMENTS = 1 << 17
#: ... if of these types. float16 takes them at any size: its passes would hold float32 copies
#: of the activation and its gradient across the all-reduce, raising the step's peak memory,
#: and cost no less time. Not bfloat16: the backward's kernels round its two terms of dx to 8
#: bits apart, beyond what its oracle allows; float16 keeps 11 bits.
KERNEL_DTYPES = frozenset({DT_FLOAT, DT_HALF})


def kernel_sized(graph: Graph, site: Site, activation: str) -> bool:
    """Whether a fused site's rewrite should use fused batch-norm kernels on `activation`
    rather than elementwise passes: channels last, on a CPU tower, and float16, or float32 of
    at least KERNEL_MIN_ELEMENTS elements per tower by its static shape (recorded or inferred:
    Graph.static_elements). GPU towers keep the passes: unmeasured there."""
    if not _kernel_kind(site):
        return False
    if site.dtype == DT_HALF:
        return True
    elements = graph.static_elements(activation)
    return elements is not None and elements >= KERNEL_MIN_ELEMENTS


def passes_sized(graph: Graph, site: Site, activation: str) -> bool:
    """Whether a fused float32 site's activation is known to be below KERNEL_MIN_ELEMENTS per
    tower on a channels-last CPU tower: small enough for elementwise passes to normalize it too
    (see sync_forward). Unknown sizes keep the kernel, which costs less than passes on large activations."""
    elements = graph.static_elements(activation)
    return site.dtype == DT_FLOAT and _kernel_kind(site) and elements is not None and elements < KERNEL_MIN_ELEMENTS


def kernel_size_unknown(graph: Graph, site: Site) -> bool:
    """Whether a fused site could take the kernels but its input's static shape is unknown,
    recorded or inferred (a placeholder of unknown batch size upstream, an op bnrewrite.shapes
    does not follow)."""
    return (site.kind == "fused" and _kernel_kind(site) and site.dtype != DT_HALF
            and graph.static_elements(graph.node(site.name).input[0]) is None)


def _kernel_kind(site: Site) -> bool:
    return site.dtype in KERNEL_DTYPES and site.data_format == "NHWC" and site.device.type == "CPU"


def static_count(graph: Graph, x: str, scale: str) -> int | None:
    """How many elements of `x` a fused batch norm reduces per channel (N*H*W), when the static
    shapes of x and of its [C] `scale` tell (recorded or inferred: Graph.static_elements)."""
    elements, channels = graph.static_elements(x), graph.static_elements(scale)
    return elements // channels if elements is not None and channels else None


def static_counts(ctx: SiteContext, phase: int, x_and_scale: Callable[[Site], Sequence[str] | None]) -> tuple[int | None, int | None]:
    """(n, N) for ctx's tower in its layer (fused sites) and `phase` (0 forward, j+1 gradient j):
    the static_count of the x and scale tensors `x_and_scale` picks from a copy's site (None:
    the copy has none), and the sum over its sync group when every member is in this graph (one
    worker) and known, and above 1 (the unbiased variance divides by N - 1); else None, and the
    count then travels in the all-reduce. Worked out for every tower once per layer and phase."""
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
            group = [counts.get(tower) for tower in members]
            total = None if plan.options.num_workers != 1 or None in group else sum(group)  # type: ignore[arg-type]
            for tower in members:
                known[tower] = (counts.get(tower), total if total is not None and total > 1 else None)
    return known.get(ctx.tower, (None, None))
