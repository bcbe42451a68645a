"""vLLM adapter: real captures and one page per version boundary (written from vLLM's source)."""

from __future__ import annotations

import pytest

from kvwatch.engines import vllm
from kvwatch.engines.base import missing_fields
from kvwatch.engines.exposition_parser import parse_text

from .helpers import SCRAPED_AT, VLLM_DYNAMO_LMCACHE, only, page, parse, samples, tiers


def test_real_cpu_vllm_under_load_reads_kv_preemptions_and_capacity():
    s = only("vllm_0_32_cpu_preempting.prom")
    assert (s.backend, s.replica, s.model_name, s.dp_rank) == ("vllm", "r0", "tiny", "0")
    assert s.scraped_at == SCRAPED_AT
    assert (s.block_size, s.num_gpu_blocks, s.kv_capacity_tokens) == (128, 20, 2560.0)
    assert s.kv_usage_ratio == pytest.approx(18 / 19)
    assert s.kv_used_blocks == 18.0  # usage is relative to num_gpu_blocks - 1 (the null block)
    assert (s.requests_running, s.requests_waiting, s.preemptions_total) == (3.0, 2.0, 8.0)
    assert (s.prefix_cache_queries_total, s.prefix_cache_hits_total) == (1200.0, 896.0)
    assert dict(s.finished_requests_total)["length"] == 3.0
    assert s.version_hint == "vllm>=0.32 (prompt_tokens_cached_by_source)"


def test_real_cpu_vllm_keeps_histograms_for_cross_checks():
    s = only("vllm_0_32_cpu_preempting.prom")
    assert [name for name, _ in s.histograms] == [
        "ttft",
        "e2e",
        "itl",
        "prompt_tokens",
        "generation_tokens",
        "num_preemptions",
    ]
    pre = s.histogram("num_preemptions")
    assert pre is not None
    assert pre.bounds == (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0, float("inf"))
    assert pre.count == 3.0 and pre.cumulative_counts[-1] == 3.0


def test_fields_vllm_does_not_export_are_none_not_zero():
    s = only("vllm_0_32_cpu_idle.prom")
    assert s.kv_usage_ratio == 0.0 and s.preemptions_total == 0.0  # measured zero
    assert missing_fields(s) == [
        "kv_used_tokens",
        "kv_evictable_tokens",
        "live_tokens",
        "requests_swapped_or_paused",
        "recomputed_tokens_total",
    ]


def test_dynamo_worker_capture_with_lmcache():
    result = parse(VLLM_DYNAMO_LMCACHE)
    (s,) = result.samples
    assert (s.model_name, s.dp_rank, s.block_size, s.num_gpu_blocks) == ("Qwen/Qwen3-0.6B", "0", 16, 5943)
    assert s.kv_capacity_tokens == 5943 * 16
    assert s.version_hint == "vllm>=0.12 (kv_cache_usage_perc; no gpu_cache_usage_perc)"
    found = tiers(s)
    assert found[("lmcache", "gpu", "host")].tokens_total == 0.0
    assert found[("lmcache", "remote", "host")].bytes_total == 0.0
    assert any("Dynamo worker page" in n for n in result.notes)


def test_0_7_v1_without_engine_label_reads_old_names():
    s = only("vllm_0_7_v1_no_engine_label.prom")
    assert s.dp_rank is None
    assert s.model_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert s.kv_usage_ratio == 0.5
    assert (s.prefix_cache_queries_total, s.prefix_cache_hits_total) == (4096.0, 1024.0)
    assert s.kv_capacity_tokens == 28000 * 16
    assert s.kv_used_blocks == round(0.5 * 27999)
    assert s.histogram("itl") is not None and s.histogram("itl").count == 309948.0
    assert s.version_hint == "vllm 0.7-0.8.2 (no engine label)"


def test_0_9_2_with_both_names_prefers_the_new_ones():
    s = only("vllm_0_9_2_both_cache_names.prom")
    assert s.kv_usage_ratio == 0.25
    assert s.prefix_cache_hits_total == 300.0  # not 600: the old copy is not added
    assert s.cache_dtype == "fp8"
    assert s.version_hint.startswith("vllm 0.9.2-0.11")


def test_0_11_with_old_names_hidden_and_both_itl_names():
    s = only("vllm_0_11_hidden_old_names.prom")
    assert s.kv_usage_ratio == 0.75
    assert s.histogram("itl").count == 10.0
    assert s.version_hint.startswith("vllm 0.11-0.14")


