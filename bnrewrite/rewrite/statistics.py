"""Global batch moments from per-tower ones with one all-reduce; shared by fused and unfused sites.

What: each tower gives its count n, mean m and spread (M2, or the kernel's Bessel-corrected
variance, n - 1 times which is M2). Static counts: one all-reduce gathers every tower's [m, spread]
(each in rows of its own), and mean = sum n m / N, variance = sum (M2 + n (m - mean)^2) / N in the
work dtype. Else one float64 all-reduce sums [n, n m, M2 + n m^2]. Why: deviations taken from the
global mean before squaring cancel nothing, so float32 keeps the one-device op's error; the
summed form needs float64 (docs/performance.md, "Numerics"). What follows the all-reduce reads
nothing of its tower: with the local backend's one sum it is built once per layer (Builder.once).
Invariant: the moments are those of the concatenated batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bnrewrite.graph.nodes import DT_DOUBLE, DT_FLOAT, DT_INT32, Builder, DType
from bnrewrite.rewrite.collectives import Collective, all_reduce, local_gather

D, F = DT_DOUBLE, DT_FLOAT
#: The numpy type of each work dtype.
NUMPY_TYPES = {D: np.float64, F: np.float32}


@dataclass(frozen=True)
class Local:
    """One tower's moments per channel, flattened: what the all-reduce combines."""

    count: str | int  # n: static, or a float64 [1] tensor
    mean: str  # in the work dtype
    spread: str  # in the work dtype: M2, or the Bessel-corrected variance M2 / (n - 1)
    unbiased: bool = False  # spread is M2 / (n - 1) (the kernel's variance; 0 when n <= 1)


@dataclass(frozen=True)
class Moments:
    """Tensors (in the work dtype unless noted) of the global moments, flattened per channel."""

    collective: str
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
        local_mean = b.binary("Mul", "local_mean", local_sum, b.const("reciprocal_count", 1.0 / max(count, 1), NUMPY_TYPES[work]), work)
    centre = local_mean if keep_dims else b.per_channel("local_mean_b", local_mean, broadcast, work)
    squared = b.binary("SquaredDifference", "squared", xf, centre, work)
    m2 = b.reduce_sum("local_m2", squared, axes_const, work, keep_dims)
    if keep_dims:
        flat = b.const("flat", [-1])
        local_mean, m2 = b.reshape("local_mean_flat", local_mean, flat, work), b.reshape("local_m2_flat", m2, flat, work)
    return Local(n, local_mean, m2), local_sum


def global_moments(b: Builder, local: Local, key: Collective, counts: Sequence[int] | None = None,
                   channels: int | None = None, work: int = F) -> Moments:
    """The global moments from every tower's `local` ones, by one all-reduce. `counts`, every
    member's count in member order when all are static (bnrewrite.rewrite.passes.sites.static_counts),
    keeps the counts out of the all-reduce; `channels`, the moments' length, is then static too.
    `work`: the dtype of `local.mean` and of the moments."""
    if counts is not None:
        assert channels, "static counts come from static shapes"
        return _gathered_moments(b, local, key, counts, channels, work)
    m64, spread = b.cast("local_mean64", local.mean, work, D), b.cast("local_spread64", local.spread, work, D)
    n = local.count if isinstance(local.count, str) else b.const("count", [float(local.count)], np.float64)
    m2 = spread
    if local.unbiased:  # n - 1, and 0 for a tower of no examples
        factor = (b.const("count_minus_one", [max(local.count - 1.0, 0.0)], np.float64) if isinstance(local.count, int) else
                  b.unary("Relu", "count_minus_one", b.binary("Sub", "count_less_one", n, b.const("one64", 1.0, np.float64), D), D))
        # MulNoNan: a tower of no examples gives the kernel's NaN moments, which must weigh 0
        m2 = b.binary("MulNoNan", "local_m2_64", spread, factor, D)
    s = b.binary("MulNoNan", "sum64", m64, n, D)
    ss = b.binary("AddV2", "sumsq64", m2, b.binary("MulNoNan", "mean_sq64", m64, s, D), D)
    reduced = all_reduce(b, "all_reduce", b.concat("moments", [n, s, ss], D), D, key)
    return b.once(("moments", reduced), lambda: _summed_combine(b, reduced, work))


def reciprocal_std(b: Builder, variance: str, epsilon: float) -> str:
    """1 / sqrt(variance + epsilon) in float32 from a float32 `variance`; built once per variance
    tensor in a pass (Builder.once), so the local backend's towers share their layer's."""
    return b.once(("rstd", variance), lambda: b.unary(
        "Rsqrt", "rstd", b.binary("AddV2", "variance_eps", variance, b.const("epsilon", epsilon, np.float32), F), F))


