"""``kvwatch inspect`` and the scraper against a real, idle vLLM agree exactly with its own /metrics.

Under preempting load the same comparison is made on the pages vLLM served during the end-to-end
load (tests/e2e/test_real_engines_e2e.py), so one session drives one preempting load.
"""

from __future__ import annotations

import httpx
import pytest

from kvwatch.agent.engines import scrape_target
from kvwatch.config import ReplicaConfig, ScrapeConfig
from kvwatch.model import LengthBands
from kvwatch.state import NodeState
from tests.local import wait_vllm_idle

from .real_checks import engine_metrics, inspect_json, value

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow]


def _gauges(metrics) -> tuple[float, float, float]:
    return (
        value(metrics, "vllm:kv_cache_usage_perc"),
        value(metrics, "vllm:num_requests_running"),
        value(metrics, "vllm:num_requests_waiting"),
    )


def _counters(metrics) -> tuple[float, float]:
    return value(metrics, "vllm:num_preemptions_total"), value(metrics, "vllm:generation_tokens_total")


def test_inspect_reads_cache_config_and_steady_state_exactly(real_vllm):
    url = real_vllm.metrics_url
    wait_vllm_idle(url)
    engine = engine_metrics(url)
    (x,) = inspect_json(url)["replicas"]
    ((config, _),) = engine["vllm:cache_config_info"]
    assert x["block_size"] == int(config["block_size"]) == 128
    assert x["num_gpu_blocks"] == int(config["num_gpu_blocks"])
    assert x["kv_capacity_tokens"] == float(config["kv_cache_size_tokens"]) == x["num_gpu_blocks"] * 128
    assert (x["model_name"], x["dp_rank"], x["backend"]) == ("tiny", "0", "vllm")
    assert (x["kv_usage_ratio"], x["requests_running"], x["requests_waiting"]) == _gauges(engine)
    assert (x["preemptions_total"], x["generation_tokens_total"]) == _counters(engine)
    assert x["prompt_tokens_total"] == value(engine, "vllm:prompt_tokens_total")
    assert x["prefix_cache_hits_total"] == value(engine, "vllm:prefix_cache_hits_total")
    assert x["histograms"]["ttft"]["count"] == value(engine, "vllm:time_to_first_token_seconds_count")
    assert x["histograms"]["prompt_tokens"]["count"] == value(engine, "vllm:request_prompt_tokens_count")
    # vllm-cpu.sh passes --kv-cache-memory-bytes: the per-GPU budget over every block's token slots
    assert x["kv_bytes_per_token"] == int(config["kv_cache_memory_bytes"]) / (x["num_gpu_blocks"] * 128)
    assert x["version_hint"].startswith("vllm>=0.3")


async def test_scraper_reads_the_real_engine(real_vllm):
    state = NodeState("n", LengthBands())
    async with httpx.AsyncClient() as client:
        await scrape_target(
            client, ReplicaConfig("cpu-vllm", real_vllm.metrics_url), ScrapeConfig(timeout_s=30), state
        )
    target = state.target("cpu-vllm")
    assert target.up and target.backend == "vllm", target.last_error
    (s,) = target.samples
    assert (s.block_size, s.kv_capacity_tokens) == (128, 2560.0)