def test_0_12_with_old_names_gone():
    s = only("vllm_0_12_old_names_gone.prom")
    assert (s.kv_usage_ratio, s.preemptions_total, s.num_gpu_blocks) == (0.75, 4.0, 8000)
    assert s.version_hint == "vllm>=0.12 (kv_cache_usage_perc; no gpu_cache_usage_perc)"


def test_v0_engine_reads_swapped_requests():
    s = only("vllm_v0_0_8_swap.prom")
    assert (s.requests_swapped_or_paused, s.requests_running, s.preemptions_total) == (2.0, 8.0, 31.0)
    assert s.kv_usage_ratio == 0.98
    assert s.prefix_cache_hits_total is None  # V0 had only a hit-rate gauge
    assert s.version_hint.startswith("vllm V0 engine")


def test_multiprocess_mode_page():
    s = only("vllm_0_32_multiprocess_api_servers.prom")
    assert (s.kv_usage_ratio, s.preemptions_total, s.kv_capacity_tokens) == (0.5, 3.0, 2560.0)
    ttft = s.histogram("ttft")
    assert (ttft.count, ttft.sum, ttft.cumulative_counts) == (4.0, 1.25, (1.0, 3.0, 4.0))
    assert s.histogram("e2e") is None  # HELP/TYPE only: never observed
    assert s.requests_swapped_or_paused is None


class TestTwoDataParallelRanks:
    """vLLM 0.33, one API server with --data-parallel-size 2, offloading and tiering."""

    @pytest.fixture
    def ranks(self):
        return {s.dp_rank: s for s in samples("vllm_0_33_two_dp_ranks_offload.prom")}

    def test_one_sample_per_engine_rank(self, ranks):
        assert sorted(ranks) == ["0", "1"]
        assert ranks["0"].key == ("r0", "deepseek-r1", "0")
        assert (ranks["0"].kv_usage_ratio, ranks["1"].kv_usage_ratio) == (0.99, 0.31)
        assert (ranks["0"].requests_waiting, ranks["1"].requests_waiting) == (9.0, 0.0)
        assert (ranks["0"].preemptions_total, ranks["1"].preemptions_total) == (120.0, 0.0)

    def test_capacity_prefers_kv_cache_size_tokens(self, ranks):
        assert ranks["1"].kv_capacity_tokens == 950272.0  # = 14848 x 64
        assert ranks["1"].cache_dtype == "fp8_e4m3"

    def test_offload_counters_map_to_host_tier_with_seconds(self, ranks):
        found = tiers(ranks["0"])
        assert found[("vllm_offload", "host", "gpu")].bytes_total == 8.0e9
        assert found[("vllm_offload", "host", "gpu")].seconds_total == 0.5
        assert found[("vllm_offload", "gpu", "host")].bytes_total == 2.4e10

    def test_legacy_offload_family_is_not_counted_twice(self, ranks):
        assert not [t for t in ranks["0"].tier_traffic if t.family == "vllm_offload_legacy"]

    def test_tiering_fs_tier_is_disk(self, ranks):
        found = tiers(ranks["0"])
        assert found[("vllm_tiering", "host", "disk")].bytes_total == 1.6e10
        assert found[("vllm_tiering", "disk", "host")].seconds_total == 2.0

    def test_lmcache_without_rank_labels_is_not_attributed(self, ranks):
        assert not [t for s in ranks.values() for t in s.tier_traffic if t.family == "lmcache"]
        assert any(
            "LMCache traffic not attributed" in n for n in parse("vllm_0_33_two_dp_ranks_offload.prom").notes
        )

    def test_finished_requests_by_reason_per_rank(self, ranks):
        assert dict(ranks["1"].finished_requests_total)["stop"] == 700.0


def test_legacy_offload_family_alone_is_read_by_transfer_type():
    name, labels = "vllm:kv_offload_total_bytes_total", 'engine="0",model_name="qwen3-32b"'
    text = page("vllm_0_12_old_names_gone.prom") + (
        f"# TYPE {name} counter\n"
        f'{name}{{{labels},transfer_type="CPU_to_GPU"}} 5.0\n'
        f'{name}{{{labels},transfer_type="GPU_to_CPU"}} 7.0\n'
    )
    (s,) = vllm.parse(parse_text(text), "r0", SCRAPED_AT)
    found = tiers(s)
    assert found[("vllm_offload_legacy", "host", "gpu")].bytes_total == 5.0
    assert found[("vllm_offload_legacy", "gpu", "host")].bytes_total == 7.0
    assert found[("vllm_offload_legacy", "gpu", "host")].seconds_total is None