def _summed_combine(b: Builder, reduced: str, work: int) -> Moments:
    """The moments from the all-reduced float64 [N, sum n m, sum (M2 + n m^2)]."""
    total_count, (gsum, gsumsq) = b.split_count("global", reduced, D)
    mean64 = b.binary("DivNoNan", "mean64", gsum, total_count, D)
    m2_raw = b.binary("Sub", "m2_raw", gsumsq, b.binary("Mul", "sum_mean", gsum, mean64, D), D)
    m2g = b.binary("Maximum", "m2", m2_raw, b.const("zero64", 0.0, np.float64), D)  # rounding can leave -1e-16
    bessel = b.binary("Sub", "count_minus_one", total_count, b.const("one64", 1.0, np.float64), D)
    return Moments(
        collective=reduced,
        mean=b.cast("mean", mean64, D, work),
        variance=b.cast("variance", b.binary("DivNoNan", "variance64", m2g, total_count, D), D, work),
        variance_unbiased=b.cast("variance_unbiased", b.binary("DivNoNan", "variance_unbiased64", m2g, bessel, D), D, work),
    )


def _gathered_moments(b: Builder, local: Local, key: Collective, counts: Sequence[int], channels: int, work: int) -> Moments:
    """Static counts: member j's [m, spread] in rows 2j, 2j+1 of a [2K, C] tensor every tower
    holds: padded into place and all-reduced (a Pad, not a Pack of 2K inputs in every tower, which
    would grow the graph as K^2), or under the local backend one Pack of every member's for the
    layer (local_gather); then two contractions with constant weights: mean = sum_j n_j/N m_j,
    and variance = sum_j (n_j (m_j - mean)^2 + f_j spread_j) / N, f_j = n_j - 1 or 1. A tower of
    no examples gives zeros (its kernel's moments are NaN)."""
    rows, dtype = 2 * len(counts), NUMPY_TYPES[work]
    empty = counts[key.member] == 0
    if key.backend == "local":
        vectors = [b.const("zeros", np.zeros([channels], dtype), dtype)] * 2 if empty else [local.mean, local.spread]
        gathered = local_gather(b, "all_reduce", vectors, work, key)
    else:
        if empty:
            pair = b.const("zeros", np.zeros([2, channels], dtype), dtype)
        else:
            pair = b.node("Pack", "local", [local.mean, local.spread], T=DType(work), N=2, axis=0)
        padding = b.const("rows", [[2 * key.member, rows - 2 * key.member - 2], [0, 0]])
        placed = b.node("Pad", "placed", [pair, padding], T=DType(work), Tpaddings=DType(DT_INT32))
        gathered = all_reduce(b, "all_reduce", placed, work, key)
    return b.once(("moments", gathered), lambda: _gathered_combine(b, gathered, counts, local.unbiased, work))


def _gathered_combine(b: Builder, gathered: str, counts: Sequence[int], unbiased: bool, work: int) -> Moments:
    """The moments from the gathered [2K, C] rows by two contractions (_gathered_moments)."""
    rows, total, dtype = 2 * len(counts), float(sum(counts)), NUMPY_TYPES[work]
    means = np.zeros(rows, dtype)
    means[0::2] = [n / total for n in counts]
    spreads = np.zeros(rows, dtype)
    spreads[1::2] = [((n - 1.0) if unbiased else 1.0) / total if n else 0.0 for n in counts]
    mean = _contract(b, "mean", gathered, b.const("mean_weights", means, dtype), work)
    # the mean rows' squared deviations (the spread rows' go unused) and the spreads, weighted
    deviations = b.binary("SquaredDifference", "deviations", gathered, mean, work)
    both = b.concat("deviations_and_spreads", [deviations, gathered], work)
    variance = _contract(b, "variance", both, b.const("variance_weights", np.concatenate([means, spreads]), dtype), work)
    return Moments(collective=gathered, mean=mean, variance=variance,
                   variance_unbiased=b.binary("Mul", "variance_unbiased", variance, b.const("bessel", total / (total - 1.0), dtype), work))


def _contract(b: Builder, name: str, rows: str, weights: str, work: int) -> str:
    """sum_r weights[r] * rows[r]: a [C] vector from [R, C] rows and [R] weights, in one op."""
    return b.node("Einsum", name, [rows, weights], equation="rc,r->c", N=2, T=DType(work))
