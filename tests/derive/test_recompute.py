"""Preemption rate, recomputed tokens (engine vs estimate) and preemption stalls by band."""

import pytest

from kvwatch.derive.recompute import (
    ENGINE,
    ESTIMATE,
    PreemptionWindow,
    RecomputeEstimate,
    accumulate_recompute,
    gap_overlaps_preemption,
    preemption_rate,
    preemption_windows,
    recomputed_tokens,
    remember_preemptions,
    request_stalled,
)
from kvwatch.model import Outcome, RequestRecord

from .factories import sglang, vllm


@pytest.mark.parametrize(
    ("before", "now", "rate"),
    [
        (10.0, 30.0, 2.0),
        (10.0, 10.0, 0.0),
        (100.0, 5.0, 0.5),  # restart: 5 since
        (None, 5.0, None),
    ],
)
def test_preemption_rate_from_counter_deltas(before, now, rate):
    assert (
        preemption_rate(
            vllm(scraped_at=20.0, preemptions_total=now), vllm(scraped_at=10.0, preemptions_total=before)
        )
        == rate
    )


def test_preemption_rate_needs_a_previous_sample():
    assert preemption_rate(vllm(preemptions_total=3.0), None) is None


def run(steps, state=None):
    """Fold (preemptions_total, tokens_per_running) readings into the estimator."""
    state = state or RecomputeEstimate()
    seen = []
    for preemptions, per_request in steps:
        state = accumulate_recompute(state, preemptions, per_request)
        seen.append(state.tokens)
    return state, seen


def test_estimate_is_preemptions_times_mean_tokens_per_running_request():
    _, seen = run([(0.0, 500.0), (2.0, 500.0), (3.0, 1000.0)])
    assert seen == [0.0, 1000.0, 2000.0]  # first reading is the baseline


def test_estimate_starts_from_the_counter_as_first_seen():
    _, seen = run([(40.0, 100.0), (41.0, 100.0)])
    assert seen == [0.0, 100.0]


def test_estimate_never_decreases_across_an_engine_restart():
    _, seen = run([(0.0, 100.0), (10.0, 100.0), (2.0, 100.0), (2.0, 100.0)])
    assert seen == [0.0, 1000.0, 1200.0, 1200.0]
    assert seen == sorted(seen)


def test_unknown_tokens_per_request_falls_back_to_the_last_known():
    _, seen = run([(0.0, 300.0), (1.0, None)])  # the preempted request left the batch empty
    assert seen == [0.0, 300.0]


def test_missing_counter_keeps_the_estimate_and_baseline():
    state, seen = run([(0.0, 100.0), (None, 100.0), (1.0, 100.0)])
    assert seen == [0.0, 0.0, 100.0]
    assert state.preemptions_seen == 1.0


def test_engine_counter_wins_over_the_estimate():
    estimate, _ = run([(0.0, 100.0), (5.0, 100.0)])
    assert recomputed_tokens(sglang(recomputed_tokens_total=1234.0), estimate) == (1234.0, ENGINE)
    assert recomputed_tokens(vllm(), estimate) == (500.0, ESTIMATE)


def test_no_estimate_before_the_counter_was_seen():
    assert recomputed_tokens(vllm(), None) == (None, ESTIMATE)
    assert recomputed_tokens(vllm(), RecomputeEstimate()) == (None, ESTIMATE)


def test_preemption_windows_are_intervals_where_the_counter_rose():
    readings = [(0, 0), (5, 0), (10, 2), (15, 2), (20, 1)]
    samples = [vllm(scraped_at=t, preemptions_total=p) for t, p in readings]
    assert preemption_windows(samples) == [PreemptionWindow(5, 10), PreemptionWindow(15, 20)]


@pytest.mark.parametrize(
    ("gap_s", "ended_at", "stalled"),
    [
        (3.0, 8.0, True),  # gap 5..8 overlaps window 5..10
        (3.0, 4.0, False),  # gap 1..4 ends before the window
        (0.5, 8.0, False),  # overlaps but shorter than the threshold
        (20.0, 30.0, True),  # gap 10..30 spans the second window 15..20
    ],
)
def test_stall_is_a_long_gap_overlapping_a_preemption(gap_s, ended_at, stalled):
    windows = [PreemptionWindow(5.0, 10.0), PreemptionWindow(15.0, 20.0)]
    assert gap_overlaps_preemption(gap_s, ended_at, windows, threshold_s=1.0) is stalled


W = PreemptionWindow


@pytest.mark.parametrize(
    ("kept", "previous", "current", "expected"),
    [
        ((), None, (10, 3), ()),  # first sample of the unit: nothing to compare
        ((), (5, 0), (10, 0), ()),  # no preemption in the interval
        ((), (5, 0), (10, 2), (W(5, 10),)),
        ((W(5, 10),), (10, 2), (15, 4), (W(5, 15),)),  # contiguous: one episode, extended
        ((W(5, 10),), (15, 2), (20, 3), (W(5, 10), W(15, 20))),  # a quiet interval in between
        ((W(0, 5), W(10, 15)), (20, 0), (25, 0), (W(10, 15),)),  # ended before keep_since (6): dropped
        ((), (10, 5), (10, 9), ()),  # the same scrape again (a GPU poll re-derives): no window
        ((), (5, 9), (10, 2), (W(5, 10),)),  # the engine restarted and preempted since
    ],
)
def test_remember_preemptions(kept, previous, current, expected):
    def sample(reading):
        return vllm(scraped_at=reading[0], preemptions_total=reading[1])

    before = None if previous is None else sample(previous)
    assert remember_preemptions(kept, before, sample(current), keep_since=6.0, max_windows=8) == expected


def test_remember_preemptions_keeps_the_newest_windows():
    kept = tuple(W(t, t + 1) for t in range(0, 20, 2))
    found = remember_preemptions(
        kept,
        vllm(scraped_at=30, preemptions_total=0),
        vllm(scraped_at=35, preemptions_total=1),
        keep_since=0.0,
        max_windows=3,
    )
    assert found == (W(16, 17), W(18, 19), W(30, 35))


def _record(max_gap: float | None, ended_at: float | None) -> RequestRecord:
    return RequestRecord(
        "r0",
        "m",
        "proxy",
        Outcome.COMPLETED,
        started_at=0.0,
        output_tokens=8000,
        max_gap_seconds=max_gap,
        max_gap_ended_at=ended_at,
    )


@pytest.mark.parametrize(
    ("max_gap", "ended_at", "stalled"),
    [
        (3.0, 8.0, True),  # gap 5..8 overlaps the window 5..10
        (3.0, 4.0, False),  # gap 1..4 ended before the window
        (1.0, 8.0, False),  # not longer than the 1 s threshold
        (1.5, 10.5, True),  # gap 9..10.5 overlaps the window's end
        (2.0, 17.0, False),  # gap 15..17 is after the window
        (None, None, None),  # the source did not measure gaps (OTLP, SGLang files, non-streaming)
        (3.0, None, None),
    ],
)
def test_request_stalled(max_gap, ended_at, stalled):
    assert request_stalled(_record(max_gap, ended_at), [W(5.0, 10.0)]) is stalled


def test_request_without_preemption_windows_is_not_stalled():
    assert request_stalled(_record(30.0, 100.0), []) is False
