"""The step check behind `--verify`: proof on one step that a rewritten graph normalized every
synced layer with the global batch's statistics and moved each moving statistic once toward them.

`build` adds check ops under `bnrewrite_verify/` to the C graph holding the rewritten graph: per
layer and tower, on its device, float64 per-channel sums of x and x^2, max |x|, max |y - y_hat|.
The caller fetches `before` (a read-only run), `step` (with its training step, fed `feed(...)`)
and `after`; `evaluate` judges the values (bnrewrite.session.step_verdict). Only a few numbers per layer
leave the devices. Invariant: the check's ops share no op with the rewrite's and write no
variable; a check that passes has seen every value it vouches for and every training batch-norm
layer is synchronized, else PassError (layer, tower, figure) or UnsyncedLayerError.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bnrewrite.errors import PassError, UnsyncedLayerError
from bnrewrite.graph.index import Device
from bnrewrite.graph.names import parse_input
from bnrewrite.rewrite.report import LayerRow, Report
from bnrewrite.session.step_verdict import KeptUpdate, LayerFetches, TowerFetches, Verdict, evaluate_layer, partners_of

SCOPE = "bnrewrite_verify"
#: Ops whose value input an update writes as it is, subtracts or adds.
_FORMS = {"AssignSubVariableOp": -1, "AssignSub": -1, "AssignAddVariableOp": 1, "AssignAdd": 1,
          "AssignVariableOp": 0, "Assign": 0}
#: How far up a kept update's inputs another kept update of the layer makes it derived
#: (zero-debias's unbiased value, renormalization's variance from its standard deviation).
_DERIVED_DEPTH = 24


@dataclass
class StepCheck:
    """Tensor names to fetch: `before` and `after` in read-only runs around the step, `step`
    together with the step; then `evaluate` the values, in the same order."""

    before: list[str]
    step: list[str]
    after: list[str]
    towers: list[str]
    layers: list[LayerFetches]
    not_checked: list[str]
    #: placeholder of the check -> the `before` read it is fed: a reference variable's value as the
    #: step's forward pass read it (its read aliases the buffer the step's optimizer updates). Fed,
    #: never fetched: TensorFlow's C API refuses a tensor both fed and fetched.
    snapshots: dict[str, str] = field(default_factory=dict)
    #: (layer, why) of each training batch-norm layer the rewrite skipped, in the report's order
    unsynced: list[tuple[str, str]] = field(default_factory=list)
    scope: str = SCOPE  # the check's ops are under it

    def feed(self, before_values: Sequence[Any]) -> dict[str, Any]:
        """What to add to the step's feed, from the values of the `before` run."""
        before = dict(zip(self.before, before_values))
        return {placeholder: before[read] for placeholder, read in self.snapshots.items()}

    def fetches(self, ran: Collection[str] | None = None) -> list[str]:
        """`step`, less the values of the kept updates not in `ran` (the update ops the step runs;
        None: all of them), which the step would otherwise compute for the check alone."""
        if ran is None:
            return list(self.step)
        idle = {u.value for layer in self.layers for u in layer.updates if u.node not in ran}
        return [name for name in self.step if name not in idle]

    def evaluate(self, before_values: Sequence[Any], step_values: Sequence[Any], after_values: Sequence[Any],
                 ran: Collection[str] | None = None) -> Verdict:
        """`step_values` are those of `fetches(ran)`. Raises PassError naming the layer, tower and
        figure of the first check that fails, then UnsyncedLayerError if a layer was skipped."""
        before = dict(zip(self.before, before_values))
        step = dict(zip(self.fetches(ran), step_values))
        step.update({placeholder: before[read] for placeholder, read in self.snapshots.items()})
        after = dict(zip(self.after, after_values))
        run = [[u for u in layer.updates if ran is None or u.node in ran] for layer in self.layers]
        partners = partners_of(run)
        written = {u.variable: u for updates in run for u in updates}
        verdicts, worst, worst_at = [], 0.0, ""
        for layer in self.layers:
            verdict = evaluate_layer(layer, before, step, after, ran, partners, written)
            verdicts.append(verdict)
            for name, value in verdict.figures.items():
                if value >= worst:
                    worst, worst_at = value, f"{layer.row.layer}/{name}"
        verdict = Verdict(verdicts, self.towers, worst, worst_at, self.not_checked)
        self.require_synced(verdict)
        return verdict

    def ran_on(self, partition_graphs: Iterable[Any]) -> list[str]:
        """The device each tower ran on in the step whose partition graphs (RunOptions'
        output_partition_graphs) are given, told by its first layer's output (or input), in the
        parts the tower's id names (its device, and its job and task if named); [] if a tower's
        is not found (an op Grappler renamed)."""
        placed = {node.name: node.device for graph in partition_graphs for node in graph.node}
        tensors = {}
        for layer in reversed(self.layers):
            tensors.update((t.tower, parse_input(t.y or t.x)[0]) for t in layer.row.tensors if t.y or t.x)
        ran = []
        for tower in self.towers:
            device = placed.get(tensors.get(tower, ""), "")
            if not device:
                return []
            full, named = Device.parse(device), Device.parse(tower)
            ran.append(str(Device(full.job if named.job else "", full.replica if named.replica >= 0 else -1,
                                  full.task if named.task >= 0 else -1, full.type, full.index)))
        return ran

    def require_synced(self, verdict: Verdict | None = None) -> None:
        """UnsyncedLayerError naming every layer the rewrite left unsynchronized, if any, with what
        was verified of the others (`verdict`)."""
        if not self.unsynced:
            return
        total = len(self.layers) + len(self.not_checked) + len(self.unsynced)
        named = "; ".join(f"{layer} ({why})" for layer, why in self.unsynced)
        rest = f"; the {len(verdict.layers)} synced: {verdict.line()}" if verdict is not None and verdict.layers else ""
        raise UnsyncedLayerError(
            f"step check failed: {len(self.unsynced)} of {total} training batch-norm layers are not synchronized, "
            f"their towers normalize with their own batch statistics: {named}{rest}")


