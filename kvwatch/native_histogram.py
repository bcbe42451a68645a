"""Native (sparse exponential) histogram state, kept beside a classic histogram's fixed buckets.

Prometheus native histograms have buckets whose boundaries are powers of ``2 ** (2 ** -schema)``:
bucket ``i`` holds ``(base ** (i - 1), base ** i]``. kvwatch observes with the same arithmetic as
client_golang (``prometheus/histogram.go``: ``histogramCounts.observe``, ``makeBuckets``,
``doubleBucketWidth``), so what Prometheus stores is what a Go service would have sent:

- schema 3 (``SCHEMA``): 8 buckets per doubling, growth factor 2 ** (1/8) ~ 1.0905, so a quantile
  read from one bucket is off by at most 9.05 % of its value (``RELATIVE_ERROR``);
- zero bucket of width 2 ** -128 (client_golang's ``DefNativeHistogramZeroThreshold``): exact
  zeros (no preemption, a ratio of 0) land there;
- at most 160 populated buckets (``BUCKET_LIMIT``, what Mimir recommends and Prometheus's
  ``native_histogram_bucket_limit`` is usually set to): beyond that the resolution is halved (schema
  minus one, neighbouring buckets merged), as client_golang does when no reset or wider zero bucket
  is configured. A latency from 1 ms to 1 h spans 22 doublings: 176 buckets at schema 3, so a
  histogram that wide drops to schema 2 (error 18.9 %); kvwatch's per-band series stay far below.

Pure state and arithmetic, no I/O; the encoder in ``export/protobuf.py`` reads it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

SCHEMA = 3
MIN_SCHEMA = -4
BUCKET_LIMIT = 160
ZERO_THRESHOLD = 2.938735877055719e-39  # 2 ** -128
RELATIVE_ERROR = 2 ** (2.0**-SCHEMA) - 1

# client_golang's nativeHistogramBounds for the positive schemas kvwatch can be at: the lower
# boundaries of each bucket within one power of two, as fractions in [0.5, 1) of math.frexp
_FRACTION_BOUNDS: dict[int, tuple[float, ...]] = {
    1: (0.5, 0.7071067811865475),
    2: (0.5, 0.5946035575013605, 0.7071067811865475, 0.8408964152537144),
    3: (
        0.5,
        0.5452538663326288,
        0.5946035575013605,
        0.6484197773255048,
        0.7071067811865475,
        0.7711054127039704,
        0.8408964152537144,
        0.9170040432046711,
    ),
}


def bucket_index(value: float, schema: int) -> int:
    """The index of the bucket holding ``|value|`` (upper boundary inclusive), as client_golang finds it."""
    inf = math.isinf(value)
    frac, exp = math.frexp(math.fabs(value) if not inf else 1.7976931348623157e308)
    if schema > 0:
        bounds = _FRACTION_BOUNDS[schema]
        key = bisect.bisect_left(bounds, frac) + (exp - 1) * len(bounds)
    else:
        key = exp - 1 if frac == 0.5 else exp
        key = (key + (1 << -schema) - 1) >> -schema
    return key + 1 if inf else key


def upper_bound(index: int, schema: int) -> float:
    """The upper boundary of bucket ``index`` (``base ** index``), from the same table as Prometheus's
    ``getBound`` (model/histogram/generic.go), so it is the float the server compares against."""
    if schema <= 0:
        return math.ldexp(1.0, index << -schema)
    frac = _FRACTION_BOUNDS[schema][index & ((1 << schema) - 1)]
    return math.ldexp(frac, (index >> schema) + 1)


class NativeHistogram:
    """Sparse bucket counts by index for positive and negative values, plus the zero bucket."""

    __slots__ = ("bucket_limit", "negative", "positive", "schema", "zero_count", "zero_threshold")

    def __init__(
        self, schema: int = SCHEMA, bucket_limit: int = BUCKET_LIMIT, zero_threshold: float = ZERO_THRESHOLD
    ) -> None:
        self.schema = schema
        self.bucket_limit = bucket_limit
        self.zero_threshold = zero_threshold
        self.zero_count = 0
        self.positive: dict[int, int] = {}
        self.negative: dict[int, int] = {}

    def observe(self, value: float, weight: int = 1) -> None:
        """Count ``weight`` observations of ``value``; NaN is left out (client_golang counts it in the
        sample count only)."""
        if math.isnan(value):
            return
        if value > self.zero_threshold:
            side = self.positive
        elif value < -self.zero_threshold:
            side = self.negative
        else:
            self.zero_count += weight
            return
        key = bucket_index(value, self.schema)
        side[key] = side.get(key, 0) + weight
        while len(self.positive) + len(self.negative) > self.bucket_limit and self.schema > MIN_SCHEMA:
            self._halve_resolution()

    def _halve_resolution(self) -> None:
        """client_golang's ``doubleBucketWidth``: schema - 1, bucket ``k`` merged into ``ceil(k / 2)``
        (Go's ``(k + 1) / 2`` for k > 0, ``k / 2`` truncated toward zero otherwise)."""
        self.schema -= 1
        for name in ("positive", "negative"):
            merged: dict[int, int] = {}
            for key, count in getattr(self, name).items():
                wider = (key + 1) // 2 if key > 0 else -((-key) // 2)
                merged[wider] = merged.get(wider, 0) + count
            setattr(self, name, merged)

    def copy(self) -> NativeHistogram:
        out = NativeHistogram(self.schema, self.bucket_limit, self.zero_threshold)
        out.zero_count = self.zero_count
        out.positive = dict(self.positive)
        out.negative = dict(self.negative)
        return out


def merged(histograms: Iterable[NativeHistogram]) -> NativeHistogram:
    """The sum of native histograms (a node's replicas into one series): every one brought to the
    coarsest schema among them first, as Prometheus adds histograms of different schemas
    (``FloatHistogram.Add`` reduces to the smaller one); then held to the bucket limit again."""
    parts = list(histograms)
    if not parts:
        return NativeHistogram()
    out = NativeHistogram(min(h.schema for h in parts), parts[0].bucket_limit, parts[0].zero_threshold)
    for h in parts:
        part = h.copy()
        while part.schema > out.schema:
            part._halve_resolution()
        out.zero_count += part.zero_count
        for side, buckets in ((out.positive, part.positive), (out.negative, part.negative)):
            for key, count in buckets.items():
                side[key] = side.get(key, 0) + count
    while len(out.positive) + len(out.negative) > out.bucket_limit and out.schema > MIN_SCHEMA:
        out._halve_resolution()
    return out


def spans_and_deltas(buckets: dict[int, int]) -> tuple[list[tuple[int, int]], list[int]]:
    """client_golang's ``makeBuckets``: (offset, length) spans and count deltas of sparse buckets.

    The first span's offset is the first index; a later span's is the gap after the previous span.
    Gaps of one or two empty buckets are filled with zero counts instead of opening a new span.
    """
    spans: list[list[int]] = []
    deltas: list[int] = []
    previous = 0
    next_index = 0
    for n, index in enumerate(sorted(buckets)):
        gap = index - next_index
        if n == 0 or gap > 2:
            spans.append([gap, 0])
        else:
            for _ in range(gap):
                spans[-1][1] += 1
                deltas.append(-previous)
                previous = 0
        count = buckets[index]
        spans[-1][1] += 1
        deltas.append(count - previous)
        previous = count
        next_index = index + 1
    return [(offset, length) for offset, length in spans], deltas
