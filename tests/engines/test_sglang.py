"""SGLang adapter: the real Dynamo capture and pages for 0.4.10, 0.5.8 and 0.5.20."""

from __future__ import annotations

import pytest

from kvwatch.engines import sglang
from kvwatch.engines.exposition_parser import parse_text

from .helpers import SCRAPED_AT, SGLANG_DYNAMO, only, page, parse, samples, tiers


def test_real_dynamo_capture():
    result = parse(SGLANG_DYNAMO)
    (s,) = result.samples
    assert (s.backend, s.model_name, s.dp_rank) == ("sglang", "Qwen/Qwen3-0.6B", None)
    assert (s.kv_capacity_tokens, s.kv_usage_ratio, s.kv_used_tokens) == (92962.0, 0.0, 0.0)
    # the scheduler's realtime_tokens_total (prefill_compute 33 + prefill_cache 0, decode 300)
    assert (s.prompt_tokens_total, s.generation_tokens_total) == (33.0, 300.0)
    assert not s.token_counters_at_finish and s.prefix_cache_queries_total == 33.0
    assert s.histogram("ttft").count == 1.0
    assert s.histogram("num_preemptions").count == 1.0
    assert s.version_hint == (
        "sglang 0.5.6-0.5.8 (max_total_num_tokens; retractions only as a per-interval gauge)"
    )


def test_per_interval_retraction_gauge_is_not_a_counter():
    s = only(SGLANG_DYNAMO)
    assert s.preemptions_total is None
    assert any("per-interval gauge" in n for n in parse(SGLANG_DYNAMO).notes)


def test_0_4_10_has_no_capacity_and_no_retraction_counter():
    s = only("sglang_0_4_10_no_capacity.prom")
    assert s.kv_capacity_tokens is None  # not reverse-engineered from usage
    assert (s.kv_usage_ratio, s.kv_used_tokens, s.live_tokens) == (0.61, 61000.0, 61000.0)
    assert (s.requests_running, s.requests_waiting) == (14.0, 3.0)
    assert s.preemptions_total is None
    assert (s.prefix_cache_hits_total, s.prefix_cache_queries_total) == (52000.0, 210000.0)
    ttft = s.histogram("ttft")
    assert (ttft.sum, ttft.count) == (160.0, 400.0)
    assert s.version_hint == (
        "sglang 0.4.10-0.5.1 (no capacity gauge; retractions only as a per-interval gauge)"
    )


def test_0_5_8_retraction_counters_and_recompute_upper_bound():
    s = only("sglang_0_5_8_retraction_counters.prom")
    assert s.preemptions_total == 57.0
    assert s.recomputed_tokens_total == 114000.0 + 228000.0
    assert (s.kv_capacity_tokens, s.kv_usage_ratio) == (200000.0, 0.9)
    assert s.requests_swapped_or_paused == 0.0
    assert s.histogram("num_preemptions").count == 3053.0
    assert s.version_hint == "sglang 0.5.8-0.5.11 (max_total_num_tokens, retraction counters)"


def test_0_5_8_hicache_load_back_without_pool_label():
    found = tiers(only("sglang_0_5_8_retraction_counters.prom"))
    load = found[("sglang_hicache", "host", "gpu")]
    assert (load.tokens_total, load.bytes_total, load.seconds_total) == (30000.0, None, 1.5)
    assert ("sglang_hicache", "gpu", "host") not in found