def build(graph: Any, graph_def: Any, report: Report, *, python_ops: bool = False) -> StepCheck:
    """Add the check ops for every synced layer of `report` to `graph`, whose C graph holds
    `graph_def` (the rewritten graph). The ops are written as NodeDefs and imported into the C
    graph alone, as the session runs that: a Python Operation per node of the graph (what
    tf.graph_util's import makes) took longer than all the rest. `python_ops`: also make the
    check's Python Operations, for a caller that fetches or walks them by tf.Graph."""
    fragment = _Fragment(graph, graph_def)
    before: list[str] = []
    step: list[str] = []
    layers, not_checked = [], []
    reads: dict[str, str] = {}
    snapshots: dict[str, str] = {}
    sites = {site for row in report.layers for site in row.sites}
    for index, row in enumerate(report.layers):
        if not any(t.x for t in row.tensors):
            not_checked.append(row.layer)
            continue
        towers = []
        affine: dict[str, tuple[str, str]] = {}  # sync group's first tower -> its gain and bias
        group_of = {t: group[0] for group in row.sync_groups or [row.towers] for t in group}
        for k, tensors in enumerate(row.tensors):
            tower = _tower_ops(fragment, f"layer_{index}/tower_{k}", row, tensors, snapshots,
                               affine, group_of.get(tensors.tower, tensors.tower))
            towers.append(tower)
            step.extend(n for n in (tower.sums, tower.squares, tower.count, tower.mean, tower.variance, tower.largest,
                                    tower.worst, tower.scale, tower.offset) if isinstance(n, str) and n
                        and n not in snapshots)
        updates = []
        names = {u.node for u in row.moving}
        for moving in row.moving:
            node = fragment.nodes[moving.node]
            if moving.variable not in reads:
                reads[moving.variable] = _read(fragment, f"read_{len(reads)}", moving.variable)
                before.append(reads[moving.variable])
            value = _name(node.input[1])
            updates.append(KeptUpdate(moving.node, moving.variable, moving.statistic, moving.tower, _FORMS[node.op],
                                   value, reads[moving.variable],
                                   _derived(fragment.nodes, value, names - {moving.node}, sites)))
            step.append(value)
        layers.append(LayerFetches(row, tuple(towers), tuple(updates)))
    fragment.add_to_graph(python_ops)
    step = list(dict.fromkeys(step))
    after = list(before)
    before.extend(dict.fromkeys(snapshots.values()))
    return StepCheck(before, step, after, list(report.towers), layers, not_checked, snapshots, unsynced_layers(report),
                     fragment.scope)


