"""Proof on one step that a rewritten graph normalized every synced layer with the global batch's
statistics and moved each moving statistic exactly once toward them.

`build` adds check ops under `bnrewrite_verify/` to the C graph of a tf.Graph holding the
rewritten graph; they share no op with the rewrite's and write no variable. Per layer and tower
they compute, on the tower's device, float64 per-channel sums of x and x^2 (from the layer's
input), max |x|, and max |y - y_hat| with y_hat computed in float64 from x, gamma, beta, epsilon
and the global moments the rewrite made (those of the sync group's first tower, for all its
towers); the output's figure is that over the channel's largest term. The caller fetches
`before` (moving statistics; reference variables' gamma and beta) in a read-only run, `step`
with its real training step in the same run (fed `feed(before values)`), and `after` in a
read-only run; `evaluate` then checks in numpy (float64) that the rewrite's global moments are
those of all towers' inputs together, every tower's output matches, and each moving statistic
equals one application of its kept update (of each, for a network applied several times per
tower: one per application, in an order the program leaves open), which moves it by one factor
for all channels toward the global statistic; one whose update the step does not run (the
script's own wiring) must be unchanged, and is reported as not updated, unless another
application's update of it runs (a GAN keeping its discriminator's statistics from real images
only), which is then checked alone. Only a few numbers per
layer leave the devices. Invariant: a check that passes has seen every value it vouches for and
every training batch-norm layer of the graph is synchronized; one that fails raises PassError
naming the layer, the tower and the figure, or UnsyncedLayerError naming the layers the rewrite
skipped.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bnrewrite.errors import PassError, UnsyncedLayerError
from bnrewrite.graph import Device
from bnrewrite.names import parse_input
from bnrewrite.report import LayerRow, Report

SCOPE = "bnrewrite_verify"
#: Machine epsilon of the dtype the data is normalized in.
EPSILON = {"float": 2.0**-23, "half": 2.0**-10, "bfloat16": 2.0**-7, "double": 2.0**-52}
#: A figure may reach this many float32 epsilons (rounding in a few float32 ops, the rewrite's
#: float32 moments against float64 ones: 1-3 measured), the output also this many of its own
#: dtype's (x and y rounded to it: 0.4 measured in float16 and bfloat16).
ULPS = 16
DTYPE_ULPS = 2
#: Ops whose value input an update writes as it is, subtracts or adds.
_FORMS = {"AssignSubVariableOp": -1, "AssignSub": -1, "AssignAddVariableOp": 1, "AssignAdd": 1,
          "AssignVariableOp": 0, "Assign": 0}
#: How far up a kept update's inputs another kept update of the layer makes it derived
#: (zero-debias's unbiased value, renormalization's variance from its standard deviation).
_DERIVED_DEPTH = 24
_TINY = 1e-30


@dataclass(frozen=True)
class _Tower:
    """Names of what one tower's check fetches (per channel unless said), and its count."""

    tower: str
    sums: str  # of x
    squares: str  # of x^2
    count: str | float  # elements per channel: a number when x's static shape tells it
    mean: str  # the rewrite's global mean and biased variance
    variance: str
    largest: str  # max |x|; "" when the layer's output was not found, and so the next three
    worst: str  # max |y - y_hat|
    scale: str  # "" when none
    offset: str


@dataclass(frozen=True)
class _Update:
    node: str
    variable: str
    statistic: str
    tower: str
    sign: int  # -1 subtracts the value, 1 adds it, 0 assigns it
    value: str
    read: str
    derived: bool


@dataclass(frozen=True)
class _Layer:
    row: LayerRow
    towers: tuple[_Tower, ...]
    updates: tuple[_Update, ...]


@dataclass
class LayerVerdict:
    layer: str
    towers: int
    figures: dict[str, float]  # the worst of each figure over the towers, relative
    updates: list[str]  # one phrase per moving statistic
    unchecked: list[str]
    not_updated: list[str] = field(default_factory=list)  # moving statistics whose update the step does not run

    def line(self) -> str:
        figures = ", ".join(f"{k} {v:.1e}" for k, v in self.figures.items())
        parts = [f"{self.layer}: {self.towers} towers", figures, *self.updates, *self.unchecked]
        return ", ".join(p for p in parts if p)


