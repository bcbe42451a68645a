"""TensorRT-LLM adapter: the 2025 five-family collector and the 2026 one with KV blocks."""

from __future__ import annotations

from kvwatch.engines.base import missing_fields

from .helpers import only, tiers


def test_2025_collector_has_request_histograms_and_no_kv():
    s = only("trtllm_2025_five_families.prom")
    assert (s.backend, s.model_name, s.dp_rank) == ("trtllm", "llama-3.3-70b", None)
    assert dict(s.finished_requests_total) == {"length": 50.0, "stop": 250.0}
    assert [name for name, _ in s.histograms] == ["ttft", "e2e", "itl"]
    assert {"kv_capacity_tokens", "kv_usage_ratio", "requests_running", "preemptions_total"} <= set(
        missing_fields(s)
    )
    assert s.version_hint.startswith("trtllm 1.1")


def test_2026_collector_kv_blocks_capacity_and_usage_from_blocks():
    s = only("trtllm_2026_kv_blocks.prom")
    assert (s.block_size, s.num_gpu_blocks, s.kv_capacity_tokens) == (32, 4000, 128000.0)
    assert (s.kv_used_blocks, s.kv_usage_ratio) == (3000.0, 0.75)
    assert (s.requests_running, s.requests_waiting, s.requests_swapped_or_paused) == (48.0, 7.0, 2.0)
    assert s.preemptions_total is None  # paused requests are a gauge, not a preemption counter
    assert (s.prefix_cache_hits_total, s.prefix_cache_queries_total) == (200000.0, 800000.0)


def test_2026_host_tier_traffic():
    found = tiers(only("trtllm_2026_kv_blocks.prom"))
    assert found[("trtllm", "host", "gpu")].bytes_total == 1.0e9
    assert found[("trtllm", "gpu", "host")].bytes_total == 5.0e9
