"""Global batch moments from per-tower slices with one all-reduce; shared by fused and unfused sites.

Each tower reduces its slice to (n, n*m, M2 + n*m^2) per channel, where m and M2 are the
local mean and sum of squared deviations computed around m. One all-reduce in float64
sums them; mean = S/N and M2 = SS - S*mean: Chan's parallel combine with the between-group
term expanded. When every tower's n is static the counts stay out of the all-reduce: mean =
S/N and variance = SS/N - mean^2 with N a constant. Because each M2_i is centred locally and
the expansion runs in float64, the cancellation stays far below float32 rounding; what
remains is each local mean's own float32 error, so at a very large |mean|/std the variance is
a little further from float64 than TensorFlow's one-device op (figures: docs/performance.md,
"Numerics").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bnrewrite.collectives import Collective, all_reduce
from bnrewrite.nodes import DT_DOUBLE, DT_FLOAT, Builder

D, F = DT_DOUBLE, DT_FLOAT
_NUMPY = {D: np.float64, F: np.float32}


@dataclass(frozen=True)
class Local:
    """One tower's moments per channel, flattened: what the all-reduce combines."""

    count: str  # float64 [1]: n
    mean: str  # float32
    m2: str  # float64: the sum of squared deviations from `mean`


@dataclass(frozen=True)
class Moments:
    """Tensors (float32 unless noted) of the global moments, flattened per channel."""

    collective: str
    count: str  # float64 [1]: N
    mean: str
    variance: str  # biased: M2 / N
    variance_unbiased: str  # M2 / (N - 1)


def centred_moments(b: Builder, x: str, dtype: int, axes: list[int], broadcast: list[int] | None,
                    keep_deviations: bool = False, count: int | None = None, work: int = F) -> tuple[Local, str, str]:
    """This tower's moments of x over `axes` by elementwise passes: a sum, then the squared
    deviations from the local mean, summed; also returns the local sum, and with
    `keep_deviations` the deviations themselves (float32, x's shape: a Sub, for sync_forward
    to normalize from, whose sum of squares an EuclideanNorm takes in the same pass that reads
    them, where Square + Sum would write and read an x-sized temporary), else "" (one
    SquaredDifference: one kernel on a GPU).

    `broadcast` is, for a per-channel reduction (fused sites), the shape that lines a [C]
    vector up with x, empty when it lines up as it is (channels last): sums then come out
    flat. None keeps the reduced dimensions (moments sites; the local sum has the shape of a
    keep_dims moment) and flattens afterwards. `count`, the number of elements reduced per
    channel when x's static shape tells it, makes the count and its reciprocal constants.
    `work`: the dtype of the sums and the local mean (float64 for float64 data, which float32
    would round).
    """
    axes_const = b.const("axes", axes)
    xf = b.cast("x_float", x, dtype, work)
    keep_dims = broadcast is None
    local_sum = b.reduce_sum("local_sum", xf, axes_const, work, keep_dims)
    if count is None:
        n = b.count("count", x, axes_const, dtype, D)
        local_mean = b.binary("DivNoNan", "local_mean", local_sum, b.cast("count_float", n, D, work), work)
    else:
        n = b.const("count", [float(count)], np.float64)
        local_mean = b.binary("Mul", "local_mean", local_sum, b.const("reciprocal_count", 1.0 / max(count, 1), _NUMPY[work]), work)
    centre = local_mean if keep_dims else b.per_channel("local_mean_b", local_mean, broadcast, work)
    if keep_deviations:
        deviations = b.binary("Sub", "deviations", xf, centre, work)
        norm = b.reduce("EuclideanNorm", "deviations_norm", deviations, axes_const, work, keep_dims)
        m2 = b.unary("Square", "local_m2", norm, work)
    else:
        deviations, squared = "", b.binary("SquaredDifference", "squared", xf, centre, work)
        m2 = b.reduce_sum("local_m2", squared, axes_const, work, keep_dims)
    if keep_dims:
        flat = b.const("flat", [-1])
        local_mean, m2 = b.reshape("local_mean_flat", local_mean, flat, work), b.reshape("local_m2_flat", m2, flat, work)
    return Local(n, local_mean, b.cast("local_m2_64", m2, work, D)), local_sum, deviations


def global_moments(b: Builder, local: Local, key: Collective, total: int | None = None, work: int = F) -> Moments:
    """The global moments from every tower's `local` ones, by one all-reduce. `total`, the
    global count when every member's is static (see bnrewrite.passes.sites.static_counts), keeps
    the count out of the all-reduce and turns the divisions into products with constants.
    `work`: the dtype of `local.mean` and of the moments (float64 for float64 data)."""
    n, m64 = local.count, b.cast("local_mean64", local.mean, work, D)
    s = b.binary("Mul", "sum64", n, m64, D)
    ss = b.binary("AddV2", "sumsq64", local.m2, b.binary("Mul", "mean_sq64", s, m64, D), D)
    if total is not None:
        reduced = all_reduce(b, "all_reduce", b.concat("moments", [s, ss], D), D, key)
        scaled = b.binary("Mul", "global_means64", reduced, b.const("reciprocal_total64", 1.0 / total, np.float64), D)
        mean64, mean_sq64 = b.split_pairs("global", scaled, D)
        # E[x^2] - E[x]^2 in float64: at |mean|/std = 1000 it keeps ~1e-10 of the variance
        m2_raw = b.binary("Sub", "variance_raw64", mean_sq64, b.unary("Square", "mean_squared64", mean64, D), D)
        variance = b.cast("variance", b.binary("Maximum", "variance64", m2_raw, b.const("zero64", 0.0, np.float64), D), D, work)
        bessel = b.const("bessel", total / (total - 1.0), _NUMPY[work])
        return Moments(collective=reduced, count=b.const("total64", [float(total)], np.float64), mean=b.cast("mean", mean64, D, work),
                       variance=variance, variance_unbiased=b.binary("Mul", "variance_unbiased", variance, bessel, work))
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
