"""NodeState's request accounting: one fold per finished request, in-flight token estimates."""

from __future__ import annotations

import pytest

from kvwatch import buckets
from kvwatch.buckets import Histogram, le_labels
from kvwatch.model import InFlightRequest, LengthBands, Outcome, RequestRecord
from kvwatch.state import InFlightTracker, RequestStats


def record(**overrides) -> RequestRecord:
    fields = {
        "replica": "r0",
        "model_name": "m",
        "source": "proxy",
        "outcome": Outcome.COMPLETED,
        "started_at": 0.0,
        "output_tokens": 6000,
        "ttft_seconds": 0.5,
        "e2e_seconds": 60.5,
    }
    return RequestRecord(**(fields | overrides))


def test_a_request_lands_in_the_band_of_its_final_length_with_the_one_tpot_definition():
    stats = RequestStats(LengthBands())
    assert stats.observe(record()) == "5k-10k"
    hists, outcomes, _ = stats.snapshot()
    h = hists[("r0", "m", "5k-10k", "proxy")]
    assert h["kvwatch_request_tpot_seconds"].sum == pytest.approx(60.0 / 5999)
    assert h["kvwatch_request_ttft_seconds"].count == 1 and h["kvwatch_request_queue_seconds"].count == 0
    assert outcomes[("r0", "m", "5k-10k", "proxy", "completed")] == 1


def test_gap_bins_merge_once_and_must_share_the_bounds():
    stats = RequestStats(LengthBands())
    bounds = buckets.INTER_CHUNK_SECONDS
    counts = tuple([3] + [0] * (len(bounds) - 1) + [1])
    stats.observe(record(gap_bounds=bounds, gap_counts=counts, gap_sum=40.0))
    h = stats.snapshot()[0][("r0", "m", "5k-10k", "proxy")]["kvwatch_request_inter_chunk_seconds"]
    assert (h.count, h.sum, h.cumulative_counts()[0], h.cumulative_counts()[-1]) == (4, 40.0, 3.0, 4.0)
    with pytest.raises(ValueError, match="different bounds"):
        stats.observe(record(gap_bounds=(1.0,), gap_counts=(1, 0), gap_sum=0.5))


def test_unknown_length_and_estimated_counts_are_kept_apart():
    stats = RequestStats(LengthBands())
    assert stats.observe(record(output_tokens=None, outcome=Outcome.ERROR)) == "unknown"
    stats.observe(record(output_tokens=40, output_tokens_estimated=True))
    _, outcomes, estimated = stats.snapshot()
    assert outcomes[("r0", "m", "unknown", "proxy", "error")] == 1
    assert estimated == {("r0", "m", "0-1k", "proxy"): 1}


def test_histogram_cumulative_counts_follow_prometheus_le_semantics():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 2.0):
        h.observe(value)
    assert h.cumulative() == [("0.1", 2.0), ("1.0", 3.0), ("+Inf", 4.0)]  # le is "less or equal"
    assert le_labels((0.1, 1.0)) == ("0.1", "1.0", "+Inf")


def test_in_flight_tokens_scale_chunks_by_the_learned_tokens_per_chunk():
    tracker = InFlightTracker()
    handle = tracker.start(InFlightRequest("r0", "m", "5k-10k", 1000, 0, 0.0, 8000))
    tracker.progress(handle, 50)
    assert tracker.current()[0].generated_tokens == 50  # one token a chunk until told otherwise
    tracker.calibrate("r0", output_tokens=400, content_chunks=100)  # 4 tokens a chunk seen
    assert tracker.current()[0].generated_tokens == 200
    tracker.calibrate("r0", output_tokens=100, content_chunks=100)
    assert tracker.tokens_per_chunk("r0") == pytest.approx(0.8 * 4 + 0.2 * 1)
    tracker.calibrate("other", output_tokens=0, content_chunks=0)  # nothing learned from nothing
    assert tracker.tokens_per_chunk("other") == 1.0
    tracker.finish(handle)
    assert tracker.current() == []


def test_in_flight_prompts_scale_the_body_estimate_by_what_finished_requests_taught():
    tracker = InFlightTracker()

    def request(replica: str, estimate: int) -> int:
        return tracker.start(InFlightRequest(replica, "m", "0-1k", estimate, 0, 0.0))

    running = request("r0", 1000)
    assert tracker.current()[0].prompt_tokens_estimate == 1000  # body / 4 until told otherwise
    tracker.finish(request("r0", 200), prompt_tokens=300)  # its usage: 1.5x the estimate
    assert tracker.current()[0].prompt_tokens_estimate == 1500
    tracker.finish(request("r0", 200), prompt_tokens=None)  # no usage (aborted): nothing learned
    tracker.finish(request("r0", 100), prompt_tokens=50)
    assert tracker.current()[0].prompt_tokens_estimate == round(1000 * (0.8 * 1.5 + 0.2 * 0.5))
    # one body padded out of all proportion moves the scale by its clamped ratio's weight only
    tracker.finish(request("r0", 1_000_000), prompt_tokens=1)
    assert tracker.current()[0].prompt_tokens_estimate == pytest.approx(1000 * (0.8 * 1.3 + 0.2 / 16), abs=1)
    other = request("r1", 1000)  # a replica's scale is its own
    assert {r.replica: r.prompt_tokens_estimate for r in tracker.current()}["r1"] == 1000
    for handle in (running, other):
        tracker.finish(handle)
    assert tracker.current() == []