@dataclass
class Verdict:
    layers: list[LayerVerdict]
    towers: list[str]
    worst: float
    worst_at: str
    not_checked: list[str] = field(default_factory=list)  # layers whose tensors cannot be fetched
    #: Where each tower's check ran (StepCheck.ran_on), in the parts its id names; [] when not told.
    ran_on: list[str] = field(default_factory=list)

    def line(self, where: str = "") -> str:
        head = f"verified {len(self.layers)} layers x {len(self.towers)} towers on {_devices(self.towers)}"
        if self.ran_on and self.ran_on != [str(Device.parse(t)) for t in self.towers]:  # soft placement moved them
            head += f" (ran on {_devices(list(dict.fromkeys(self.ran_on)))})"
        line = f"{head}{' (' + where + ')' if where else ''}: worst {self.worst:.1e} ({self.worst_at}), {self.moving()}"
        if self.not_checked:
            line += f"; {len(self.not_checked)} layer(s) not checked (inside function bodies: {', '.join(self.not_checked)})"
        return line

    def moving(self) -> str:
        """What the step did to the moving statistics, in words."""
        updated = sum(len(v.updates) - len(v.not_updated) for v in self.layers)
        idle = sum(len(v.not_updated) for v in self.layers)
        if not idle:
            return "moving statistics updated once" if updated else "no moving statistics updated"
        why = (f"{idle} moving statistic(s) not updated: the script's step does not run their updates "
               "(its own wiring, kept as it is; add them to the train op, e.g. tf.GraphKeys.UPDATE_OPS)")
        return f"moving statistics updated once, {why}" if updated else why

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": [{"layer": v.layer, "towers": v.towers, "figures": v.figures, "updates": v.updates,
                        "unchecked": v.unchecked, "not_updated": v.not_updated} for v in self.layers],
            "towers": self.towers, "worst": self.worst, "worst_at": self.worst_at, "not_checked": self.not_checked,
            "ran_on": self.ran_on,
        }


@dataclass
class StepCheck:
    """Tensor names to fetch: `before` and `after` in read-only runs around the step, `step`
    together with the step; then `evaluate` the values, in the same order."""

    before: list[str]
    step: list[str]
    after: list[str]
    towers: list[str]
    layers: list[_Layer]
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
        partners = _partners(run)
        written = {u.variable: u for updates in run for u in updates}
        verdicts, worst, worst_at = [], 0.0, ""
        for layer in self.layers:
            verdict = _evaluate_layer(layer, before, step, after, ran, partners, written)
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
            updates.append(_Update(moving.node, moving.variable, moving.statistic, moving.tower, _FORMS[node.op],
                                   value, reads[moving.variable],
                                   _derived(fragment.nodes, value, names - {moving.node}, sites)))
            step.append(value)
        layers.append(_Layer(row, tuple(towers), tuple(updates)))
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

        from bnrewrite.c_graph import operations
        from bnrewrite.graph import Graph
        from bnrewrite.graph_edit import Editor
        from bnrewrite.nodes import Shared

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
        from bnrewrite.nodes import Builder

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
        from bnrewrite.c_graph import import_fragment

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
               affine: dict[str, tuple[str, str]], group: str) -> _Tower:
    """This tower's check ops: few, as Grappler's time on the first step grows with the nodes.
    `snapshots` gets the placeholders standing for reference variables' reads. The output's
    per-channel gain and bias come from the global moments of the first tower of the sync group
    (`group`) and serve all its towers (`affine`): each tower's y is checked against them."""
    from bnrewrite.nodes import DT_DOUBLE, DT_INT32, DT_INT64, DType

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
    return _Tower(tensors.tower, _name(sums), _name(squares), count if isinstance(count, float) else _name(count),
                  _name(tensors.mean), _name(tensors.variance), largest and _name(largest), worst and _name(worst),
                  scale, offset)


def _affine(fragment: _Fragment, b: Any, row: LayerRow, tensors: Any, scale: str, offset: str, sums: str) -> tuple[str, str]:
    """(gain, bias) in float64, per channel: gamma / sqrt(variance + epsilon) and beta - mean * gain
    from the tower's global moments; shaped as `sums` (keep-dims sums of x) unless that is ""
    (channels last: [C] vectors broadcast as they are)."""
    from bnrewrite.nodes import DT_DOUBLE, DT_INT32, DType

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

    from bnrewrite.nodes import DType

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
    from bnrewrite.nodes import DType

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


def _partners(per_layer: list[list[_Update]]) -> dict[str, list[_Update]]:
    """Update -> the updates of its variable that other layers' sites ran in the step: a network
    each tower applies several times keeps one update per application (a layer each), each a
    run of its own on the variable. A second update of a variable within one layer is no
    partner: that is the run too many the check exists to catch."""
    by_variable: dict[str, list[tuple[int, _Update]]] = {}
    for index, updates in enumerate(per_layer):
        for u in updates:
            by_variable.setdefault(u.variable, []).append((index, u))
    return {u.node: [o for j, o in same if j != i] for same in by_variable.values() for i, u in same}


