"""NodeState's request accounting: one fold per finished request, in-flight token estimates."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch import buckets
from kvwatch.buckets import Histogram, le_labels
from kvwatch.config import Config, MetricsConfig, ReplicaConfig
from kvwatch.export.encode import TextEncoder
from kvwatch.model import (
    EngineStep,
    InFlightRequest,
    LengthBands,
    Outcome,
    PluginLink,
    RequestRecord,
)
from kvwatch.state import InFlightTracker, NodeState, RequestStats
from tests.export.node import registry_for


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
    # weighted by size, as the sums of tokens and chunks: (0.8 x 80 + 0.2 x 100) / (0.8 x 20 + 0.2 x 100)
    assert tracker.tokens_per_chunk("r0") == pytest.approx(84 / 36)
    tracker.calibrate("r1", output_tokens=50, content_chunks=100)  # more chunks than tokens
    assert tracker.tokens_per_chunk("r1") == 1.0  # a content chunk carries a token at least
    tracker.calibrate("other", output_tokens=0, content_chunks=0)  # nothing learned from nothing
    assert tracker.tokens_per_chunk("other") == 1.0
    tracker.finish(handle)
    assert tracker.current() == []


def test_in_flight_prompts_scale_the_body_estimate_by_what_finished_requests_taught():
    tracker = InFlightTracker()

    def request(replica: str, estimate: int) -> int:
        return tracker.start(InFlightRequest(replica, "m", "0-1k", estimate, 0, 0.0))

    def prompt_now(replica: str = "r0") -> int:
        return {r.replica: r.prompt_tokens_estimate for r in tracker.current()}[replica]

    running = request("r0", 1000)
    assert prompt_now() == 1000  # body / 4 until told otherwise
    tracker.finish(request("r0", 200), prompt_tokens=300)  # its usage: 1.5x the estimate
    assert prompt_now() == 1500
    tracker.finish(request("r0", 200), prompt_tokens=None)  # no usage (aborted): nothing learned
    assert prompt_now() == 1500
    # token-weighted: a short prompt whose body was mostly overhead moves the scale by its size
    tracker.finish(request("r0", 20), prompt_tokens=4)
    exact, estimated = 0.8 * 0.2 * 300 + 0.2 * 4, 0.8 * 0.2 * 200 + 0.2 * 20
    assert prompt_now() == round(1000 * exact / estimated)  # 1.35x, where a mean of ratios says 1.24x
    # a body padded out of all proportion counts as if its estimate were 16 x its prompt
    tracker.finish(request("r0", 1_000_000), prompt_tokens=10)
    exact, estimated = 0.8 * exact + 0.2 * 10, 0.8 * estimated + 0.2 * 160
    assert prompt_now() == round(1000 * exact / estimated)
    other = request("r1", 1000)  # a replica's scale is its own
    assert prompt_now("r1") == 1000
    for handle in (running, other):
        tracker.finish(handle)
    assert tracker.current() == []


def _feed(state: NodeState, replica: str) -> None:
    """What a vLLM plugin datagram and a proxied request leave in ``state``, through the calls the
    sources make (records into the sink, the datagram count, the step, the in-flight scale)."""
    state.count("kvwatch_vllm_plugin_datagrams", replica, "accepted")
    state.count("kvwatch_request_values_dropped", replica, "vllm_plugin", "out_of_range")
    state.plugin.observe(
        PluginLink(replica, "0", 7, 1, 0, 0),
        EngineStep(replica, "0", 1.0, ctx_tokens=900, gen_tokens=64, elapsed_ms=5.0, preempted=1),
    )
    engine_side = {"queue_seconds": 0.1, "prefill_seconds": 0.2, "decode_seconds": 60.0, "preemptions": 1}
    prompt = {"prompt_tokens": 1000, "cached_prompt_tokens": 500, "max_tokens": 8000}
    state.requests.observe(record(replica=replica, source="vllm_plugin", **engine_side, **prompt))
    state.requests.observe(
        record(replica=replica, output_tokens_estimated=True, max_tokens=8000), stalled=True
    )
    state.in_flight.calibrate(replica, output_tokens=400, content_chunks=100)


def _series(state: NodeState, config: Config) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = TextEncoder().encode(registry_for(state, config)).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _of(series: dict[tuple[str, tuple[tuple[str, str], ...]], float], replica: str) -> dict:
    return {key: v for key, v in series.items() if dict(key[1]).get("replica") == replica}


@pytest.mark.parametrize("profile", ["lean", "full"])
def test_a_dropped_replica_leaves_the_exposition_and_the_kept_one_keeps_its_counts(profile: str):
    kept, gone = (ReplicaConfig(name, f"http://127.0.0.1:9/{name}", model_name="m") for name in "ab")
    before = Config(replicas=(kept, gone), node="node-a", metrics=MetricsConfig(profile))
    state = NodeState("node-a", before.length_bands)
    for replica in ("a", "b"):
        _feed(state, replica)
    state.count("kvwatch_otlp_spans", "b")  # a family without a replica label, a value that reads "b"
    shown = _series(state, before)
    names = {name for name, _ in _of(shown, "b")}
    assert {"kvwatch_requests_total", "kvwatch_vllm_plugin_datagrams_total"} <= names, names

    state.drop_target("b")
    after = _series(state, dataclasses.replace(before, replicas=(kept,)))
    assert _of(after, "b") == {}
    assert _of(after, "a") == _of(shown, "a")
    assert state.counters_for("kvwatch_otlp_spans") == [(("b",), 1)]
    assert state.in_flight.tokens_per_chunk("b") == 1.0 and state.in_flight.tokens_per_chunk("a") == 4.0


def test_a_forgotten_replica_s_counts_stay_in_the_node_s_sum():
    stats = RequestStats(LengthBands())

    def node_sums(*parts: RequestStats) -> Counter[tuple[str, ...]]:
        out: Counter[tuple[str, ...]] = Counter()
        for part in parts:
            hists, outcomes, estimated = part.snapshot()
            for key, families in hists.items():
                for name, h in families.items():
                    out[(name, *key[1:])] += h.count
            for counts in (outcomes, estimated, part.stall_counts(), part.unused_limit_counts()):
                for key, n in counts.items():
                    out[key[1:]] += n
        return out

    for replica in ("a", "b", "c"):
        stats.observe(record(replica=replica, max_tokens=8000), stalled=False)
        stats.observe(record(replica=replica, output_tokens=40, output_tokens_estimated=True))
    node = node_sums(stats)
    stats.forget("b")
    stats.forget("c")
    stats.forget("nobody")
    assert {key[0] for key in stats.snapshot()[0]} == {"a"}
    assert {key[0] for key in stats.forgotten().snapshot()[0]} == {""}
    assert node_sums(stats, stats.forgotten()) == node  # a sum over the node does not go down
    hists = stats.forgotten().snapshot()[0][("", "m", "5k-10k", "proxy")]
    assert hists["kvwatch_request_ttft_seconds"].count == 2
    assert stats.forgotten().stall_counts() == {("", "m", "5k-10k", "proxy"): 0}  # at 0: present


def test_a_replica_dropped_and_added_again_counts_from_zero():
    state = NodeState("node-a", LengthBands())
    _feed(state, "a")
    state.drop_target("a")
    state.requests.observe(record(replica="a"))
    state.count("kvwatch_vllm_plugin_datagrams", "a", "accepted")
    assert state.requests.snapshot()[1] == {("a", "m", "5k-10k", "proxy", "completed"): 1}
    assert state.counters_for("kvwatch_vllm_plugin_datagrams") == [(("a", "accepted"), 1)]
    assert state.plugin.snapshot() == {}


def test_lean_sums_over_the_node_do_not_go_down_when_a_replica_leaves():
    # each lean per-node series is a counter summed over the replicas: a replica's rows leaving the
    # sum would read as a counter reset, and rate() would count the node's whole total again
    kept, gone = (ReplicaConfig(name, f"http://127.0.0.1:9/{name}", model_name="m") for name in "ab")
    before = Config(replicas=(kept, gone), node="node-a", metrics=MetricsConfig("lean"))
    state = NodeState("node-a", before.length_bands)
    for replica in ("a", "b"):
        _feed(state, replica)
    node_wide = {key: v for key, v in _series(state, before).items() if dict(key[1]).get("replica") == ""}
    assert any(name.startswith("kvwatch_request_ttft_seconds") for name, _ in node_wide), node_wide
    state.drop_target("b")
    after = _series(state, dataclasses.replace(before, replicas=(kept,)))
    assert {key: after.get(key) for key in node_wide} == node_wide
