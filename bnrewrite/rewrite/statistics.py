"""Global batch moments from per-tower ones with one all-reduce; shared by fused and unfused sites.

What: each tower gives its count n, mean m and spread (M2, or the kernel's Bessel-corrected
variance with its factor n - 1); one float64 all-reduce sums [n m, M2 + n m^2] (weighted by 1/N
when every count is static, so no count travels), and mean = S/N, variance = SS/N - mean^2.
Why float64: at a large |mean|/std the m^2 terms cancel; float64 keeps the result at the
one-device op's error (figures: docs/performance.md, "Numerics"). Invariant: the moments are
those of the concatenated batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bnrewrite.graph.nodes import DT_DOUBLE, DT_FLOAT, Builder, DType
from bnrewrite.rewrite.collectives import Collective, all_reduce

D, F = DT_DOUBLE, DT_FLOAT
_NUMPY = {D: np.float64, F: np.float32}


@dataclass(frozen=True)
class Local:
    """One tower's moments per channel, flattened: what the all-reduce combines."""

    count: str | int  # n: static, or a float64 [1] tensor
    mean: str  # in the work dtype
    spread: str  # in the work dtype: M2 = spread * factor
    factor: str | float = 1.0  # static, or a float64 [1] tensor


@dataclass(frozen=True)
class Moments:
    """Tensors (in the work dtype unless noted) of the global moments, flattened per channel."""

    collective: str
    count: str  # float64 [1]: N
    mean: str
    variance: str  # biased: M2 / N
    variance_unbiased: str  # M2 / (N - 1)


def centred_moments(b: Builder, x: str, dtype: int, axes: list[int], broadcast: list[int] | None,
                    count: int | None = None, work: int = F) -> tuple[Local, str]:
    """This tower's moments of x over `axes` by elementwise passes: a sum, then the squared
    deviations from the local mean (one SquaredDifference), summed; also returns the local sum.

    `broadcast`: for a per-channel reduction (fused sites) the shape that lines a [C] vector up
    with x (empty: channels last); sums come out flat. None keeps the reduced dimensions
    (moments sites) and flattens afterwards. `count`: the elements reduced per channel when
    static. `work`: the dtype of the sums and the local mean (float64 for float64 data).
    """
    axes_const = b.const("axes", axes)
    xf = b.cast("x_float", x, dtype, work)
    keep_dims = broadcast is None
    local_sum = b.reduce_sum("local_sum", xf, axes_const, work, keep_dims)
    n: str | int
    if count is None:
        n = b.count("count", x, axes_const, dtype, D)
        local_mean = b.binary("DivNoNan", "local_mean", local_sum, b.cast("count_float", n, D, work), work)
    else:
        n = count
        local_mean = b.binary("Mul", "local_mean", local_sum, b.const("reciprocal_count", 1.0 / max(count, 1), _NUMPY[work]), work)
    centre = local_mean if keep_dims else b.per_channel("local_mean_b", local_mean, broadcast, work)
    squared = b.binary("SquaredDifference", "squared", xf, centre, work)
    m2 = b.reduce_sum("local_m2", squared, axes_const, work, keep_dims)
    if keep_dims:
        flat = b.const("flat", [-1])
        local_mean, m2 = b.reshape("local_mean_flat", local_mean, flat, work), b.reshape("local_m2_flat", m2, flat, work)
    return Local(n, local_mean, m2), local_sum


def global_moments(b: Builder, local: Local, key: Collective, total: int | None = None, work: int = F) -> Moments:
    """The global moments from every tower's `local` ones, by one all-reduce. `total`, the
    global count when every member's is static (bnrewrite.rewrite.passes.sites.static_counts; then
    local.count and local.factor are static too), folds the counts into constant weights and
    keeps them out of the all-reduce. `work`: the dtype of `local.mean` and of the moments."""
    if total is not None:
        assert isinstance(local.count, int) and isinstance(local.factor, float)
        # [[n/N m], [factor/N spread]] and its product with [[m], [spread]]: rows 0-2 are what the
        # all-reduce sums (row 3 rides along: one Mul and one Concat instead of three and two)
        stacked = b.cast("local64", b.node("Pack", "local", [local.mean, local.spread], T=DType(work), N=2, axis=0), work, D)
        weights = b.const("weights64", [[local.count / total], [local.factor / total]], np.float64)
        # MulNoNan: a weight of 0 (no examples, or n = 1 for the kernel's variance) zeroes a NaN moment
        weighted = b.binary("MulNoNan", "weighted64", stacked, weights, D)
        reduced = all_reduce(b, "all_reduce", b.concat("moments", [weighted, b.binary("MulNoNan", "weighted_sq64", stacked, weighted, D)], D), D, key)
        rows = b.node("Unpack", "global", [reduced], T=DType(D), num=4, axis=0)
        mean64, mean_sq64 = rows, b.binary("AddV2", "mean_sq64", f"{rows}:1", f"{rows}:2", D)
        # E[x^2] - E[x]^2 in float64: at |mean|/std = 1000 it keeps ~1e-10 of the variance
        variance = b.cast("variance", b.binary("Sub", "variance64", mean_sq64, b.unary("Square", "mean_squared64", mean64, D), D), D, work)
        return Moments(collective=reduced, count=b.const("total64", [float(total)], np.float64), mean=b.cast("mean", mean64, D, work),
                       variance=variance, variance_unbiased=b.binary("Mul", "variance_unbiased", variance, b.const("bessel", total / (total - 1.0), _NUMPY[work]), work))
    m64, spread = b.cast("local_mean64", local.mean, work, D), b.cast("local_spread64", local.spread, work, D)
    n = local.count if isinstance(local.count, str) else b.const("count", [float(local.count)], np.float64)
    # MulNoNan: a tower of no examples gives the kernel's NaN moments, which must weigh 0
    m2 = spread if local.factor == 1.0 else b.binary("MulNoNan", "local_m2_64", spread, _float64(b, "factor", local.factor), D)
    s = b.binary("MulNoNan", "sum64", m64, n, D)
    ss = b.binary("AddV2", "sumsq64", m2, b.binary("MulNoNan", "mean_sq64", m64, s, D), D)
    reduced = all_reduce(b, "all_reduce", b.concat("moments", [n, s, ss], D), D, key)
    total_count, (gsum, gsumsq) = b.split_count("global", reduced, D)
    mean64 = b.binary("DivNoNan", "mean64", gsum, total_count, D)
    m2_raw = b.binary("Sub", "m2_raw", gsumsq, b.binary("Mul", "sum_mean", gsum, mean64, D), D)
    m2g = b.binary("Maximum", "m2", m2_raw, b.const("zero64", 0.0, np.float64), D)  # rounding can leave -1e-16
    bessel = b.binary("Sub", "count_minus_one", total_count, b.const("one64", 1.0, np.float64), D)
    return Moments(
        collective=reduced,
        count=total_count,
        mean=b.cast("mean", mean64, D, work),
        variance=b.cast("variance", b.binary("DivNoNan", "variance64", m2g, total_count, D), D, work),
        variance_unbiased=b.cast("variance_unbiased", b.binary("DivNoNan", "variance_unbiased64", m2g, bessel, D), D, work),
    )


def _float64(b: Builder, name: str, value: str | float) -> str:
    """A float64 scalar: a constant, or `value` itself when it is a tensor."""
    return value if isinstance(value, str) else b.const(name, value, np.float64)
