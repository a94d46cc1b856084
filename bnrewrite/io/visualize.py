"""Pictures and comparisons of a rewrite: Graphviz DOT of one layer before/after, TensorBoard
graph runs, and the node-level diff behind `bnrewrite diff`.

The DOT picture holds, for the first two towers of one layer: before, the batch-norm op, its
gradient ops and moving-average updates with their direct inputs and consumers; after, every
node bnrewrite added or replaced for that layer (its `_bnrewrite` attribute names the layer)
with their direct inputs and consumers, the all-reduces highlighted, and the ops the rewrite
removed drawn dashed. A node's consumers beyond a few (its own scope's first) are drawn as one
"N more consumers" node, so the picture's size does not grow with the depth of the net.
`.svg`/`.png` are rendered by a system Graphviz `dot` if there is one, else by the graphviz-pure
dependency (no system Graphviz needed).
"""

from __future__ import annotations

import importlib.metadata
import os
import posixpath
import shutil
import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from bnrewrite.errors import BnRewriteError, OutputError

MARK = "_bnrewrite"  # = bnrewrite.graph.nodes.MARK (not imported: that module imports TensorFlow)
INSTANCE_ATTR = "_bnrewrite_instance"  # = bnrewrite.rewrite.collectives: on each tower's all-reduce (NCCL, collective, ps), on a local sum or gather
GATHER_ROWS = 2  # = bnrewrite.rewrite.collectives: the inputs each tower gives a local gather (a Pack)
QUEUES_ATTR = "_bnrewrite_queues"  # = bnrewrite.rewrite.collectives: on each "ps" member (an AddN too)
_TEXT = frozenset({".dot", ".gv"})
_RENDERED = {".svg": "svg", ".png": "png", ".pdf": "pdf"}
# The graphviz-pure dependency (a static port of Graphviz's dot) renders these without a system Graphviz.
_BUNDLED = "graphviz-pure"
_BUNDLED_FORMATS = frozenset({"svg", "png"})
_TOWERS_SHOWN = 2
# Consumers drawn per node: a constant the rewrite shares across layers would pull every layer in.
_CONSUMERS_SHOWN = 6


# ---------------------------------------------------------------------------
# diff
# ---------------------------------------------------------------------------


def _mark(node: Any) -> str | None:
    if MARK not in node.attr:
        return None
    value = node.attr[MARK].s
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _layer_of(name: str, layers: Iterable[str]) -> str | None:
    """The layer whose name appears as whole path components in `name` (longest first)."""
    padded = f"/{name}/"
    for layer in sorted(layers, key=len, reverse=True):
        if f"/{layer}/" in padded:
            return layer
    return None


def _upstream_layers(nodes: dict[str, Any], removed: list[str], marked: dict[str, str], depth: int = 8) -> dict[str, str]:
    """The layer of each removed node as convert's report names it: that of the nearest node
    upstream which the rewritten graph marks (the batch-norm op whose statistic a removed
    moving-average update read), shared by removed nodes joined by edges (an update and what
    only fed it). A removed node's name alone does not tell it for hand-written updates
    (`tower_1/AssignMovingAvg`)."""
    from bnrewrite.graph.names import parse_input

    gone = {name for name in removed if MARK not in nodes[name].attr}
    if not gone or not marked:
        return {}
    parent = {name: name for name in gone}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for name in gone:
        for spec in nodes[name].input:
            source = parse_input(spec)[0]
            if source in gone:
                parent[root(source)] = root(name)
    components: dict[str, list[str]] = defaultdict(list)
    for name in gone:
        components[root(name)].append(name)
    layers = {}
    for members in components.values():
        seen, frontier, layer = set(members), list(members), None
        for _ in range(depth):
            sources = [parse_input(spec)[0] for name in frontier for spec in nodes[name].input]
            frontier = [s for s in dict.fromkeys(sources) if s in nodes and s not in seen]
            seen.update(frontier)
            layer = next((marked[s] for s in frontier if s in marked), None)
            if layer is not None or not frontier:
                break
        if layer is not None:
            layers.update(dict.fromkeys(members, layer))
    return layers