def _runs(old: np.ndarray, u: _Update, others: list[_Update],
          value: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """What `u` and `others` may leave in the variable, each run once on it, and the values `u`
    may have read (old, or old after any of the others): the program leaves their order open,
    so an assign's value or any of its partners' may be the last."""
    if u.sign == 0 or any(o.sign == 0 for o in others):
        return [value[w.value] for w in (u, *others) if w.sign == 0], [old]
    left = old + u.sign * value[u.value] + sum(o.sign * value[o.value] for o in others)
    reads = [old + sum(o.sign * value[o.value] for o in chosen)
             for size in range(len(others) + 1) for chosen in itertools.combinations(others, size)]
    return [left], reads


def _evaluate_layer(layer: _Layer, before: dict[str, Any], step: dict[str, Any], after: dict[str, Any],
                    ran: Collection[str] | None, partners: dict[str, list[_Update]],
                    written: dict[str, _Update]) -> LayerVerdict:
    """The layer's figures and what the step did to its moving statistics; `written`: variable ->
    an update of it the step runs (another application's, when this one's does not run)."""
    row = layer.row
    value = {name: np.asarray(v, np.float64).reshape(-1) for name, v in step.items()}
    moments = _group_moments(layer, value)
    moments_tolerance = ULPS * EPSILON["float"]
    y_tolerance = moments_tolerance + DTYPE_ULPS * EPSILON.get(row.dtype, EPSILON["float"])
    figures = {"mean": 0.0, "variance": 0.0}
    unchecked = [] if all(t.worst for t in layer.towers) else ["output not checked (not tf.nn.batch_normalization's)"]
    for t in layer.towers:
        mean, variance, _ = moments[t.tower]
        # The scales float32 rounding works on: a mean's is |mean| + std, a variance's (the towers'
        # float32 means err by epsilons of |mean|, times the spread of the means) also |mean| * std.
        deviation = np.sqrt(variance + row.epsilon)
        mean_scale, variance_scale = np.abs(mean) + deviation + _TINY, variance + row.epsilon + np.abs(mean) * deviation
        checks = [("mean", np.max(np.abs(value[t.mean] - mean) / mean_scale), moments_tolerance,
                   "the global mean, relative to |mean| + the standard deviation"),
                  ("variance", np.max(np.abs(value[t.variance] - variance) / variance_scale),
                   moments_tolerance, "the global variance, relative to it + |mean| * the standard deviation")]
        if t.worst:
            checks.append(("output", _output_error(value, t, row.epsilon), y_tolerance,
                           "the output y against gamma * (x - mean) / sqrt(var + eps) + beta in float64, relative to the "
                           "channel's largest term"))
        for name, figure, tolerance, what in checks:
            _require(figure <= tolerance, f"layer {row.layer}, tower {t.tower}: {what} is off by {figure:.2e} "
                                          f"(allowed {tolerance:.1e})")
            figures[name] = max(figures.get(name, 0.0), float(figure))
    updates, not_updated = [], []
    for u in layer.updates:
        old = np.asarray(before[u.read], np.float64)
        new = np.asarray(after[u.read], np.float64)
        if ran is not None and u.node not in ran and u.variable in written:
            # one application's update kept by the script (a GAN's on real images): the statistic
            # is checked there, as exactly one run of that update
            updates.append(f"{_short(u.variable)} updated by another application only ({written[u.variable].node})")
            continue
        if ran is not None and u.node not in ran:
            _require(np.array_equal(old, new), (
                f"layer {row.layer}: {u.variable} changed in a step that runs none of its kept updates ({u.node})"))
            not_updated.append(u.variable)
            updates.append(f"{_short(u.variable)} not updated (the step does not run {u.node})")
            continue
        others = partners.get(u.node, [])
        lefts, reads = _runs(old, u, others, value)
        once = min(float(np.max(np.abs(new - left) / (np.abs(old) + np.abs(left) + _TINY))) for left in lefts)
        runs = f"one run of its update {u.node}" + "".join(f" and one of {o.node}" for o in others)
        _require(once <= moments_tolerance, (
            f"layer {row.layer}: {u.variable} is not what {runs} writes: off by {once:.2e} "
            f"relative (allowed {moments_tolerance:.1e}); is it updated more than once per step?"))
        figures["moving"] = max(figures.get("moving", 0.0), once)
        if u.derived:
            updates.append(f"{_short(u.variable)} updated once (derived from another update)")
            continue
        targets = _targets(moments[u.tower], row)[u.statistic]
        residual, factor, name = min(_toward(read, value[u.value] if u.sign == 0 else read + u.sign * value[u.value],
                                             targets, moments_tolerance) for read in reads)
        _require(residual <= moments_tolerance and 0.0 < factor <= 1.0 + moments_tolerance, (
            f"layer {row.layer}: {u.variable} did not move toward the global batch {u.statistic} by one factor for every "
            f"channel: off by {residual:.2e} relative at factor {factor:.3g} (allowed {moments_tolerance:.1e})"))
        figures["moving"] = max(figures["moving"], residual)
        updates.append(f"{_short(u.variable)} once toward the global {name} (factor {factor:.3g})")
    return LayerVerdict(row.layer, len(layer.towers), figures, updates, unchecked, not_updated)


def _group_moments(layer: _Layer, value: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """Tower -> (mean, biased variance, count) of its sync group's inputs together, in float64."""
    found = {}
    for group in layer.row.sync_groups or [layer.row.towers]:
        towers = [t for t in layer.towers if t.tower in group]
        total = sum(float(value[t.count][0]) if isinstance(t.count, str) else t.count for t in towers)
        mean = sum(value[t.sums] for t in towers) / total
        variance = np.maximum(sum(value[t.squares] for t in towers) / total - mean**2, 0.0)
        found.update({t.tower: (mean, variance, total) for t in towers})
    return found


def _targets(moments: tuple[np.ndarray, np.ndarray, float], row: LayerRow) -> dict[str, list[tuple[str, np.ndarray, Any]]]:
    """The statistics a moving average of the mean or the variance may move toward, in the order
    the layer's kind makes likely (one step from 0, zero-debias's biased value, fits every one
    proportional to the first), each with the scale its rounding is judged on beyond |old| +
    |statistic|, as the moments' are."""
    mean, variance, total = moments
    deviation = np.sqrt(variance + row.epsilon)
    spread = np.abs(mean) * deviation
    unbiased = ("unbiased variance", variance * total / max(total - 1.0, 1.0), spread)
    biased = ("variance", variance, spread)
    return {"mean": [("mean", mean, deviation)],
            "variance": [*((unbiased, biased) if row.op.startswith("Fused") else (biased, unbiased)),
                         ("standard deviation", deviation, np.abs(mean))]}


def _output_error(value: dict[str, np.ndarray], t: _Tower, epsilon: float) -> float:
    """max |y - y_hat| per channel over the largest term of y_hat, (max |x| + |mean|) * |gain| + |beta|,
    the largest of those ratios."""
    gain = value[t.scale] if t.scale else 1.0
    gain = gain / np.sqrt(value[t.variance] + epsilon)
    beta = np.abs(value[t.offset]) if t.offset else 0.0
    return float(np.max(value[t.worst] / ((value[t.largest] + np.abs(value[t.mean])) * np.abs(gain) + beta + _TINY)))


def _toward(old: np.ndarray, written: np.ndarray, candidates: list[tuple[str, np.ndarray, Any]],
            tolerance: float) -> tuple[float, float, str]:
    """(residual, factor, name) of the first candidate statistic s that `written` = old + f * (s - old)
    fits with one f in (0, 1] for every channel, residual relative to |old| + |s| + its scale;
    else of the one that fits best."""
    fits = []
    for name, target, scale in candidates:
        step = target - old
        factor = float(np.sum((written - old) * step) / max(float(np.sum(step * step)), _TINY))
        residual = float(np.max(np.abs(written - old - factor * step) / (np.abs(old) + np.abs(target) + scale + _TINY)))
        if residual <= tolerance and 0.0 < factor <= 1.0 + tolerance:
            return residual, factor, name
        fits.append((residual, factor, name))
    return min(fits)


def _short(variable: str) -> str:
    return variable.rsplit("/", 1)[-1]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise PassError(f"step check failed: {message} (a bnrewrite bug: please report it)")


def _devices(towers: list[str]) -> str:
    """`/device:GPU:0..3` for towers numbered in order on one prefix, else their list."""
    prefix = towers[0].rstrip("0123456789") if towers else ""
    if prefix and all(t == f"{prefix}{k}" for k, t in enumerate(towers)) and len(towers) > 1:
        return f"{prefix}0..{len(towers) - 1}"
    return ", ".join(towers)