#: A top name scope that names a tower (`tower_0`, `clone_1`, `replica_2`, `gpu_3`).
_TOWER_SCOPE = re.compile(r"(?:tower|clone|replica|gpu|GPU)_?\d+")
#: TensorFlow's suffix making a repeated scope name unique (`net_1`: tower 1's `net`).
_UNIQUIFIED = re.compile(r"_\d+$")


def unsynced_layers(report: Report) -> list[tuple[str, str]]:
    """(layer, why) of every batch-norm layer the report lists as skipped, once per layer: a
    skipped op's name less its tower scope (or TensorFlow's `_k` suffix on its top scope) and
    its own name (`tower_1/net/bn3/FusedBatchNormV3` and `net_1/bn3/FusedBatchNormV3` are
    `net/bn3`), a function body by its name."""
    found: dict[str, str] = {}
    for skip in report.skipped:
        parts = skip["node"].split("/")
        if len(parts) > 2 and (parts[0] in report.towers or _TOWER_SCOPE.fullmatch(parts[0])):
            parts = parts[1:]
        elif len(parts) > 1:
            parts[0] = _UNIQUIFIED.sub("", parts[0])
        parts = parts[:-1] if len(parts) > 1 else parts
        if len(parts) > 1 and parts[-1] == "moments":
            parts = parts[:-1]
        found.setdefault("/".join(parts), skip["reason"])
    return list(found.items())


class _Fragment:
    """The check's NodeDefs under a scope of their own (`SCOPE`, or `SCOPE_<n>` if the graph has
    it), reading the graph's tensors by name, and what they need to know of those tensors."""

    def __init__(self, graph: Any, graph_def: Any) -> None:
        from tensorflow.core.framework import graph_pb2

        from bnrewrite.graph.c_graph import operations
        from bnrewrite.graph.edit import Editor
        from bnrewrite.graph.index import Graph
        from bnrewrite.graph.nodes import Shared

        self.graph = graph
        self.nodes = {node.name: node for node in graph_def.node}
        tops = {name.split("/", 1)[0] for name in self.nodes}
        self.scope = next(s for s in (SCOPE, *(f"{SCOPE}_{n}" for n in range(1, len(tops) + 2))) if s not in tops)
        self.c_ops = operations(graph)
        self.versions = graph_def.versions
        self.editor = Editor(Graph.from_graph_def(graph_pb2.GraphDef()))
        self.shared = Shared()
        self._python: dict[str, Any] = {}

    def builder(self, scope: str, device: str) -> Any:
        from bnrewrite.graph.nodes import Builder

        return Builder(self.editor, f"{self.scope}/{scope}", device, self.scope, self.shared)

    def tensor(self, name: str) -> Any:
        """The graph's tf.Tensor `name` (for its dtype and static shape), through a Python
        Operation made for its op alone when the graph has none."""
        op_name, index = parse_input(name)
        if op_name not in self._python:
            try:
                self._python[op_name] = self.graph.get_operation_by_name(op_name)
            except KeyError:
                from tensorflow.python.framework import ops

                self._python[op_name] = ops.Operation._from_c_op(c_op=self.c_ops[op_name], g=self.graph)
        return self._python[op_name].outputs[index]

    def dtype(self, name: str) -> int:
        """The base DataType of tensor `name`, of the graph's or one of the check's placeholders."""
        op_name = parse_input(name)[0]
        if op_name in self.editor:
            return self.editor.node(op_name).attr["dtype"].type
        return self.tensor(name).dtype.base_dtype.as_datatype_enum

    def add_to_graph(self, python_ops: bool) -> None:
        from bnrewrite.graph.c_graph import import_fragment

        fragment = self.editor.finish().to_graph_def()
        fragment.versions.CopyFrom(self.versions)
        made = {node.name for node in fragment.node}
        inputs = {}
        for node in fragment.node:
            for spec in node.input:
                source, index = parse_input(spec)
                if source not in made:
                    inputs[f"{source}:{index}"] = (self.c_ops[source], index)
        import_fragment(self.graph, fragment.SerializeToString(), inputs, {})
        if python_ops:
            self.graph._add_new_tf_operations(compute_devices=False)


