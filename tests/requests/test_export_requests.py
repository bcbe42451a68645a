"""The request exposition: histograms by length band, outcome counters from zero, in-flight gauges."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch import buckets
from kvwatch.config import Config, MetricsConfig, ReplicaConfig
from kvwatch.export.requests import RequestCollector
from kvwatch.model import DEFAULT_BANDS, OUTCOMES, InFlightRequest, Outcome, RequestRecord
from kvwatch.state import NodeState
from tests.configs import proxied_replica
from tests.local import require_tool

#: the full profile: every request series per replica (the lean default folds some per node:
#: tests/export/test_profiles.py)
CONFIG = Config(
    replicas=(
        proxied_replica("r0", 1, model_name="tiny"),
        ReplicaConfig("r1", "http://127.0.0.1:2/metrics"),
    ),
    metrics=MetricsConfig("full"),
)


def record(output: int | None, outcome: Outcome = Outcome.COMPLETED, **kw: object) -> RequestRecord:
    base = {
        "replica": "r0",
        "model_name": "tiny",
        "source": "proxy",
        "outcome": outcome,
        "started_at": 0.0,
        "output_tokens": output,
        "ttft_seconds": 0.4,
        "e2e_seconds": 10.4,
    }
    return RequestRecord(**{**base, **kw})  # type: ignore[arg-type]


def scrape(state: NodeState, profile: str = "full") -> dict[str, list]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RequestCollector(state, dataclasses.replace(CONFIG, metrics=MetricsConfig(profile))))
    text = generate_latest(registry).decode()
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    families["_text"] = text  # type: ignore[assignment]
    return families


def value(samples: list, name: str, **labels: str) -> float:
    found = [
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_latency_is_bucketed_by_the_final_output_length_band() -> None:
    state = NodeState("n", DEFAULT_BANDS)
    state.requests.observe(record(900))
    state.requests.observe(record(7000, ttft_seconds=2.2))
    state.requests.observe(record(7001, ttft_seconds=0.3))
    ttft = scrape(state)["kvwatch_request_ttft_seconds"]
    common = {"replica": "r0", "model_name": "tiny", "source": "proxy"}
    assert value(ttft, "kvwatch_request_ttft_seconds_count", length_band="0-1k", **common) == 1
    assert value(ttft, "kvwatch_request_ttft_seconds_count", length_band="5k-10k", **common) == 2
    assert value(ttft, "kvwatch_request_ttft_seconds_bucket", length_band="5k-10k", le="0.5", **common) == 1
    assert value(ttft, "kvwatch_request_ttft_seconds_bucket", length_band="5k-10k", le="2.5", **common) == 2
    tpot = scrape(state)["kvwatch_request_tpot_seconds"]
    assert value(tpot, "kvwatch_request_tpot_seconds_sum", length_band="0-1k", **common) == pytest.approx(
        10 / 899
    )


def test_every_outcome_and_band_starts_at_zero_for_known_sources() -> None:
    state = NodeState("n", DEFAULT_BANDS)
    state.requests.observe(record(12, Outcome.TRUNCATED, replica="r1", model_name="other", source="otlp"))
    samples = scrape(state)["kvwatch_requests"]
    for replica, model, source in (("r0", "tiny", "proxy"), ("r1", "other", "otlp")):
        series = [
            s
            for s in samples
            if (s.labels["replica"], s.labels["model_name"], s.labels["source"]) == (replica, model, source)
        ]
        assert len(series) == len(OUTCOMES) * len(DEFAULT_BANDS.all_names)
    assert (
        value(samples, "kvwatch_requests_total", replica="r1", length_band="0-1k", outcome="truncated") == 1
    )
    assert value(samples, "kvwatch_requests_total", replica="r0", length_band="20k+", outcome="error") == 0


def test_estimated_outputs_are_counted() -> None:
    state = NodeState("n", DEFAULT_BANDS)
    state.requests.observe(record(30, output_tokens_estimated=True))
    samples = scrape(state)["kvwatch_request_output_tokens_estimated"]
    assert value(samples, "kvwatch_request_output_tokens_estimated_total", length_band="0-1k") == 1


@pytest.mark.parametrize(("profile", "replica"), [("full", "r0"), ("lean", "")])
def test_proxy_only_counters_start_at_zero_for_every_band_of_a_proxy_replica(
    profile: str, replica: str
) -> None:
    """Before the first estimated output or stall, a dashboard's rate() over them reads 0, not "no
    data" (the demo's latency dashboard once showed no data for a whole CI run). Lean: one series
    per node (empty replica)."""
    samples = scrape(NodeState("n", DEFAULT_BANDS), profile)
    for name in ("kvwatch_request_output_tokens_estimated", "kvwatch_request_preemption_stalls"):
        series = {
            (s.labels["replica"], s.labels["source"], s.labels["length_band"]): s.value
            for s in samples[name]
            if s.name.endswith("_total")
        }
        assert series == {(replica, "proxy", band): 0.0 for band in DEFAULT_BANDS.all_names}, name


def test_in_flight_by_admission_band() -> None:
    state = NodeState("n", DEFAULT_BANDS)
    handle = state.in_flight.start(InFlightRequest("r0", "tiny", "1k-5k", 100, 0, 0.0, 4096))
    state.in_flight.progress(handle, 250)
    state.in_flight.start(InFlightRequest("r0", "tiny", "1k-5k", 50, 0, 0.0, 2048))
    families = scrape(state)
    inflight, tokens = families["kvwatch_requests_in_flight"], families["kvwatch_in_flight_tokens"]
    assert value(inflight, "kvwatch_requests_in_flight", admission_band="1k-5k") == 2
    assert value(tokens, "kvwatch_in_flight_tokens", admission_band="1k-5k") == 400
    assert value(inflight, "kvwatch_requests_in_flight", admission_band="20k+") == 0
    state.in_flight.finish(handle)
    assert (
        value(
            scrape(state)["kvwatch_requests_in_flight"], "kvwatch_requests_in_flight", admission_band="1k-5k"
        )
        == 1
    )


def test_inter_chunk_gaps_are_merged_from_pre_binned_counts() -> None:
    state = NodeState("n", DEFAULT_BANDS)
    bins = [0] * (len(buckets.INTER_CHUNK_SECONDS) + 1)
    bins[buckets.INTER_CHUNK_SECONDS.index(0.05)] = 3
    bins[-1] = 1
    state.requests.observe(
        record(5, gap_bounds=buckets.INTER_CHUNK_SECONDS, gap_counts=tuple(bins), gap_sum=31.0)
    )
    samples = scrape(state)["kvwatch_request_inter_chunk_seconds"]
    assert value(samples, "kvwatch_request_inter_chunk_seconds_bucket", le="0.05") == 3
    assert value(samples, "kvwatch_request_inter_chunk_seconds_bucket", le="30.0") == 3
    assert value(samples, "kvwatch_request_inter_chunk_seconds_count") == 4


@pytest.mark.parametrize(
    ("bounds", "slo_thresholds"),
    [
        (buckets.TTFT_SECONDS, (0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)),
        (buckets.TPOT_SECONDS, (0.01, 0.02, 0.025, 0.05, 0.1)),
        (buckets.INTER_CHUNK_SECONDS, (0.025, 0.05, 0.1, 0.2, 0.5, 1.0)),
        (buckets.DURATION_SECONDS, (10.0, 30.0, 60.0, 300.0, 600.0)),
    ],
)
def test_common_slo_thresholds_are_bucket_boundaries(bounds: tuple, slo_thresholds: tuple) -> None:
    assert set(slo_thresholds) <= set(bounds)


@pytest.mark.prometheus
def test_promtool_accepts_the_exposition(tmp_path) -> None:
    promtool = require_tool("promtool")
    state = NodeState("n", DEFAULT_BANDS)
    state.requests.observe(record(900))
    state.requests.observe(record(None, Outcome.ERROR, ttft_seconds=None))
    state.in_flight.start(InFlightRequest("r0", "tiny", "unknown", 10, 0, 0.0))
    text = scrape(state)["_text"]
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
