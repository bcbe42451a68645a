"""Dynamo frontend, worker KV stats and KVBM pages."""

from __future__ import annotations

from kvwatch.engines import dynamo
from kvwatch.engines.exposition_parser import parse_text

from .helpers import SCRAPED_AT, only, parse, samples, tiers


def test_frontend_groups_model_label_case_insensitively():
    s = only("dynamo_frontend_1_6.prom")
    assert (s.backend, s.model_name) == ("dynamo", "Qwen/Qwen3-0.6B")
    assert (s.requests_waiting, s.requests_running) == (4.0, 5.0)  # active 9 - queued 4
    assert s.generation_tokens_total == 41000.0
    assert dict(s.finished_requests_total) == {"error": 3.0, "success": 130.0}
    assert (s.block_size, s.num_gpu_blocks) == (16, 5943)
    assert s.kv_capacity_tokens is None  # worker config, not one pool
    ttft = s.histogram("ttft")
    assert ttft.bounds == (0.0, 0.1, 1.0, float("inf")) and ttft.count == 130
    assert s.histogram("generation_tokens").sum == 41000.0


def test_kvbm_direction_names_map_to_plain_tiers_in_blocks():
    found = tiers(only("dynamo_kvbm_1_6.prom"))
    assert {k: t.blocks_total for k, t in found.items()} == {
        ("kvbm", "gpu", "host"): 1200.0,  # offload d2h
        ("kvbm", "host", "disk"): 300.0,  # offload h2d: host-to-disk
        ("kvbm", "gpu", "disk"): 0.0,  # offload d2d
        ("kvbm", "host", "gpu"): 450.0,  # onboard h2d: host-to-device
        ("kvbm", "disk", "gpu"): 20.0,  # onboard d2d
    }
    assert all(t.bytes_total is None for t in found.values())


def test_every_kvbm_counter_has_a_distinct_direction():
    assert len(set(dynamo.KVBM_BLOCKS.values())) == len(dynamo.KVBM_BLOCKS)


def test_worker_kv_stats_per_dp_rank():
    found = {s.dp_rank: s for s in samples("dynamo_worker_kvstats_1_6.prom")}
    assert (found["0"].kv_usage_ratio, found["1"].kv_usage_ratio) == (0.8, 0.1)
    assert found["0"].num_gpu_blocks == 4000 and found["0"].model_name == "llama-3.3-70b"


def test_old_kvstats_names():
    labels = '{dynamo_component="backend",dynamo_namespace="ns"}'
    text = (
        f"dynamo_component_kvstats_active_blocks{labels} 30\n"
        f"dynamo_component_kvstats_total_blocks{labels} 100\n"
        f"dynamo_component_kvstats_gpu_cache_usage_percent{labels} 0.3\n"
    )
    (s,) = dynamo.parse(parse_text(text), "r0", SCRAPED_AT)
    assert (s.kv_used_blocks, s.num_gpu_blocks, s.kv_usage_ratio) == (30.0, 100, 0.3)
    assert s.version_hint == "dynamo 0.7-0.8 (kvstats_* names)"


def test_notes_say_kvbm_counts_blocks():
    assert any("blocks" in n for n in parse("dynamo_kvbm_1_6.prom").notes)


def test_a_trtllm_workers_cumulative_percent_gauge_gives_way_to_its_block_counts():
    """Dynamo's TRT-LLM publisher divides allocTotalBlocks, a cumulative count, by the pool: the
    percent gauge read 3.2 (and climbing) with 800 of 4,000 blocks active, and the pressure alert
    fired for good."""
    labels = '{dynamo_component="tensorrt_llm",dynamo_namespace="ns"}'
    text = (
        f"dynamo_component_kvstats_active_blocks{labels} 800\n"
        f"dynamo_component_kvstats_total_blocks{labels} 4000\n"
        f"dynamo_component_kvstats_gpu_cache_usage_percent{labels} 3.2\n"
    )
    (s,) = dynamo.parse(parse_text(text), "r0", SCRAPED_AT)
    assert (s.kv_used_blocks, s.kv_usage_ratio) == (800.0, 0.2)
    gauge_only = text.replace(f"dynamo_component_kvstats_active_blocks{labels} 800\n", "")
    (s,) = dynamo.parse(parse_text(gauge_only), "r0", SCRAPED_AT)
    assert s.kv_usage_ratio is None  # no ratio at all, rather than 320%
