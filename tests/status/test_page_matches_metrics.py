"""The status page and /metrics show the same numbers for the same state: both read the one derived
view (``NodeState.derived``), the same samples and the same request stats, so a number cannot
differ between the two."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.export.collector import NodeCollector
from kvwatch.export.derived import DerivedCollector
from kvwatch.export.encode import TextEncoder
from kvwatch.export.gpus import GpuCollector
from kvwatch.export.replicas import ReplicaCollector
from kvwatch.export.requests import RequestCollector
from kvwatch.export.server import make_registry
from kvwatch.model import Outcome
from kvwatch.status.view import ALL, build_view

from .node import T0, populated_state, records


def _metrics(state, cfg) -> dict[str, list[tuple[dict[str, str], float]]]:  # type: ignore[no-untyped-def]
    areas = {
        "replicas": ReplicaCollector(state, cfg),
        "derived": DerivedCollector(state, cfg),
        "gpus": GpuCollector(state, cfg),
        "requests": RequestCollector(state, cfg),
    }
    text = TextEncoder().encode(make_registry(NodeCollector(state, cfg, areas))).decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name].append((sample.labels, sample.value))
    return out


def _maybe(metrics, name: str, **labels: str) -> float | None:  # type: ignore[no-untyped-def]
    """The one exported value with these labels, None when the family has no such series."""
    found = [v for have, v in metrics[name] if all(have.get(k) == v2 for k, v2 in labels.items())]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def _one(metrics, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    value = _maybe(metrics, name, **labels)
    assert value is not None, (name, labels)
    return value


def test_replica_units_show_what_metrics_exports() -> None:
    state, cfg = populated_state(step=1)
    view, metrics = build_view(state, cfg, T0 + 11), _metrics(state, cfg)
    checked = 0
    for replica in view.replicas:
        for unit in replica.units:
            key = {"replica": replica.name, "dp_rank": unit.dp_rank or ""}
            assert unit.kv_usage_ratio == _one(metrics, "kvwatch_kv_usage_ratio", **key)
            assert unit.kv_free_tokens == _one(metrics, "kvwatch_kv_free_tokens", **key)
            assert unit.requests_running == _one(metrics, "kvwatch_requests_running", **key)
            assert unit.requests_waiting == _one(metrics, "kvwatch_requests_waiting", **key)
            assert unit.preemptions_total == _one(metrics, "kvwatch_preemptions_total", **key)
            assert unit.live_tokens == _maybe(metrics, "kvwatch_kv_live_tokens", **key)
            assert unit.fragmentation_ratio == _maybe(metrics, "kvwatch_kv_fragmentation_ratio", **key)
            assert unit.headroom_seconds == _maybe(metrics, "kvwatch_kv_headroom_seconds", **key)
            checked += unit.live_tokens is not None and unit.headroom_seconds is not None
    assert checked >= 1  # r0 (behind the proxy) has live tokens and headroom on both
    assert not [v for labels, v in metrics["kvwatch_kv_usage_ratio"] if labels["replica"] == "s0"]
    for stranded in view.stranded:
        assert stranded.stranded_tokens == _one(
            metrics, "kvwatch_kv_stranded_tokens", model_name=stranded.model_name
        )


def test_gpus_show_what_metrics_exports() -> None:
    state, cfg = populated_state()
    view, metrics = build_view(state, cfg, T0 + 11), _metrics(state, cfg)
    assert len(view.gpus) == 2
    for gpu in view.gpus:
        key = {"gpu": str(gpu.index), "uuid": gpu.uuid}
        assert gpu.memory_used_bytes == _one(metrics, "kvwatch_gpu_memory_used_bytes", **key)
        link = _one(metrics, "kvwatch_gpu_pcie_link_max_bytes_per_second", **key)
        assert gpu.pcie_link_bytes_per_second == link
        # the PCIe rate is the increase of the exported counter over the derived window (10 s here)
        assert gpu.pcie_tx_bytes_per_second == pytest.approx(
            (
                _one(metrics, "kvwatch_gpu_pcie_tx_bytes_total", **key)
                - state.derived.gpu_baseline(gpu.uuid).pcie_tx_bytes_total
            )
            / 10
        )


def test_band_outcomes_and_ratios_are_those_of_the_exported_counters() -> None:
    state, cfg = populated_state()
    view, metrics = build_view(state, cfg, T0 + 11), _metrics(state, cfg)
    rows = [row for row in view.band_rows if row.replica == ALL]
    assert rows
    for row in rows:
        exported: dict[str, float] = defaultdict(float)
        for labels, value in metrics["kvwatch_requests_total"]:
            # (all) counts the proxy's view of r0 and the engine-side view of r1 (no proxy there)
            if labels["length_band"] == row.band and (labels["replica"], labels["source"]) in (
                ("r0", "proxy"),
                ("r1", "otlp"),
            ):
                exported[labels["outcome"]] += value
        assert {k: v for k, v in row.outcomes.items() if v} == {k: v for k, v in exported.items() if v}
        total = sum(exported.values())
        assert row.completed_ratio == pytest.approx(exported["completed"] / total)
        assert row.truncated_ratio == pytest.approx(exported["truncated"] / total)


def test_a_bands_counts_and_quantiles_describe_the_same_requests_between_scrapes() -> None:
    """Requests that end after the last scrape are in a band's counts as soon as in its quantiles.

    The counts came from the derived view, recomputed after each engine scrape, and the quantiles
    from the histograms now: `kvwatch demo`'s summary, built when its clients left, showed a band
    as 100% completed with the TPOT p99 of ~150 aborted requests that its counts had not seen.
    """
    state, cfg = populated_state()
    before = {
        row.band: row.requests for row in build_view(state, cfg, T0 + 11).band_rows if row.replica == ALL
    }
    streamed = records()[0]  # one of r0's proxied chat streams
    for i in range(30):  # clients leave a stalled stream after 4 tokens: no scrape since
        state.requests.observe(
            replace(
                streamed,
                outcome=Outcome.ABORTED,
                started_at=T0 + 12 + i,
                prompt_tokens=None,
                output_tokens=4,
                output_tokens_estimated=True,
                ttft_seconds=0.3,
                e2e_seconds=60.0,
            )
        )
    rows = {row.band: row for row in build_view(state, cfg, T0 + 13).band_rows if row.replica == ALL}
    short = rows["0-1k"]
    assert short.requests == before["0-1k"] + 30
    assert short.outcomes["aborted"] == 30
    assert short.aborted_ratio == pytest.approx(30 / short.requests)
    assert short.tpot_p99_seconds is not None and short.tpot_p99_seconds > 1.0  # the stalled ones
