"""Quantiles from histogram buckets, exactly as Prometheus' ``histogram_quantile`` computes them.

The status page and ``kvwatch top`` show p50/p99 from kvwatch's own request histograms; using
Prometheus' rule (promql/quantile.go ``bucketQuantile``) means they read the same as a Grafana panel
over the same counts. The rule: rank = q x total; find the first bucket whose cumulative count
reaches the rank; interpolate linearly inside it, from the previous upper bound (0 for the first
bucket) to its own. A rank in the +Inf bucket returns the highest finite bound; a first bucket
with a bound <= 0 returns that bound. NaN when there are no observations; -Inf / +Inf for q < 0 /
q > 1, as in PromQL.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def histogram_quantile(q: float, bounds: Sequence[float], bins: Sequence[float]) -> float:
    """φ-quantile of a histogram given as ascending finite upper ``bounds`` and per-bucket ``bins``.

    ``bins`` are *non-cumulative* counts (``state.Histogram.bins``), one per bound plus the last one
    for +Inf, so ``len(bins) == len(bounds) + 1``.
    """
    if len(bins) != len(bounds) + 1:
        raise ValueError(f"need one bin per bound plus +Inf: {len(bounds)} bounds, {len(bins)} bins")
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    cumulative = []
    running = 0.0
    for count in bins:
        running += count
        cumulative.append(running)
    return bucket_quantile(q, [*bounds, math.inf], cumulative)


def bucket_quantile(q: float, upper_bounds: Sequence[float], cumulative: Sequence[float]) -> float:
    """Prometheus' bucketQuantile over cumulative counts; the last upper bound must be +Inf."""
    if len(upper_bounds) < 2 or not math.isinf(upper_bounds[-1]):
        return math.nan
    total = cumulative[-1]
    if total == 0:
        return math.nan
    rank = q * total
    last = len(upper_bounds) - 1
    b = next((i for i in range(last) if cumulative[i] >= rank), last)
    if b == last:
        return upper_bounds[last - 1]
    if b == 0 and upper_bounds[0] <= 0:
        return upper_bounds[0]
    start, end, count = 0.0, upper_bounds[b], cumulative[b]
    if b > 0:
        start = upper_bounds[b - 1]
        count -= cumulative[b - 1]
        rank -= cumulative[b - 1]
    if count == 0:  # q = 0 over an empty first bucket: Go's 0/0
        return math.nan
    return start + (end - start) * (rank / count)
