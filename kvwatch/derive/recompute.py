"""Preemption rate, recomputed tokens, and which length bands preemption stalls.

A preempted request loses its KV and is recomputed when it resumes (vLLM V1 always recomputes;
SGLang "retracts"). Recomputed tokens are taken from the engine where it counts them
(``ReplicaSample.recomputed_tokens_total``: SGLang's retracted input + output tokens, an upper bound
as part may be re-hit in the radix cache). Elsewhere they are estimated as
``increase(preemptions) x mean tokens held per running request`` and named ``estimate``.

The estimate is a counter kvwatch keeps: ``accumulate_recompute`` folds one sample into the previous
estimator state and returns the next one (the caller holds the state; nothing is mutated). It never
decreases: an engine restart (the preemption counter went down) adds what was counted since.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvwatch.derive import counters
from kvwatch.model import ReplicaSample, RequestRecord

ENGINE = "engine"
ESTIMATE = "estimate"
#: a gap longer than this that overlaps a preemption window is a stall (docs/kv-signals.md)
STALL_THRESHOLD_S = 1.0


def is_preempting(current: ReplicaSample, previous: ReplicaSample | None) -> bool:
    """The preemption counter rose since ``previous`` (a restart counts what was counted since)."""
    if previous is None:
        return False
    rise = counters.increase(previous.preemptions_total, current.preemptions_total)
    return rise is not None and rise > 0


def preemption_rate(current: ReplicaSample, previous: ReplicaSample | None) -> float | None:
    """Preemptions per second between two samples of one unit (restart-aware)."""
    if previous is None:
        return None
    return counters.per_second(
        previous.preemptions_total, current.preemptions_total, current.scraped_at - previous.scraped_at
    )


@dataclass(frozen=True, slots=True)
class RecomputeEstimate:
    """Estimator state for one unit. ``tokens`` is the estimate counter (monotonically non-decreasing)."""

    tokens: float = 0.0
    preemptions_seen: float | None = None  # the engine counter at the last update
    tokens_per_running: float | None = None  # last known mean tokens per running request


def accumulate_recompute(
    state: RecomputeEstimate, preemptions_total: float | None, tokens_per_running: float | None
) -> RecomputeEstimate:
    """Next estimator state after one sample.

    ``tokens_per_running`` is the mean tokens a running request holds at this sample (live tokens,
    else allocated tokens, / running); when unknown (nothing running: the preempted requests went
    back to the queue) the last known value is used. The first sample only sets the baseline.
    """
    per_request = tokens_per_running if tokens_per_running is not None else state.tokens_per_running
    rise = counters.increase(state.preemptions_seen, preemptions_total)
    tokens = state.tokens
    if rise and per_request is not None:
        tokens += rise * per_request
    seen = preemptions_total if preemptions_total is not None else state.preemptions_seen
    return RecomputeEstimate(tokens, seen, per_request)


def recomputed_tokens(sample: ReplicaSample, estimate: RecomputeEstimate | None) -> tuple[float | None, str]:
    """The value to export and its source: the engine's counter, else the estimate."""
    if sample.recomputed_tokens_total is not None:
        return sample.recomputed_tokens_total, ENGINE
    if estimate is None or estimate.preemptions_seen is None:
        return None, ESTIMATE
    return estimate.tokens, ESTIMATE


# --------------------------------------------------------------------------------------------
# stalls: which requests preemption slowed
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PreemptionWindow:
    """An interval between two samples of a replica in which its preemption counter rose."""

    start: float
    end: float


def preemption_windows(samples: Sequence[ReplicaSample]) -> list[PreemptionWindow]:
    """Intervals between consecutive samples (time order) of one unit where preemptions rose."""
    out = []
    for before, after in itertools.pairwise(samples):
        rise = counters.increase(before.preemptions_total, after.preemptions_total)
        if rise:
            out.append(PreemptionWindow(before.scraped_at, after.scraped_at))
    return out


def remember_preemptions(
    kept: Sequence[PreemptionWindow],
    previous: ReplicaSample | None,
    current: ReplicaSample,
    keep_since: float,
    max_windows: int,
) -> tuple[PreemptionWindow, ...]:
    """``kept`` plus the window between two consecutive samples of a unit if preemptions rose in it.

    A window that starts where the last one ended extends it (one window per preemption episode);
    windows that ended before ``keep_since`` are dropped, and at most ``max_windows`` are kept.
    """
    out = [w for w in kept if w.end >= keep_since]
    if previous is not None and previous.scraped_at < current.scraped_at:
        for window in preemption_windows((previous, current)):
            if out and out[-1].end == window.start:
                out[-1] = PreemptionWindow(out[-1].start, window.end)
            else:
                out.append(window)
    return tuple(out[-max_windows:])


def gap_overlaps_preemption(
    gap_seconds: float, gap_ended_at: float, windows: Iterable[PreemptionWindow], threshold_s: float
) -> bool:
    """A gap longer than ``threshold_s`` that overlaps one of the preemption windows."""
    if gap_seconds <= threshold_s:
        return False
    start = gap_ended_at - gap_seconds
    return any(start < w.end and gap_ended_at > w.start for w in windows)


def request_stalled(
    record: RequestRecord, windows: Iterable[PreemptionWindow], threshold_s: float = STALL_THRESHOLD_S
) -> bool | None:
    """Whether a finished request's longest gap was a stall; None when its source did not measure it.

    ``windows`` are those of the request's replica (every DP rank: the proxy cannot tell which one
    served it), in the same time base as ``RequestRecord.max_gap_ended_at``.
    """
    if record.max_gap_seconds is None or record.max_gap_ended_at is None:
        return None
    return gap_overlaps_preemption(record.max_gap_seconds, record.max_gap_ended_at, windows, threshold_s)