def diff_entries(a: Any, b: Any) -> dict[str, Any]:
    """Differences between GraphDefs a and b: op counts, nodes, and per-layer rewrite changes."""
    nodes_a = {n.name: n for n in a.node}
    nodes_b = {n.name: n for n in b.node}
    counts_a, counts_b = Counter(n.op for n in a.node), Counter(n.op for n in b.node)
    ops = sorted(set(counts_a) | set(counts_b), key=lambda op: (-abs(counts_b[op] - counts_a[op]), op))
    op_counts = {op: [counts_a[op], counts_b[op]] for op in ops if counts_a[op] != counts_b[op]}
    added = [n for n in nodes_b if n not in nodes_a]
    removed = [n for n in nodes_a if n not in nodes_b]
    changed = [n for n in nodes_b if n in nodes_a and nodes_a[n] != nodes_b[n]]

    marks_b = {n: _mark(node) for n, node in nodes_b.items()}
    marks_a = {n: _mark(node) for n, node in nodes_a.items()}
    layers_seen = {m for m in (*marks_a.values(), *marks_b.values()) if m}
    rows: dict[str, dict[str, Any]] = {
        layer: {"added": 0, "replaced": 0, "replaced_ops": Counter(), "removed": 0, "collectives": 0}
        for layer in sorted(layers_seen)
    }
    other = {"added": 0, "removed": 0, "changed": 0}
    for name in added:
        layer = marks_b[name]
        if layer:
            rows[layer]["added"] += 1
            rows[layer]["collectives"] += _members(nodes_b[name])
        else:
            other["added"] += 1
    for name in changed:
        layer = marks_b[name]
        if layer and not marks_a[name]:
            rows[layer]["replaced"] += 1
            rows[layer]["replaced_ops"][nodes_a[name].op] += 1
        else:
            other["changed"] += 1
    upstream = _upstream_layers(nodes_a, removed, {n: m for n, m in marks_b.items() if m})
    for name in removed:
        layer = marks_a[name] or upstream.get(name) or _layer_of(name, layers_seen)
        if layer:
            rows[layer]["removed"] += 1
        else:
            other["removed"] += 1
    for row in rows.values():
        row["replaced_ops"] = dict(sorted(row["replaced_ops"].items()))
    return {
        "nodes_a": len(nodes_a), "nodes_b": len(nodes_b), "op_counts": op_counts,
        "added": added, "removed": removed, "changed": changed, "layers": rows, "unattributed": other,
    }


# ---------------------------------------------------------------------------
# DOT
# ---------------------------------------------------------------------------


