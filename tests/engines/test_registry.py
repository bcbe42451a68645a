"""Backend detection and the parse_exposition entry point."""

from __future__ import annotations

import pytest

from kvwatch.engines.exposition_parser import ExpositionError, parse_text
from kvwatch.engines.registry import ADAPTERS, NoEngineMetricsError, detect_backend, parse_exposition
from kvwatch.model import BACKENDS

from .helpers import FIXTURES, LLAMACPP_TINY, SGLANG_DYNAMO, VLLM_DYNAMO_LMCACHE, page, parse

DETECTED = {
    "vllm_0_32_cpu_idle.prom": "vllm",
    "vllm_0_7_v1_no_engine_label.prom": "vllm",
    "vllm_v0_0_8_swap.prom": "vllm",
    "sglang_0_4_10_no_capacity.prom": "sglang",
    "sglang_0_5_20_two_dp_ranks_hicache.prom": "sglang",
    "trtllm_2025_five_families.prom": "trtllm",
    "trtllm_2026_kv_blocks.prom": "trtllm",
    "dynamo_frontend_1_6.prom": "dynamo",
    "dynamo_kvbm_1_6.prom": "dynamo",
    "dynamo_worker_kvstats_1_6.prom": "dynamo",
    "llamacpp_2024_kv_cache_usage_ratio.prom": "llamacpp",
    "tgi_3_3_router.prom": "tgi",
}


@pytest.mark.parametrize(("name", "backend"), sorted(DETECTED.items()))
def test_backend_detected_from_page(name, backend):
    assert detect_backend(parse_text(page(name))) == backend


def test_every_fixture_page_is_detected_and_parses():
    for path in sorted(FIXTURES.glob("*.prom")):
        result = parse(path)
        assert result.samples, path.name
        assert all(s.backend == result.backend for s in result.samples)


def test_dynamo_worker_pages_with_engine_families_belong_to_the_engine():
    assert detect_backend(parse_text(page(VLLM_DYNAMO_LMCACHE))) == "vllm"
    assert detect_backend(parse_text(page(SGLANG_DYNAMO))) == "sglang"
    dynamo_wrapped = page("dynamo_worker_kvstats_1_6.prom") + page("trtllm_2026_kv_blocks.prom")
    assert detect_backend(parse_text(dynamo_wrapped)) == "trtllm"


def test_adapters_cover_every_engine_backend():
    assert set(ADAPTERS) == set(BACKENDS)


def test_page_without_engine_families_names_what_it_found():
    with pytest.raises(NoEngineMetricsError, match="process_cpu_seconds_total"):
        parse_exposition("process_cpu_seconds_total 1.5\n", "r0")


def test_vllm_with_disable_log_stats_gets_a_hint():
    text = 'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 4\n'
    with pytest.raises(NoEngineMetricsError, match="--disable-log-stats"):
        parse_exposition(text, "r0")


def test_forced_backend_that_does_not_match_the_page():
    with pytest.raises(NoEngineMetricsError, match="expected sglang families"):
        parse_exposition(page(LLAMACPP_TINY), "r0", backend="sglang")


def test_forced_backend_reads_the_page():
    assert parse(LLAMACPP_TINY, backend="llamacpp").backend == "llamacpp"


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="unknown backend 'nginx'"):
        parse_exposition(page(LLAMACPP_TINY), "r0", backend="nginx")


def test_malformed_text_raises_exposition_error():
    with pytest.raises(ExpositionError):
        parse_exposition("vllm:num_requests_running{", "r0")


def test_replica_name_and_time_are_stamped_on_every_sample():
    result = parse_exposition(page("vllm_0_33_two_dp_ranks_offload.prom"), "node7-r3", scraped_at=42.0)
    assert {(s.replica, s.scraped_at) for s in result.samples} == {("node7-r3", 42.0)}
