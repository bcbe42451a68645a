"""What the agent keeps and exports from the plugin's datagrams: per-band request facts, exact
recompute, step-time and KV-block histograms, drop counts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.catalog import CATALOG
from kvwatch.config import Config, ReplicaConfig
from kvwatch.export.plugin import PluginCollector
from kvwatch.export.requests import RequestCollector
from kvwatch.model import DEFAULT_BANDS, EngineStep, EvictionSample, Outcome, PluginLink, RequestRecord
from kvwatch.state import NodeState, PluginStats
from tests.derive.exported import PROXIED, exposition, scraped

CONFIG = Config(replicas=(ReplicaConfig("r0", "http://127.0.0.1:1/metrics", model_name="tiny"),))


def link(pid=1, dropped=0, rank="0", dropped_steps=None, per_admission=True):
    return PluginLink("r0", rank, pid, 1, dropped, dropped_steps, per_admission)


def step(**fields):
    return EngineStep("r0", "0", 100.0, **fields)


def record(output, max_tokens, preemptions, outcome=Outcome.COMPLETED, cached=None, prompt=100):
    return RequestRecord(
        "r0",
        "tiny",
        "vllm_plugin",
        outcome,
        0.0,
        prompt_tokens=prompt,
        output_tokens=output,
        max_tokens=max_tokens,
        preemptions=preemptions,
        e2e_seconds=3.0,
        queue_seconds=0.5,
        prefill_seconds=0.2,
        decode_seconds=2.0,
        cached_prompt_tokens=cached,
    )


def render(collector) -> dict[str, list]:
    class Wrapper:
        def collect(self):
            return collector.collect()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Wrapper())
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_drops_add_up_across_engine_restarts_and_recompute_is_unknown_until_said():
    stats = PluginStats()
    stats.observe(link(pid=1, dropped=0), step())
    assert stats.snapshot()[("r0", "0")].recomputed_tokens is None  # no prefix-cache facts: unknown, not 0
    stats.observe(link(pid=1, dropped=7), step(resumed_queried_tokens=500, resumed_hit_tokens=128))
    stats.observe(link(pid=1, dropped=5), None)  # reordered: a counter never goes back
    stats.observe(link(pid=2, dropped=3), step(resumed_queried_tokens=10, resumed_hit_tokens=0))
    unit = stats.snapshot()[("r0", "0")]
    assert (unit.dropped, unit.recomputed_tokens, unit.datagrams) == (10, 382, 4)


def test_api_servers_sending_for_one_rank_do_not_inflate_the_drops():
    """DP=2 runs two API servers by default, each with a plugin for engines 0 and 1: their datagrams
    for one rank interleave. Each pid's count is its own; alternating pids are not restarts."""
    stats = PluginStats()
    for _ in range(5):
        stats.observe(link(pid=11, dropped=4), None)
        stats.observe(link(pid=12, dropped=1), None)
    assert stats.snapshot()[("r0", "0")].dropped == 5


def test_sender_pids_are_bounded_and_folded_drops_are_kept():
    stats = PluginStats()
    for pid in range(1, 201):  # 200 engine restarts, 2 drops each
        stats.observe(link(pid=pid, dropped=2), None)
    unit = stats.snapshot()[("r0", "0")]
    assert unit.dropped == 400 and len(unit.dropped_datagrams.by_pid) <= 64


def test_step_ring_is_bounded_and_keeps_only_timed_steps():
    stats = PluginStats(ring_size=3)
    stats.observe(link(), step())  # no batch shape: not a sample for calibration
    for ms in (1.0, 2.0, 3.0, 4.0):
        stats.observe(link(), step(ctx_tokens=100, gen_tokens=4, elapsed_ms=ms))
    assert [s.elapsed_ms for s in stats.recent_steps()] == [2.0, 3.0, 4.0]
    hist = stats.snapshot()[("r0", "0")].step_seconds
    assert set(hist) == {"64-256"} and hist["64-256"].count == 4


def test_per_band_request_facts():
    state = NodeState("n", DEFAULT_BANDS)
    state.requests.observe(record(500, 2000, 0, cached=50))
    state.requests.observe(record(800, 1000, 3, cached=0))
    state.requests.observe(record(2000, 2000, 5, outcome=Outcome.TRUNCATED))
    families = render(RequestCollector(state, CONFIG))
    pre = {
        (s.labels["length_band"], s.name): s.value
        for s in families["kvwatch_request_preemptions"]
        if not s.name.endswith("_bucket")
    }
    assert pre == {
        ("0-1k", "kvwatch_request_preemptions_sum"): 3,
        ("0-1k", "kvwatch_request_preemptions_count"): 2,
        ("1k-5k", "kvwatch_request_preemptions_sum"): 5,
        ("1k-5k", "kvwatch_request_preemptions_count"): 1,
    }
    never = [
        s
        for s in families["kvwatch_request_preemptions"]
        if s.name.endswith("_bucket") and s.labels["le"] == "0.0" and s.labels["length_band"] == "0-1k"
    ]
    assert never[0].value == 1
    unused = {s.labels["length_band"]: s.value for s in families["kvwatch_request_unused_max_tokens"]}
    assert unused == {"0-1k": 1500 + 200}  # the truncated one used its whole limit and is not counted
    ratio = [s for s in families["kvwatch_request_output_limit_ratio"] if s.name.endswith("_sum")]
    assert {s.labels["length_band"]: s.value for s in ratio} == {"0-1k": 0.25 + 0.8, "1k-5k": 1.0}
    reuse = [s for s in families["kvwatch_request_prefix_reuse_ratio"] if s.name.endswith("_count")]
    assert [s.value for s in reuse] == [2]  # the one without a cached count is not observed
    for name in (
        "kvwatch_request_queue_seconds",
        "kvwatch_request_prefill_seconds",
        "kvwatch_request_decode_seconds",
        "kvwatch_request_duration_seconds",
    ):
        assert {s.labels["source"] for s in families[name]} == {"vllm_plugin"}