def _name(tensor: str) -> str:
    """`op` -> `op:0`; `op:1` as it is."""
    return tensor if ":" in tensor else f"{tensor}:0"


def _tower_ops(fragment: _Fragment, scope: str, row: LayerRow, tensors: Any, snapshots: dict[str, str],
               affine: dict[str, tuple[str, str]], group: str) -> TowerFetches:
    """This tower's check ops: few, as Grappler's time on the first step grows with the nodes.
    `snapshots` gets the placeholders standing for reference variables' reads. The output's
    per-channel gain and bias come from the global moments of the first tower of the sync group
    (`group`) and serve all its towers (`affine`): each tower's y is checked against them."""
    from bnrewrite.graph.nodes import DT_DOUBLE, DT_INT32, DT_INT64, DType

    x = fragment.tensor(tensors.x)
    scale, offset = (_snapshot(fragment, scope, name, snapshots) if name and tensors.y else "" for name in (tensors.scale, tensors.offset))
    b = fragment.builder(scope, fragment.nodes[x.op.name].device)
    dtype = fragment.dtype(tensors.x)
    axes = b.const("axes", row.reduce_axes)
    x64 = b.cast("x64", x.name, dtype, DT_DOUBLE)
    sums = b.reduce_sum("sums", x64, axes, DT_DOUBLE, True)
    squares = b.reduce_sum("squares", b.unary("Square", "square", x64, DT_DOUBLE), axes, DT_DOUBLE, True)
    rank = x.shape.rank
    axes_set = {a % rank for a in row.reduce_axes} if rank else set()
    kept = [1 if a in axes_set else d for a, d in enumerate(x.shape.as_list())] if rank else []
    static = bool(kept) and None not in kept  # the shape of the per-channel sums
    if x.shape.is_fully_defined() and static:
        count: str | float = float(x.shape.num_elements() / np.prod(kept))
    else:
        sizes = [b.cast(f"{what}_size64", b.node("Size", f"{what}_size", [t], T=DType(d), out_type=DType(DT_INT64)),
                        DT_INT64, DT_DOUBLE) for what, t, d in (("x", x.name, dtype), ("sums", sums, DT_DOUBLE))]
        count = b.binary("RealDiv", "count", *sizes, DT_DOUBLE)
    largest = worst = ""
    if tensors.y:
        if group not in affine:
            channels_last = static and kept[-1] == int(np.prod(kept))
            affine[group] = _affine(fragment, b, row, tensors, scale, offset, "" if channels_last else sums)
        gain, bias = affine[group]
        # x * gain + (beta - mean * gain): in float64 its cancellation stays near 1e-13 even at |mean|/std = 1000
        y_hat = b.binary("AddV2", "y_hat", b.binary("Mul", "x_gain", x64, gain, DT_DOUBLE), bias, DT_DOUBLE)
        y64 = b.cast("y64", _name(tensors.y), fragment.dtype(tensors.y), DT_DOUBLE)
        error = b.unary("Abs", "error", b.binary("Sub", "difference", y_hat, y64, DT_DOUBLE), DT_DOUBLE)
        worst = b.reduce("Max", "worst", error, axes, DT_DOUBLE, True)
        largest = b.reduce("Max", "largest", b.unary("Abs", "magnitude", x64, DT_DOUBLE), axes, DT_DOUBLE, True)
    return TowerFetches(tensors.tower, _name(sums), _name(squares), count if isinstance(count, float) else _name(count),
                  _name(tensors.mean), _name(tensors.variance), largest and _name(largest), worst and _name(worst),
                  scale, offset)