def check_target(path: str) -> None:
    """Fail before the rewrite when the picture's extension is unknown or nothing can render it."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in _TEXT and ext not in _RENDERED:
        raise OutputError(f"--dot {path}: unknown picture format {ext or '(no extension)'!r}; "
                          "use .dot or .gv (Graphviz text), .svg or .png")
    if ext in _RENDERED:
        _program(path)


def _program(path: str) -> str:
    """The program that renders `path`'s format: Graphviz's own dot when installed, else graphviz-pure."""
    stem, ext = os.path.splitext(path)
    fmt = _RENDERED[ext.lower()]
    program = shutil.which("dot") or (_bundled() if fmt in _BUNDLED_FORMATS else None)
    if program is None:
        fix = ("install Graphviz (its dot writes PDF)" if fmt not in _BUNDLED_FORMATS
               else f"reinstall bnrewrite (its dependency {_BUNDLED} renders SVG and PNG) or install Graphviz")
        raise OutputError(f"--dot {path}: nothing here renders {fmt.upper()}; {fix}, or write {stem}.dot")
    return program


def _bundled() -> str | None:
    """graphviz-pure's program, found through its install record: the scripts directory of a
    venv or a --user install need not be on PATH."""
    try:
        files = importlib.metadata.files(_BUNDLED) or []
    except importlib.metadata.PackageNotFoundError:
        return shutil.which(_BUNDLED)
    programs = [str(f.locate()) for f in files if f.name in (_BUNDLED, _BUNDLED + ".exe")]
    return next((p for p in programs if os.access(p, os.X_OK)), None) or shutil.which(_BUNDLED)


def stage(outputs: Any, path: str, rewrite: Any, layer: str | None) -> str:
    """Stage the picture of `layer` (default: the first rewritten one); returns a note."""
    outcome, row = _pick_layer(rewrite, layer)
    text = layer_dot(outcome.entry.graph_def, outcome.result.graph_def, outcome.report, row.layer)
    ext = os.path.splitext(path)[1].lower()
    if ext in _RENDERED:
        outputs.stage_bytes(path, _render(text, path), "--dot")
        return f"{path}: layer {row.layer} before/after"
    outputs.stage_bytes(path, text.encode(), "--dot")
    return (f"{path}: layer {row.layer} before/after as Graphviz DOT text; "
            f"for a picture pass --dot {os.path.splitext(path)[0]}.svg (or .png)")


def _render(text: str, path: str) -> bytes:
    """DOT `text` in `path`'s format; a failure names the renderer's own last error line."""
    program = _program(path)
    fmt = _RENDERED[os.path.splitext(path)[1].lower()]
    try:
        return subprocess.run([program, f"-T{fmt}"], input=text.encode(), capture_output=True, check=True,
                              timeout=120).stdout
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {exc.returncode}"])[-1]
    except (OSError, subprocess.TimeoutExpired) as exc:
        detail = str(exc)
    raise OutputError(f"{os.path.basename(program)} could not render {path} ({detail}); write a .dot file instead")


def _pick_layer(rewrite: Any, layer: str | None) -> tuple[Any, Any]:
    rows = [(o, r) for o in rewrite.outcomes if o.report is not None and o.result is not None for r in o.report.layers]
    if not rows:
        raise BnRewriteError("--dot: no layer was rewritten, so there is nothing to draw")
    if layer is None:
        return rows[0]
    for outcome, row in rows:
        if row.layer == layer:
            return outcome, row
    names = ", ".join(dict.fromkeys(r.layer for _, r in rows))
    raise BnRewriteError(f"--dot-layer {layer!r} is not a rewritten layer; choose one of {names}")


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _short(name: str, prefix: str) -> str:
    short = name[len(prefix) + 1:] if prefix and name.startswith(prefix + "/") else name
    return short if len(short) <= 48 else "..." + short[-45:]


def layer_dot(before: Any, after: Any, report: Any, layer: str) -> str:
    """Graphviz DOT of `layer` before and after the rewrite (two clusters)."""
    row = next(r for r in report.layers if r.layer == layer)
    k_shown = min(_TOWERS_SHOWN, len(row.sites))
    per = len(row.gradients) // max(len(row.towers), 1)

    def roots(towers: range) -> list[str]:
        found = [posixpath.dirname(row.sites[k]) for k in towers]
        found += [posixpath.dirname(g) for k in towers for g in row.gradients[k * per:(k + 1) * per]]
        return [r for r in found if r]

    first, shown_towers = roots(range(1)), roots(range(k_shown))

    def under(name: str, prefixes: list[str]) -> bool:
        return any(name == r or name.startswith(r + "/") for r in prefixes)

    nodes_a = {n.name: n for n in before.node}
    nodes_b = {n.name: n for n in after.node}
    removed = {r["node"]: r["why"] for r in report.removed if under(r["node"], shown_towers)}
    core_a = list(row.sites[:k_shown]) + [g for k in range(k_shown) for g in row.gradients[k * per:(k + 1) * per]]
    core_a += [u for u in row.updates_kept if under(u, shown_towers)] + [n for n in removed if n in nodes_a]
    # After: the whole rewrite of the first tower; of the others, their all-reduces (the peers).
    core_b = [
        n for n, node in nodes_b.items()
        if _mark(node) == layer and (under(n, first) or (INSTANCE_ATTR in node.attr and under(n, shown_towers)))
    ]
    towers = ", ".join(row.towers[:k_shown]) + (f" (of {len(row.towers)})" if len(row.towers) > k_shown else "")
    title = f"bnrewrite: layer {layer}, towers {towers}; backend {report.backend}"
    lines = [
        "digraph bnrewrite {",
        "  rankdir=TB; compound=true; newrank=true;",
        '  node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica", fontsize=10];',
        '  edge [color="#555555", arrowsize=0.6];',
        f"  label={_quote(title)};",
        "  labelloc=t;",
    ]
    lines += _cluster("before", f"before: {row.op}, its gradient and moving-average updates, per tower",
                      nodes_a, core_a, removed={}, status=lambda n: "core")
    lines += _cluster("after", f"after ({row.towers[0]} in full; other towers: their all-reduces): "
                      "global-batch statistics; removed ops dashed",
                      nodes_b, core_b, removed=removed, removed_from={n: nodes_a[n].input for n in removed if n in nodes_a},
                      status=lambda n: "collective" if INSTANCE_ATTR in nodes_b[n].attr else "replaced" if n in nodes_a else "added")
    lines += _peer_edges(nodes_b, core_b)
    lines += [
        '  subgraph cluster_legend { label="legend"; fontsize=10; color="#bbbbbb";',
        '    legend_core [label="batch norm / gradient / update (before)", fillcolor="#ffe8a3"];',
        '    legend_added [label="added by bnrewrite", fillcolor="#d8f3dc"];',
        '    legend_replaced [label="replaced (same name)", fillcolor="#a8dadc"];',
        '    legend_collective [label="all-reduce", fillcolor="#f4a261", shape=box3d];',
        '    legend_removed [label="removed", style="dashed,rounded", color="#d62828", fontcolor="#d62828"];',
        '    legend_context [label="unchanged neighbour", color="#999999", fontcolor="#777777"];',
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def _members(node: Any) -> int:
    """How many towers' all-reduces `node` is: every member's for a local sum or gather, one for another's."""
    if INSTANCE_ATTR not in node.attr:
        return 0
    if node.op not in ("AddN", "Pack") or QUEUES_ATTR in node.attr:
        return 1
    return node.attr["N"].i // (GATHER_ROWS if node.op == "Pack" else 1)


