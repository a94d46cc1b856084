"""Global batch moments from per-tower slices with one all-reduce; shared by fused and unfused sites.

Each tower reduces its slice to (n, n*m, M2 + n*m^2) per channel, where m and M2 are the
local mean and sum of squared deviations computed around m. One all-reduce in float64
sums them; mean = S/N and M2 = SS - S*mean. This is Chan's parallel combine
(M2 = sum M2_i + sum n_i (m_i - mean)^2) with the between-group term expanded: because each
M2_i is centred locally and the expansion runs in float64, the cancellation costs
(|mean|/std)^2 * 1e-16, far below float32 rounding even for |mean|/std = 1e4.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bnrewrite.collectives import Collective, all_reduce
from bnrewrite.nodes import DT_DOUBLE, DT_FLOAT, Builder

D, F = DT_DOUBLE, DT_FLOAT


@dataclass(frozen=True)
class Moments:
    """Tensors (float32 unless noted) of the global moments, flattened per channel."""

    collective: str
    count: str  # float64 scalar N
    mean: str
    variance: str  # biased: M2 / N
    variance_unbiased: str  # M2 / (N - 1)
    local_sum: str  # this tower's keep_dims sum of x: its shape is the shape of a keep_dims moment


def global_moments(b: Builder, x: str, dtype: int, axes: list[int], key: Collective) -> Moments:
    axes_const = b.const("axes", axes)
    xf = b.cast("x_float", x, dtype, F)
    n = b.count("count", x, axes_const, dtype, D)
    one = b.const("one", 1.0, np.float32)
    n_safe = b.binary("Maximum", "count_safe", b.cast("count_float", n, D, F), one, F)
    local_sum = b.reduce_sum("local_sum", xf, axes_const, F, True)
    local_mean = b.binary("RealDiv", "local_mean", local_sum, n_safe, F)
    centred = b.binary("Sub", "centred", xf, local_mean, F)
    m2 = b.reduce_sum("local_m2", b.unary("Square", "squared", centred, F), axes_const, F, True)
    flat = b.const("flat", [-1])
    m64 = b.cast("local_mean64", b.reshape("local_mean_flat", local_mean, flat, F), F, D)
    m2_64 = b.cast("local_m2_64", b.reshape("local_m2_flat", m2, flat, F), F, D)
    s = b.binary("Mul", "sum64", n, m64, D)
    ss = b.binary("AddV2", "sumsq64", m2_64, b.binary("Mul", "mean_sq64", s, m64, D), D)
    reduced = all_reduce(b, "all_reduce", b.concat("moments", [n, s, ss], D), D, key)

    total, (gsum, gsumsq) = b.split_count("global", reduced, D)
    one64 = b.const("one64", 1.0, np.float64)
    total_safe = b.binary("Maximum", "global_count_safe", total, one64, D)
    mean64 = b.binary("RealDiv", "mean64", gsum, total_safe, D)
    zero64 = b.const("zero64", 0.0, np.float64)
    m2g = b.binary("Maximum", "m2", b.binary("Sub", "m2_raw", gsumsq, b.binary("Mul", "sum_mean", gsum, mean64, D), D), zero64, D)
    bessel = b.binary("Maximum", "bessel_count", b.binary("Sub", "count_minus_one", total, one64, D), one64, D)
    return Moments(
        collective=reduced,
        count=total,
        mean=b.cast("mean", mean64, D, F),
        variance=b.cast("variance", b.binary("RealDiv", "variance64", m2g, total_safe, D), D, F),
        variance_unbiased=b.cast("variance_unbiased", b.binary("RealDiv", "variance_unbiased64", m2g, bessel, D), D, F),
        local_sum=local_sum,
    )