def test_plugin_area_renders_its_catalog_families():
    state = NodeState("n", DEFAULT_BANDS)
    state.plugin.observe(
        link(dropped=2, dropped_steps=40),
        step(
            ctx_tokens=3000,
            gen_tokens=8,
            elapsed_ms=40.0,
            evictions=(EvictionSample(30.0, 10.0, (2.0, 4.0)),),
        ),
    )
    families = render(PluginCollector(state, CONFIG))
    assert set(families) == {s.name for s in CATALOG if s.area == "plugin"}
    [count] = [s for s in families["kvwatch_engine_step_seconds"] if s.name.endswith("_count")]
    assert count.labels == {"replica": "r0", "dp_rank": "0", "batch_tokens": "1k-4k"} and count.value == 1
    [gaps] = [s for s in families["kvwatch_kv_block_reuse_gap_seconds"] if s.name.endswith("_sum")]
    assert gaps.value == 6.0
    [dropped] = families["kvwatch_vllm_plugin_dropped_datagrams"]
    assert dropped.value == 2
    [dropped_steps] = families["kvwatch_vllm_plugin_dropped_steps"]
    assert dropped_steps.value == 40


def test_dropped_steps_add_up_per_sender_and_an_older_plugin_reports_none():
    stats = PluginStats()
    stats.observe(link(pid=1, dropped=1, dropped_steps=30), None)
    stats.observe(link(pid=1, dropped=1, dropped_steps=20), None)  # reordered: never goes back
    stats.observe(link(pid=2, dropped=2, dropped_steps=5), None)
    stats.observe(link(pid=3, dropped=4), None)  # a plugin without "ds": its datagrams count, steps unknown
    unit = stats.snapshot()[("r0", "0")]
    assert (unit.dropped, unit.dropped_steps.total) == (7, 35)


def test_exact_recompute_replaces_the_estimate_for_the_rank_the_plugin_reports():
    state = NodeState("n", DEFAULT_BANDS)
    scraped(state, 0.0, preemptions_total=0.0)
    scraped(state, 5.0, preemptions_total=3.0)
    [estimate] = [s for s in exposition(state)["kvwatch_recomputed_tokens"] if s.name.endswith("_total")]
    assert estimate.labels["source"] == "estimate" and estimate.value > 0
    state.plugin.observe(
        PluginLink("r0", estimate.labels["dp_rank"], 1, 1, 0, per_admission=True),
        EngineStep("r0", estimate.labels["dp_rank"], 5.0, resumed_queried_tokens=900, resumed_hit_tokens=256),
    )
    [exact] = [
        s for s in exposition(state, PROXIED)["kvwatch_recomputed_tokens"] if s.name.endswith("_total")
    ]
    assert (exact.labels["source"], exact.value) == ("vllm_plugin", 644)
    assert {k: v for k, v in exact.labels.items() if k != "source"} == {
        k: v for k, v in estimate.labels.items() if k != "source"
    }


def _recompute_series(per_admission, **step_fields) -> dict[str, float]:
    state = NodeState("n", DEFAULT_BANDS)
    scraped(state, 0.0, preemptions_total=0.0)
    scraped(state, 5.0, preemptions_total=3.0)
    [estimate] = [s for s in exposition(state)["kvwatch_recomputed_tokens"] if s.name.endswith("_total")]
    rank = estimate.labels["dp_rank"]
    state.plugin.observe(
        PluginLink("r0", rank, 1, 1, 0, per_admission=per_admission),
        EngineStep("r0", rank, 5.0, preempted=3, **step_fields),
    )
    return {
        s.labels["source"]: s.value
        for s in exposition(state, PROXIED)["kvwatch_recomputed_tokens"]
        if s.name.endswith("_total")
    }


def test_where_vllm_did_not_count_the_estimate_stays():
    """Prefix caching off: the plugin sends the lookups as null (it once sent vLLM's zeroed stats)."""
    assert set(_recompute_series(True, resumed_queried_tokens=None, resumed_hit_tokens=None)) == {"estimate"}


def test_an_older_vllm_recompute_is_labelled_an_upper_bound_and_the_estimate_stays():
    """Before 0.27.0 vLLM recorded each lookup of a resumed request, also those after which it could not
    be scheduled (0.26.0's KVCacheManager.get_computed_blocks records at lookup time)."""
    for per_admission in (False, None):  # an older vLLM, or a plugin that does not say
        series = _recompute_series(per_admission, resumed_queried_tokens=900, resumed_hit_tokens=256)
        assert series.keys() == {"vllm_plugin_upper_bound", "estimate"}
        assert series["vllm_plugin_upper_bound"] == 644


def test_a_kv_connector_figure_is_exact_in_every_vllm():
    """vLLM records the connector's lookups after allocation, at admission, in 0.26.0 as in 0.32.0."""
    series = _recompute_series(
        None,
        resumed_queried_tokens=1000,
        resumed_hit_tokens=400,
        connector_resumed_queried_tokens=600,
        connector_resumed_hit_tokens=500,
    )
    assert series == {"vllm_plugin": 100}
