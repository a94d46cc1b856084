"""What a rewrite found, changed, removed and skipped, as text for people and a dict for tools.

`to_dict()` follows `SCHEMA_VERSION`; see docs/report-schema.md for the fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SCHEMA_VERSION = 1
REMOVED_SHOWN = 5  # duplicate updates named in the short text; the rest are counted
FOLLOWER = ", which was removed"  # ends the why of an op removed for feeding or reading after a removed one


@dataclass
class TowerTensors:
    """Where one tower's copy of a layer reads and writes, as tensor names of the rewritten
    graph, for checking a step (bnrewrite.session.stepcheck); all "" for a copy inside a function body,
    whose tensors cannot be fetched. `y` is "" when the layer's output was not found (moments
    feeding arithmetic other than tf.nn.batch_normalization's); `scale`/`offset` "" when none."""

    tower: str
    x: str
    y: str
    scale: str
    offset: str
    mean: str  # the global mean the rewrite computed: float32, flat over the kept axes
    variance: str  # the global biased variance, likewise


@dataclass
class MovingUpdate:
    """A moving-statistics update the rewritten graph keeps: the op, the variable it writes,
    which batch statistic ("mean" or "variance") its value comes from, and the tower it is in."""

    node: str
    variable: str
    statistic: str
    tower: str


@dataclass
class LayerRow:
    layer: str
    op: str
    data_format: str
    dtype: str
    towers: list[str]
    sites: list[str]
    gradients: list[str]
    collectives: int
    sync_groups: list[list[str]]
    updates_kept: list[str]
    lined_up_by: str = "shared variables"
    epsilon: float = 0.0  # 0.0 also for moments feeding arithmetic bnrewrite does not follow
    reduce_axes: list[int] = field(default_factory=list)
    tensors: list[TowerTensors] = field(default_factory=list)  # one per tower, in `towers` order
    moving: list[MovingUpdate] = field(default_factory=list)  # `updates_kept`, with what they write


@dataclass
class Report:
    backend: str = ""
    tower_by: str = ""
    towers: list[str] = field(default_factory=list)
    layout: str = ""
    sync_groups: list[list[str]] = field(default_factory=list)
    layers: list[LayerRow] = field(default_factory=list)
    removed: list[dict[str, str]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)  # training batch norms no gradient step runs: not towers
    copies: dict[str, dict[str, str]] = field(default_factory=dict)  # a one-tower step -> node -> its copy it runs
    passes: list[dict[str, object]] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    already_rewritten: bool = False
    cpu_devices: int = 0  # the CPU devices the session needs: all-reduces spread over /device:CPU:0..n-1, else 0
    unchanged: str = ""  # rewrite_graph(g, in_place=True) left a graph with nothing to synchronize as it is: why
    notes: list[str] = field(default_factory=list)

    @property
    def collectives(self) -> int:
        return sum(row.collectives for row in self.layers)

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["schema_version"] = SCHEMA_VERSION
        data["totals"] = {
            "layers_synced": len(self.layers),
            "collectives_added": self.collectives,
            "ops_removed": len(self.removed),
            "sites_skipped": len(self.skipped),
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
        }
        return data

    def __str__(self) -> str:
        return self.text()

    def text(self, verbose: bool = False, more: str = "report.text(verbose=True) lists them all") -> str:
        """The report for people. Unless `verbose`, the ops removed are counted with the first few
        duplicate updates named (a K-tower graph removes dozens); `more` says where the rest are.
        `to_dict()` always holds every list in full."""
        if self.unchanged:
            return f"bnrewrite: runs unchanged: {self.unchanged}\n"
        if self.already_rewritten:
            return "already rewritten by bnrewrite: nothing changed\n" + "".join(f"  {n}\n" for n in self.notes)
        lines = [
            f"bnrewrite: {len(self.layers)} batch-norm layer(s) synchronized across {len(self.towers)} towers "
            f"({', '.join(self.towers)}; told apart by {self.tower_by}), backend {self.backend}",
        ]
        if self.layout:
            lines.append(f"layout: {self.layout}")
        if len(self.sync_groups) > 1:
            lines.append("sync groups: " + "; ".join("[" + ", ".join(g) + "]" for g in self.sync_groups))
        if self.layers:
            lines.append("")
            header: tuple[str, ...] = ("layer", "op", "format", "dtype", "grads/tower", "all-reduces")
            rows = [(r.layer, r.op, r.data_format, r.dtype, str(len(r.gradients) // max(len(r.towers), 1)), str(r.collectives)) for r in self.layers]
            if any(r.lined_up_by != "shared variables" for r in self.layers):
                header += ("lined up by",)
                rows = [(*row, r.lined_up_by) for row, r in zip(rows, self.layers)]
            widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
            for row in (header, *rows):
                lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if self.removed:
            lines.append("")
            lines.append(f"removed {len(self.removed)} op(s):")
            lines.extend(self._removed_lines(verbose, more))
        lines.extend(self.closing_lines())
        return "\n".join(lines) + "\n"

    def _removed_lines(self, verbose: bool, more: str) -> list[str]:
        """Every op removed when verbose; else the first REMOVED_SHOWN duplicate updates and a
        count of the rest (the other duplicates, and the ops removed with them)."""
        if verbose:
            return [f"  {r['node']}: {r['why']}" for r in self.removed]
        updates = [r for r in self.removed if not r["why"].endswith(FOLLOWER)]
        shown = updates[:REMOVED_SHOWN]
        lines = [f"  {r['node']}: {r['why']}" for r in shown]
        rest_updates, fed = len(updates) - len(shown), len(self.removed) - len(updates)
        if rest_updates or fed:
            parts = [f"{rest_updates} more duplicate update(s)"] if rest_updates else []
            parts += [f"{fed} op(s) that only fed or read after those"] if fed else []
            lines.append(f"  ... and {' and '.join(parts)} ({more})")
        return lines

    def closing_lines(self) -> list[str]:
        """The sites skipped (with why), the notes and the totals: the end of the text report,
        which `bnrewrite inspect` prints after its own account of the layers."""
        lines = []
        if self.skipped:
            lines.append("")
            lines.append(f"skipped {len(self.skipped)} site(s):")
            lines.extend(f"  {s['node']}: {s['reason']}" for s in self.skipped)
        lines.extend(f"note: {n}" for n in self.notes)
        lines.append("")
        lines.append(
            f"totals: {len(self.layers)} layers, {self.collectives} all-reduces added, "
            f"{len(self.removed)} ops removed, {len(self.skipped)} sites skipped, "
            f"{self.nodes_before} -> {self.nodes_after} nodes"
        )
        return lines