class TestTwoDataParallelRanksWithHiCache:
    @pytest.fixture
    def ranks(self):
        return {s.dp_rank: s for s in samples("sglang_0_5_20_two_dp_ranks_hicache.prom")}

    def test_one_sample_per_dp_rank_reading_one_tp_rank(self, ranks):
        assert sorted(ranks) == ["0", "1"]
        zero, one = ranks["0"], ranks["1"]
        assert (zero.requests_running, one.requests_running) == (64.0, 10.0)  # not 128 / 20: not summed
        assert (zero.kv_used_tokens, one.kv_evictable_tokens) == (485000.0, 100000.0)
        assert (zero.preemptions_total, one.preemptions_total) == (210.0, 0.0)
        assert zero.recomputed_tokens_total == 1.6e6

    def test_capacity_and_pages(self, ranks):
        assert (ranks["1"].kv_capacity_tokens, ranks["1"].block_size, ranks["1"].num_gpu_blocks) == (
            500000.0,
            64,
            7812,
        )

    def test_live_tokens_unknown_with_pages_larger_than_one_token(self, ranks):
        assert ranks["0"].live_tokens is None

    def test_tokenizer_counters_without_rank_are_not_given_to_any_rank(self, ranks):
        for s in ranks.values():
            assert s.prompt_tokens_total is None and s.generation_tokens_total is None
            assert s.histogram("ttft") is None

    def test_hicache_reads_one_tp_rank_and_the_kv_pool(self, ranks):
        found = tiers(ranks["0"])
        load = found[("sglang_hicache", "host", "gpu")]
        assert (load.tokens_total, load.bytes_total, load.seconds_total) == (640000.0, 4.4e10, 4.0)
        assert found[("sglang_hicache", "gpu", "host")].tokens_total == 2.0e6  # swa pool left out
        assert tiers(ranks["1"])[("sglang_hicache", "host", "gpu")].tokens_total == 64000.0

    def test_storage_file_backend_is_the_disk_tier(self, ranks):
        found = tiers(ranks["0"])
        assert found[("sglang_storage", "disk", "host")].tokens_total == 128000.0
        assert found[("sglang_storage", "host", "disk")].tokens_total == 900000.0


def test_single_rank_sums_is_streaming_split_and_reads_device_cache_hits():
    text = (
        'sglang:num_running_reqs{model_name="m",tp_rank="0"} 1\n'
        'sglang:prompt_tokens_total{is_streaming="true",model_name="m"} 30\n'
        'sglang:prompt_tokens_total{is_streaming="false",model_name="m"} 10\n'
        'sglang:cached_tokens_total{cache_source="device",model_name="m"} 7\n'
        'sglang:cached_tokens_total{cache_source="total",model_name="m"} 9\n'
    )
    (s,) = sglang.parse(parse_text(text), "r0", SCRAPED_AT)
    assert (s.prompt_tokens_total, s.prefix_cache_queries_total) == (40.0, 40.0)
    assert s.prefix_cache_hits_total == 7.0


def test_remote_storage_backend_is_the_remote_tier():
    text = (
        'sglang:num_running_reqs{model_name="m",tp_rank="0"} 1\n'
        'sglang:backuped_tokens_total{storage_backend="mooncake",tp_rank="0"} 5\n'
    )
    (s,) = sglang.parse(parse_text(text), "r0", SCRAPED_AT)
    assert tiers(s)[("sglang_storage", "host", "remote")].tokens_total == 5.0


MEMORY_PAGE = "sglang_0_5_23_kv_memory_and_token_histograms.prom"


def test_kv_bytes_per_token_from_the_pool_size_in_gib():
    """73.242 GiB (SGLang's GB is 2^30) over 1,200,000 slots + 1 padding slot: the 65536 bytes per
    token one TP rank of Llama-3.1-8B holds, within the gauge's 3-decimal rounding."""
    s = only(MEMORY_PAGE)
    assert s.kv_capacity_tokens == 1200000.0
    assert s.kv_bytes_per_token == pytest.approx(65536, rel=1e-5)
    assert s.kv_bytes_per_token != pytest.approx(73.242e9 / 1200001, rel=1e-3)  # not decimal GB


@pytest.mark.parametrize(
    ("gib", "tokens", "page", "expected"),
    [
        (1.0, 1023.0, 1, 1024 * 1024.0),  # 2^30 bytes over 1023 slots + 1 padding slot
        (1.0, 1024.0 - 64, 64, 1024 * 1024.0),  # one padding page
        (1.0, 1023.0, None, 1024 * 1024.0),  # no page_size gauge: page size 1
        (None, 1023.0, 1, None),
        (0.0, 1023.0, 1, None),  # SGLang reports 0 where torch did not allocate the pool (MLX stub)
        (1.0, None, 1, None),
        (1.0, 0.0, 1, None),
    ],
)
def test_kv_bytes_per_token_formula(gib, tokens, page, expected):
    assert sglang.kv_bytes_per_token(gib, tokens, page) == expected


def test_pages_without_the_memory_gauge_have_no_bytes_per_token():
    assert only(SGLANG_DYNAMO).kv_bytes_per_token is None
    assert all(s.kv_bytes_per_token is None for s in samples("sglang_0_5_20_two_dp_ranks_hicache.prom"))


