"""Judging the values a step check fetched (bnrewrite.session.stepcheck), in numpy alone: that the
rewrite's global moments are those of all towers' inputs together (float64), every tower's output
matches, and each moving statistic equals one run of its kept update (one per application for a
network applied several times per tower, in an order the program leaves open), moving it by one
factor for all channels toward the global statistic; one whose update the step does not run must
be unchanged, unless another application's update of it runs (then that one is checked alone).
Apart from building the check's ops, which needs TensorFlow. Invariant: a figure over its
tolerance raises PassError naming the layer, the tower and the figure.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bnrewrite.errors import PassError
from bnrewrite.graph.index import Device
from bnrewrite.rewrite.report import LayerRow

#: Machine epsilon of the dtype the data is normalized in.
EPSILON = {"float": 2.0**-23, "half": 2.0**-10, "bfloat16": 2.0**-7, "double": 2.0**-52}
#: A figure may reach this many float32 epsilons (rounding in a few float32 ops, the rewrite's
#: float32 moments against float64 ones: 1-3 measured), the output also this many of its own
#: dtype's (x and y rounded to it: 0.4 measured in float16 and bfloat16).
ULPS = 16
DTYPE_ULPS = 2
_TINY = 1e-30


@dataclass(frozen=True)
class TowerFetches:
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
class KeptUpdate:
    node: str
    variable: str
    statistic: str
    tower: str
    sign: int  # -1 subtracts the value, 1 adds it, 0 assigns it
    value: str
    read: str
    derived: bool


@dataclass(frozen=True)
class LayerFetches:
    row: LayerRow
    towers: tuple[TowerFetches, ...]
    updates: tuple[KeptUpdate, ...]


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


def partners_of(per_layer: list[list[KeptUpdate]]) -> dict[str, list[KeptUpdate]]:
    """Update -> the updates of its variable that other layers' sites ran in the step: a network
    each tower applies several times keeps one update per application (a layer each), each a
    run of its own on the variable. A second update of a variable within one layer is no
    partner: that is the run too many the check exists to catch."""
    by_variable: dict[str, list[tuple[int, KeptUpdate]]] = {}
    for index, updates in enumerate(per_layer):
        for u in updates:
            by_variable.setdefault(u.variable, []).append((index, u))
    return {u.node: [o for j, o in same if j != i] for same in by_variable.values() for i, u in same}


def _runs(old: np.ndarray, u: KeptUpdate, others: list[KeptUpdate],
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


def evaluate_layer(layer: LayerFetches, before: dict[str, Any], step: dict[str, Any], after: dict[str, Any],
                    ran: Collection[str] | None, partners: dict[str, list[KeptUpdate]],
                    written: dict[str, KeptUpdate]) -> LayerVerdict:
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


def _group_moments(layer: LayerFetches, value: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
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


def _output_error(value: dict[str, np.ndarray], t: TowerFetches, epsilon: float) -> float:
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