def _affine(fragment: _Fragment, b: Any, row: LayerRow, tensors: Any, scale: str, offset: str, sums: str) -> tuple[str, str]:
    """(gain, bias) in float64, per channel: gamma / sqrt(variance + epsilon) and beta - mean * gain
    from the tower's global moments; shaped as `sums` (keep-dims sums of x) unless that is ""
    (channels last: [C] vectors broadcast as they are)."""
    from bnrewrite.graph.nodes import DT_DOUBLE, DT_INT32, DType

    shape = b.node("Shape", "sums_shape", [sums], T=DType(DT_DOUBLE), out_type=DType(DT_INT32)) if sums else ""

    def channel(name: str, what: str) -> str:
        value = b.cast(f"{what}64", name, fragment.dtype(name), DT_DOUBLE)
        return b.reshape(f"{what}_per_channel", value, shape, DT_DOUBLE) if shape else value

    rstd = b.unary("Rsqrt", "rstd", b.binary("AddV2", "variance_eps", channel(tensors.variance, "variance"),
                                             b.const("epsilon", row.epsilon, np.float64), DT_DOUBLE), DT_DOUBLE)
    gain = b.binary("Mul", "gain", rstd, channel(scale, "gamma"), DT_DOUBLE) if scale else rstd
    mean_gain = b.binary("Mul", "mean_gain", channel(tensors.mean, "mean"), gain, DT_DOUBLE)
    bias = b.binary("Sub", "bias", channel(offset, "beta"), mean_gain, DT_DOUBLE) if offset else b.unary("Neg", "bias", mean_gain, DT_DOUBLE)
    return gain, bias


def _snapshot(fragment: _Fragment, scope: str, name: str, snapshots: dict[str, str]) -> str:
    """`name`, or for a read of a reference variable (whose buffer the step's optimizer may
    update before the check's op reads it) a placeholder fed that variable's value read before
    the step."""
    from tensorflow.core.framework import attr_value_pb2

    from bnrewrite.graph.nodes import DType

    source = fragment.nodes[parse_input(name)[0]]
    while source.op in ("Identity", "RefIdentity") and source.input:
        source = fragment.nodes[parse_input(source.input[0])[0]]
    if source.op not in ("VariableV2", "Variable"):
        return _name(name)
    tensor = fragment.tensor(name)
    dtype = DType(tensor.dtype.base_dtype.as_datatype_enum)
    read = fragment.builder(scope, source.device).node("Identity", "snapshot_read", [source.name], T=dtype)
    placeholder = fragment.builder(scope, "").node("Placeholder", "snapshot", [], dtype=dtype,
                                                   shape=attr_value_pb2.AttrValue(shape=tensor.shape.as_proto()))
    snapshots[_name(placeholder)] = _name(read)
    return _name(placeholder)


def _read(fragment: _Fragment, scope: str, variable: str) -> str:
    """A read of `variable`'s value, placed with it."""
    from bnrewrite.graph.nodes import DType

    node = fragment.nodes[variable]
    b = fragment.builder(scope, node.device)
    dtype = DType(node.attr["dtype"].type)
    if node.op in ("VarHandleOp", "_VarHandlesOp"):
        return _name(b.node("ReadVariableOp", "read", [variable], dtype=dtype))
    return _name(b.node("Identity", "read", [variable], T=dtype))


def _derived(nodes: dict[str, Any], value: str, others: set[str], sites: set[str]) -> bool:
    """Whether an update's `value` depends on another kept update of its layer (within a few
    ops). The walk stops at batch-norm sites: what lies above them (the network) holds none."""
    frontier, seen = [parse_input(value)[0]], set(sites)
    for _ in range(_DERIVED_DEPTH):
        nxt = []
        for name in frontier:
            if name in others:
                return True
            if name not in seen and name in nodes:
                seen.add(name)
                nxt.extend(parse_input(spec)[0] for spec in nodes[name].input)
        frontier = nxt
    return False
