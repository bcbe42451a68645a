"""The simulator's /metrics reads as vLLM 0.33 (names, labels, buckets) and tells the engine's truth."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.engines.registry import parse_exposition
from kvwatch.sim import stats
from kvwatch.sim.engine import SimEngine
from kvwatch.sim.exposition_writer import render_vllm_metrics

from .helpers import small_config

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def busy_engines(n: int, **overrides) -> list[SimEngine]:
    """``n`` DP ranks that have finished, truncated, preempted and still hold running requests."""
    cfg = small_config(num_gpu_blocks_override=40, max_model_len=150, **overrides)
    engines = [SimEngine(cfg, name=str(i)) for i in range(n)]
    for e in engines:
        for i in range(10):
            e.submit(f"{e.name}-{i}", 20 + i, 45, 10 + 8 * i)
        for _ in range(70):
            e.step()
        e.check_invariants()
        assert e.preemptions_total and e.completed and e.truncated and e.num_running
    return engines


def families(text: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def by_engine(family, suffix: str = "") -> dict[str, float]:
    return {s.labels["engine"]: s.value for s in family.samples if s.name == family.name + suffix}


def test_core_families_have_vllm_names_types_and_labels():
    engines = busy_engines(1)
    fams = families(render_vllm_metrics(engines, MODEL, created=1.7e9))
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_generation_tokens": "histogram",
        "vllm:request_num_preemptions": "histogram",
        "vllm:iteration_tokens_total": "histogram",
    }
    for name, kind in expected.items():
        assert fams[name].type == kind, name
        for s in fams[name].samples:
            if not s.name.endswith("_created"):
                assert s.labels["engine"] == "0"
                # cache_config_info carries CacheConfig fields + engine only, as in vLLM
                assert s.labels.get("model_name") == (None if name == "vllm:cache_config_info" else MODEL)
    text = render_vllm_metrics(engines, MODEL, created=1.7e9).decode()
    # exposed names as real vLLM prints them (counter suffix, histogram total suffix, _created)
    for line in (
        "vllm:num_preemptions_total{",
        "vllm:iteration_tokens_total_bucket{",
        "vllm:num_preemptions_created{",
    ):
        assert line in text


def test_values_are_the_engines_ground_truth():
    (e,) = busy_engines(1)
    fams = families(render_vllm_metrics([e], MODEL, created=0.0))
    assert by_engine(fams["vllm:kv_cache_usage_perc"]) == {"0": e.kv_usage}
    assert by_engine(fams["vllm:num_requests_running"]) == {"0": e.num_running}
    assert by_engine(fams["vllm:num_requests_waiting"]) == {"0": e.num_waiting}
    assert by_engine(fams["vllm:num_preemptions"], "_total") == {"0": e.preemptions_total}
    assert by_engine(fams["vllm:generation_tokens"], "_total") == {"0": e.stats.generation_tokens}
    success = {
        s.labels["finished_reason"]: s.value
        for s in fams["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    assert success == {"stop": e.completed, "length": e.truncated, "abort": 0, "error": 0, "repetition": 0}
    gen = fams["vllm:request_generation_tokens"]
    count = next(s.value for s in gen.samples if s.name.endswith("_count"))
    assert count == e.completed + e.truncated
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert info["num_gpu_blocks"] == "40" and info["block_size"] == "4"
    assert info["kv_cache_size_tokens"] == "160" and info["engine"] == "0"


@pytest.mark.parametrize(
    ("family", "bounds"),
    [
        ("vllm:time_to_first_token_seconds", stats.TIME_TO_FIRST_TOKEN_BUCKETS),
        ("vllm:inter_token_latency_seconds", stats.INTER_TOKEN_LATENCY_BUCKETS),
        ("vllm:request_time_per_output_token_seconds", stats.INTER_TOKEN_LATENCY_BUCKETS),
        ("vllm:e2e_request_latency_seconds", stats.REQUEST_LATENCY_BUCKETS),
        ("vllm:request_queue_time_seconds", stats.REQUEST_LATENCY_BUCKETS),
        ("vllm:request_num_preemptions", stats.REQUEST_NUM_PREEMPTIONS_BUCKETS),
        ("vllm:iteration_tokens_total", stats.ITERATION_TOKENS_BUCKETS),
        ("vllm:request_generation_tokens", (1, 2, 5, 10, 20, 50, 100)),  # build_1_2_5_buckets(150)
    ],
)
def test_histograms_use_vllms_bucket_lists(family, bounds):
    fams = families(render_vllm_metrics(busy_engines(1), MODEL, created=0.0))
    les = [s.labels["le"] for s in fams[family].samples if s.name.endswith("_bucket")]
    assert les == [repr(float(b)) for b in bounds] + ["+Inf"]


def test_vllm_bucket_literals_are_verbatim():
    # vllm/v1/metrics/buckets.py (0.30+)
    assert stats.TIME_TO_FIRST_TOKEN_BUCKETS[-3:] == (160.0, 640.0, 2560.0)
    assert stats.REQUEST_LATENCY_BUCKETS[-3:] == (960.0, 1920.0, 7680.0)
    assert stats.request_tokens_buckets(131072)[-3:] == (20000.0, 50000.0, 100000.0)
    assert stats.request_tokens_buckets(32768) == (
        1,
        2,
        5,
        10,
        20,
        50,
        100,
        200,
        500,
        1000,
        2000,
        5000,
        10000,
        20000,
    )


def test_one_server_can_expose_several_dp_ranks():
    engines = busy_engines(3)
    fams = families(render_vllm_metrics(engines, MODEL, created=0.0))
    assert set(by_engine(fams["vllm:kv_cache_usage_perc"])) == {"0", "1", "2"}
    infos = {s.labels["engine"] for s in fams["vllm:cache_config_info"].samples}
    assert infos == {"0", "1", "2"}


def test_kvwatch_vllm_adapter_reads_the_simulator_as_vllm_with_every_rank():
    engines = busy_engines(3)
    result = parse_exposition(render_vllm_metrics(engines, MODEL, created=0.0).decode(), "sim-node")
    assert result.backend == "vllm"
    samples = {s.dp_rank: s for s in result.samples}
    assert set(samples) == {"0", "1", "2"}
    for e in engines:
        s = samples[e.name]
        assert s.model_name == MODEL
        assert s.kv_usage_ratio == pytest.approx(e.kv_usage)
        assert s.block_size == 4 and s.num_gpu_blocks == 40 and s.kv_capacity_tokens == 160
        assert s.requests_running == e.num_running and s.requests_waiting == e.num_waiting
        assert s.preemptions_total == e.preemptions_total
        assert s.generation_tokens_total == e.stats.generation_tokens


def test_offload_counters_appear_only_with_the_cpu_tier():
    plain = families(render_vllm_metrics(busy_engines(1), MODEL, created=0.0))
    assert not any(name.startswith("vllm:kv_offload") for name in plain)
    engines = busy_engines(1, kv_offload_bytes=2e9)
    (e,) = engines
    fams = families(render_vllm_metrics(engines, MODEL, created=0.0))
    assert by_engine(fams["vllm:kv_offload_store_bytes"], "_total") == {"0": e.stats.offload_store_bytes}
    assert by_engine(fams["vllm:kv_offload_load_bytes"], "_total") == {"0": e.stats.offload_load_bytes}
    assert e.stats.offload_store_bytes > 0
    legacy = {
        s.labels["transfer_type"]: s.value
        for s in fams["vllm:kv_offload_total_bytes"].samples
        if s.name.endswith("_total")
    }
    assert legacy == {"GPU_to_CPU": e.stats.offload_store_bytes, "CPU_to_GPU": e.stats.offload_load_bytes}
    result = parse_exposition(render_vllm_metrics(engines, MODEL, created=0.0).decode(), "sim")
    assert any(t.bytes_total == e.stats.offload_store_bytes for t in result.samples[0].tier_traffic)


def test_kv_bytes_per_token_reach_kvwatch_through_cache_config_info():
    """``kv_cache_memory_bytes`` (per GPU, whole blocks) lets the adapter recover the memory plan's
    KV bytes per token per GPU, and the demo gets ``kvwatch_kv_capacity_bytes``."""
    engines = busy_engines(1)
    (e,) = engines
    fams = families(render_vllm_metrics(engines, MODEL, created=0.0))
    per_gpu = e.memory_plan.kv_bytes_per_token_per_gpu
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert info["kv_cache_memory_bytes"] == str(round(160 * per_gpu))  # 40 blocks x 4 tokens
    (s,) = parse_exposition(render_vllm_metrics(engines, MODEL, created=0.0).decode(), "sim").samples
    assert s.kv_bytes_per_token == pytest.approx(per_gpu)


def test_vllm_host_cache_hits_make_the_live_recompute_avoided_ratio_without_a_gpu_map():
    from kvwatch.derive.tiers import tier_payback, tier_rates

    cfg = small_config(num_gpu_blocks_override=40, max_model_len=150, kv_offload_bytes=2e9)
    e = SimEngine(cfg)
    before = parse_exposition(render_vllm_metrics([e], MODEL, created=0.0).decode(), "sim", scraped_at=0.0)
    for i in range(10):
        e.submit(f"r{i}", 20 + i, 45, 10 + 8 * i)
    for _ in range(200):
        e.step()
    assert e.stats.external_hits > 0  # preempted requests came back from the CPU tier
    now = parse_exposition(render_vllm_metrics([e], MODEL, created=0.0).decode(), "sim", scraped_at=10.0)
    [onload] = [t for t in now.samples[0].tier_traffic if t.family == "vllm_offload" and t.dst_tier == "gpu"]
    assert onload.tokens_total == e.stats.external_hits  # prompt_tokens_cached_by_source{source="host"}
    payback = tier_payback("sim", [tier_rates(now.samples[0], before.samples[0])])
    assert payback is not None
    moved = e.stats.offload_store_bytes + e.stats.offload_load_bytes
    assert payback.tokens_per_byte == pytest.approx(e.stats.external_hits / moved)