def test_finished_requests_summed_over_is_streaming_under_one_key():
    assert only(MEMORY_PAGE).finished_requests_total == (("all", 1000.0),)
    assert only("sglang_0_4_10_no_capacity.prom").finished_requests_total == (("all", 400.0),)
    assert only(SGLANG_DYNAMO).finished_requests_total == (("all", 1.0),)


def test_finished_requests_of_a_page_with_dp_ranks_belong_to_no_rank():
    """num_requests_total is a tokenizer family without a rank label."""
    assert [s.finished_requests_total for s in samples("sglang_0_5_20_two_dp_ranks_hicache.prom")] == [(), ()]


def _with_values(text: str, values: dict[str, float]) -> str:
    """The page with the named series (name and labels as written) set to new values."""
    lines = []
    for line in text.splitlines():
        series = line.rpartition(" ")[0]
        lines.append(f"{series} {values[series]}" if series in values else line)
    return "\n".join(lines) + "\n"


def test_prompt_and_output_token_histograms_feed_headroom():
    """Two scrapes 100 finished requests apart: headroom's freed tokens per finished request are
    the mean prompt + output of those 100 (from the histograms' sum and count increases)."""
    from kvwatch.derive.headroom import finished_total, mean_finished_tokens

    tok = '{engine_type="unified",model_name="llama-3.1-8b"}'
    later = _with_values(
        page(MEMORY_PAGE),
        {
            f'sglang:num_requests_total{tok[:-1]},is_streaming="true"}}': 1000,
            f"sglang:prompt_tokens_histogram_sum{tok}": 2_800_000,
            f"sglang:prompt_tokens_histogram_count{tok}": 1100,
            f"sglang:generation_tokens_histogram_sum{tok}": 6_700_000,
            f"sglang:generation_tokens_histogram_count{tok}": 1100,
        },
    )
    before = only(MEMORY_PAGE)
    (after,) = sglang.parse(parse_text(later), "r0", SCRAPED_AT + 10)
    prompt = after.histogram("prompt_tokens")
    assert prompt is not None and (prompt.count, prompt.sum) == (1100.0, 2_800_000.0)
    assert finished_total(after) - finished_total(before) == 100.0
    assert mean_finished_tokens(after, before) == 300_000 / 100 + 700_000 / 100


def test_token_counters_are_the_schedulers_per_rank_where_the_page_has_them():
    """The tokenizer's prompt/generation counters move when a request finishes, and carry no rank;
    realtime_tokens_total (0.5.8+) moves as batches run, per rank: headroom needs the latter."""
    name = "sglang_0_5_20_two_dp_ranks_hicache.prom"
    without = samples(name)
    assert all(s.token_counters_at_finish is False and s.generation_tokens_total is None for s in without)
    assert only("sglang_0_4_10_no_capacity.prom").token_counters_at_finish is True  # single rank, no realtime
    labels = 'engine_type="unified",model_name="deepseek-v3",moe_ep_rank="{ep}",pp_rank="0",tp_rank="{tp}"'
    realtime = [
        f'sglang:realtime_tokens_total{{dp_rank="{dp}",{labels.format(ep=tp, tp=tp)},mode="{mode}"}} {value}'
        for dp, tp, mode, value in (
            ("0", 0, "decode", 5000),
            ("0", 0, "prefill_compute", 700),
            ("0", 0, "prefill_cache", 300),
            ("0", 1, "decode", 5000),  # another TP rank of the same DP rank: a copy, not more
            ("1", 4, "decode", 900),  # no prefix hit yet on this rank: no prefill_cache series
            ("1", 4, "prefill_compute", 100),
        )
    ]
    text = page(name) + "# TYPE sglang:realtime_tokens_total counter\n" + "\n".join(realtime) + "\n"
    by_rank = {s.dp_rank: s for s in sglang.parse(parse_text(text), "r0", SCRAPED_AT)}
    assert (by_rank["0"].prompt_tokens_total, by_rank["0"].generation_tokens_total) == (1000.0, 5000.0)
    assert (by_rank["1"].prompt_tokens_total, by_rank["1"].generation_tokens_total) == (100.0, 900.0)
    assert not any(s.token_counters_at_finish for s in by_rank.values())