def _peer_edges(nodes: dict[str, Any], names: list[str]) -> list[str]:
    """Dashed links between the all-reduces of one instance (the towers they join)."""
    by_instance: dict[int, list[str]] = defaultdict(list)
    for name in names:
        node = nodes[name]
        if INSTANCE_ATTR in node.attr:
            by_instance[node.attr[INSTANCE_ATTR].i].append(name)
    lines = []
    for members in by_instance.values():
        for a, b in zip(members, members[1:]):
            lines.append(f'  {_quote("after:" + a)} -> {_quote("after:" + b)} '
                         '[dir=both, style=dashed, color="#e76f51", constraint=false, label="all-reduce", fontsize=8];')
    return lines


_STYLE = {
    "core": 'fillcolor="#ffe8a3"',
    "added": 'fillcolor="#d8f3dc"',
    "replaced": 'fillcolor="#a8dadc", penwidth=2',
    "collective": 'fillcolor="#f4a261", shape=box3d, penwidth=2',
    "removed": 'style="dashed,rounded", color="#d62828", fontcolor="#d62828"',
    "context": 'color="#999999", fontcolor="#777777"',
}


def _why(why: str) -> str:
    if why.startswith("duplicate update"):
        return "duplicate update (" + why.split(";")[0].rsplit(" ", 1)[-1] + ")"
    if why.startswith("only fed"):
        return "only fed removed ops"
    return why[:40]


def _shared_scope(a: str, b: str) -> int:
    """How many leading name scopes `a` and `b` share: a node's own layer's consumers are drawn first."""
    return len(os.path.commonprefix([a.split("/"), b.split("/")]))


