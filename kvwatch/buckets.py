"""Histogram bucket boundaries of kvwatch's request histograms.

Chosen so the thresholds SREs write SLOs against are exact boundaries (an SLO threshold must be a
bucket boundary, or the error ratio is an interpolation). ``kvwatch rules`` rejects a threshold that
is not in these lists. Upper bounds only; ``+Inf`` is implicit. Documented in docs/metrics.md.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Iterable
from typing import Self

# packed by hand: one bound per line would hide the shape of the table
# fmt: off
TTFT_SECONDS: tuple[float, ...] = (
    0.025, 0.05, 0.1, 0.2, 0.25, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 5.0, 7.5, 10.0, 15.0,
    20.0, 30.0, 60.0, 120.0, 300.0,
)

TPOT_SECONDS: tuple[float, ...] = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25,
    0.3, 0.5, 0.75, 1.0, 2.0,
)

INTER_CHUNK_SECONDS: tuple[float, ...] = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5,
    0.75, 1.0, 2.0, 5.0, 10.0, 30.0,
)

DURATION_SECONDS: tuple[float, ...] = (
    0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 240.0, 300.0, 450.0,
    600.0, 900.0, 1200.0, 1800.0, 2700.0, 3600.0,
)

QUEUE_SECONDS: tuple[float, ...] = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)

OUTPUT_TOKENS: tuple[float, ...] = (
    16, 64, 128, 256, 512, 1000, 2000, 3000, 5000, 7500, 10000, 15000, 20000, 32000, 64000, 128000,
)
# fmt: on


def output_token_bounds(band_edges: tuple[int, ...]) -> tuple[float, ...]:
    """Output-token buckets that always contain the configured band edges."""
    return tuple(sorted(set(OUTPUT_TOKENS) | {float(e) for e in band_edges}))


def le_label(bound: float) -> str:
    """Render an upper bound the way Prometheus 3 normalises ``le`` (``1`` -> ``1.0``)."""
    if bound == float("inf"):
        return "+Inf"
    return repr(float(bound))


@functools.cache
def le_labels(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The ``le`` label values of a bucket layout, ``+Inf`` last."""
    return (*(le_label(b) for b in bounds), "+Inf")


# ---- the vLLM plugin's exact per-request and per-step signals ----------------------------------

#: times a request was preempted; 0 is a bucket of its own ("never preempted")
PREEMPTIONS: tuple[float, ...] = (0, 1, 2, 3, 5, 10, 20, 50)

#: output tokens / max_tokens and cached / prompt tokens
RATIO: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)

#: engine step time
STEP_SECONDS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

#: scheduled tokens per step (context + generation): edges of the ``batch_tokens`` label
BATCH_TOKEN_EDGES: tuple[int, ...] = (16, 64, 256, 1000, 4000, 16000)

#: KV block lifetime, idle time before eviction and reuse gaps
# packed by hand: one bound per line would hide the shape of the table
# fmt: off
KV_BLOCK_SECONDS: tuple[float, ...] = (
    0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)
# fmt: on


class Histogram:
    """A histogram with fixed bounds: non-cumulative bins (the last is ``+Inf``), sum and count,
    cumulative when rendered. kvwatch's request histograms and the simulator's engine histograms."""

    __slots__ = ("bins", "bounds", "count", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.bins = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, weight: int = 1) -> None:
        """Record ``weight`` observations of ``value`` (``le`` is inclusive, as in Prometheus)."""
        self.bins[bisect.bisect_left(self.bounds, value)] += weight
        self.sum += value * weight
        self.count += weight

    def copy(self) -> Self:
        """An independent copy, for a reader that renders without holding the writer's lock."""
        out = type(self)(self.bounds)
        out.bins, out.sum, out.count = list(self.bins), self.sum, self.count
        return out

    def merge_bins(self, bounds: tuple[float, ...], counts: Iterable[int], total: float) -> None:
        """Fold a request's pre-binned gaps in; bounds must be this histogram's bounds."""
        if bounds != self.bounds:
            raise ValueError("gap bins were made with different bounds")
        n = 0
        for i, c in enumerate(counts):
            self.bins[i] += c
            n += c
        self.count += n
        self.sum += total

    def cumulative(self) -> list[tuple[str, float]]:
        return list(zip(le_labels(self.bounds), self.cumulative_counts(), strict=True))

    def cumulative_counts(self) -> list[float]:
        """Cumulative bucket counts, ``+Inf`` last (aligned with ``le_labels(bounds)``)."""
        return [float(c) for c in itertools.accumulate(self.bins)]