def test_cache_config_without_engine_label_is_shared_by_every_rank():
    """0.8.3-0.8.x: metrics carry engine, cache_config_info does not (it gained it in 0.9)."""
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 1\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2\n'
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.25\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="101"} 1\n'
    )
    found = vllm.parse(parse_text(text), "r0", SCRAPED_AT)
    assert [(s.dp_rank, s.kv_capacity_tokens, s.kv_used_blocks) for s in found] == [
        ("0", 1616.0, 50.0),
        ("1", 1616.0, 25.0),
    ]
    assert found[0].version_hint == "vllm 0.8.3-0.9.1 (engine label; gpu_cache_usage_perc only)"


def test_ranks_sort_numerically():
    text = "".join(f'vllm:num_requests_running{{engine="{i}",model_name="m"}} 0\n' for i in (10, 2, 1))
    assert [s.dp_rank for s in vllm.parse(parse_text(text), "r0", SCRAPED_AT)] == ["1", "2", "10"]


def test_none_string_in_cache_config_leaves_capacity_unknown():
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 1\n'
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="None"} 1\n'
    )
    (s,) = vllm.parse(parse_text(text), "r0", SCRAPED_AT)
    assert (s.block_size, s.num_gpu_blocks, s.kv_capacity_tokens) == (16, None, None)


def test_nan_gauge_is_not_measured():
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 1\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN\n'
    )
    (s,) = vllm.parse(parse_text(text), "r0", SCRAPED_AT)
    assert s.kv_usage_ratio is None


def test_real_cpu_vllm_kv_bytes_per_token_from_the_byte_budget():
    """vllm-cpu.sh starts vLLM with --kv-cache-memory-bytes 20971520 for 20 blocks of 128 tokens; the
    tiny model holds 8 layers x 2 (K, V) x 4 KV heads x 64 dims x 2 bytes = 8192 bytes per token."""
    s = only("vllm_0_32_cpu_preempting.prom")
    assert s.kv_bytes_per_token == 20971520 / (20 * 128) == 8 * 2 * 4 * 64 * 2


def test_kv_cache_memory_bytes_none_leaves_bytes_per_token_unknown():
    """vLLM sized the pool from gpu_memory_utilization: the label says "None"."""
    assert only("vllm_0_12_old_names_gone.prom").kv_bytes_per_token is None
    assert all(s.kv_bytes_per_token is None for s in samples("vllm_0_33_two_dp_ranks_offload.prom"))


@pytest.mark.parametrize(
    ("memory", "blocks", "block_size", "expected"),
    [
        (20971520, 20, 128, 8192.0),  # the null block takes memory too: every block is in the divisor
        (1000, 3, 16, 1000 / 48),  # a budget that is not a whole number of blocks: at most a block high
        (None, 20, 128, None),
        (20971520, None, 128, None),
        (20971520, 20, None, None),
        (0, 20, 128, None),
        (-5, 20, 128, None),
        (20971520, 0, 128, None),
    ],
)
def test_kv_bytes_per_token_formula(memory, blocks, block_size, expected):
    assert vllm.kv_bytes_per_token(memory, blocks, block_size) == expected


def test_real_cpu_vllm_prompt_and_output_sizes_of_finished_requests():
    """Headroom's "freed" needs both per-request token histograms between two samples."""
    from kvwatch.derive.headroom import finished_total, mean_finished_tokens

    idle, busy = only("vllm_0_32_cpu_idle.prom"), only("vllm_0_32_cpu_preempting.prom")
    prompt = busy.histogram("prompt_tokens")
    assert prompt is not None and (prompt.count, prompt.sum) == (3.0, 450.0)
    assert finished_total(busy) - finished_total(idle) == 3.0
    assert mean_finished_tokens(busy, idle) == 450 / 3 + 4500 / 3


def test_the_production_stack_routers_page_is_refused_not_read_as_one_replica():
    # vllm_router's metrics_service: vLLM-named gauges per backend `server`; they were summed into
    # one replica with no model and a "V0 engine" version hint
    from kvwatch.engines.registry import NoEngineMetricsError, parse_exposition

    router = "".join(
        f'vllm:{name}{{server="http://10.0.0.{i}:8000"}} {value}\n'
        for i in (1, 2)
        for name, value in (
            ("num_requests_running", 42),
            ("num_requests_waiting", 9),
            ("num_requests_swapped", 0),
            ("current_qps", 3.5),
            ("healthy_pods_total", 2),
        )
    )
    with pytest.raises(NoEngineMetricsError, match="production-stack's router page"):
        parse_exposition(router, "r0")