def _cluster(tag: str, title: str, nodes: dict[str, Any], core: list[str], removed: dict[str, str], status: Any,
             removed_from: dict[str, Any] | None = None) -> list[str]:
    from bnrewrite.graph.names import parse_input

    core_set = dict.fromkeys(n for n in core if n in nodes)
    consumers: dict[str, list[tuple[str, bool]]] = defaultdict(list)
    for node in nodes.values():
        for spec in node.input:
            src, out = parse_input(spec)
            consumers[src].append((node.name, out < 0))
    context: dict[str, None] = {}
    outside: dict[str, list[str]] = {}  # core node -> its consumers outside the core, in graph order
    for name in core_set:
        for spec in nodes[name].input:
            src, _ = parse_input(spec)
            if src in nodes and src not in core_set:
                context[src] = None
        found = dict.fromkeys(c for c, _ in consumers.get(name, ()) if c not in core_set)
        outside[name] = sorted(found, key=lambda c: _shared_scope(c, name), reverse=True)  # stable: graph order
        context.update(dict.fromkeys(outside[name][:_CONSUMERS_SHOWN]))
    everything = {**core_set, **context}
    prefix = os.path.commonprefix([n for n in core_set]).rsplit("/", 1)[0] if len(core_set) > 1 else ""
    ident = lambda name: _quote(f"{tag}:{name}")
    lines = [f"  subgraph cluster_{tag} {{", f"    label={_quote(title)}; fontsize=12; color=\"#888888\";"]
    for name in everything:
        kind = status(name) if name in core_set else "context"
        label = f"{_short(name, prefix)}\n{nodes[name].op}"
        lines.append(f"    {ident(name)} [label={_quote(label)}, {_STYLE[kind]}];")
    for name, why in removed.items():
        label = f"{_short(name, prefix)}\nremoved: {_why(why)}"
        lines.append(f"    {ident(name)} [label={_quote(label)}, {_STYLE['removed']}];")
        for spec in (removed_from or {}).get(name, ()):
            src, out = parse_input(spec)
            if src in removed or src in everything:
                lines.append(f"    {ident(src)} -> {ident(name)} [style=dashed, color=\"#d62828\"];")
    for name, names in outside.items():
        hidden = sum(c not in everything for c in names)
        if hidden:
            label = f"{hidden} more consumer{'s' if hidden > 1 else ''}"
            lines.append(f"    {ident(name + '/...')} [label={_quote(label)}, {_STYLE['context']}];")
            lines.append(f"    {ident(name)} -> {ident(name + '/...')} [style=dotted];")
    for name in everything:
        for spec in nodes[name].input:
            src, out = parse_input(spec)
            if src in everything:
                style = ' [style=dashed, color="#aaaaaa"]' if out < 0 else ""
                lines.append(f"    {ident(src)} -> {ident(name)}{style};")
    lines.append("  }")
    return lines


# ---------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------


def stage_tensorboard(outputs: Any, logdir: str, rewrite: Any) -> None:
    """The directory LOGDIR holding runs before/ and after/ (one subdirectory per MetaGraph of
    a SavedModel), staged as one output: with --force it replaces only a directory of that shape."""
    from bnrewrite.io.staging import LOGDIR

    graphs = [(o.entry, o.result) for o in rewrite.outcomes if o.result is not None]
    if not graphs:
        raise BnRewriteError("--tensorboard: no graph was rewritten, so there is nothing to show")

    def build(directory: str) -> None:
        for run, pick in (("before", 0), ("after", 1)):
            for pair in graphs:
                entry = pair[0]
                where = os.path.join(directory, run)
                if entry.tags is not None:
                    where = os.path.join(where, "_".join(entry.tags) or "untagged")
                _write_events(where, pair[pick].graph_def)

    outputs.stage_dir(logdir, build, LOGDIR, "--tensorboard")


def _write_events(directory: str, graph_def: Any) -> None:
    import logging

    import tensorflow as tf

    os.makedirs(directory, exist_ok=True)
    logger = logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(logging.ERROR)  # "Passing a GraphDef to the SummaryWriter is deprecated"
    try:
        with tf.Graph().as_default():
            writer = tf.compat.v1.summary.FileWriter(directory, graph_def=graph_def)
            writer.flush()
            writer.close()
    finally:
        logger.setLevel(level)
