"""``kvwatch inspect`` against a real vLLM under preempting load agrees with vLLM's own /metrics.

The engine keeps running between two scrapes, so "the same moment" is made precise by bracketing:
engine scrape A, then inspect X, then engine scrape B (tens of milliseconds in all).

* Counters only grow: A <= X <= B must hold exactly, every time.
* Gauges (KV usage, running, waiting) can move either way between scrapes. When A == B the state
  was almost surely steady across X too, and X must equal it. A gauge that changed and changed back
  inside the window would break that without kvwatch being wrong, so one such sample is tolerated.
* When the load is over everything is steady and must agree exactly.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest

from kvwatch.config import ReplicaConfig, ScrapeConfig
from kvwatch.engines.scraper import scrape_target
from kvwatch.model import LengthBands
from kvwatch.state import NodeState

from .real_checks import engine_metrics, inspect_json, value

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow]

def _gauges(metrics) -> tuple[float, float, float]:
    return (value(metrics, "vllm:kv_cache_usage_perc"), value(metrics, "vllm:num_requests_running"),
            value(metrics, "vllm:num_requests_waiting"))


def _counters(metrics) -> tuple[float, float]:
    return value(metrics, "vllm:num_preemptions_total"), value(metrics, "vllm:generation_tokens_total")


def _long_request(base_url: str, i: int) -> int:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300)
    stream = client.completions.create(model="tiny", prompt="hello world " * (20 + i), max_tokens=1500,
                                       stream=True, extra_body={"ignore_eos": True})
    return sum(1 for _ in stream)


def _wait_idle(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, running, waiting = _gauges(engine_metrics(url))
        if running == 0 and waiting == 0:
            return
        time.sleep(0.5)
    raise AssertionError("vLLM did not go idle")


def test_inspect_agrees_with_vllm_under_preempting_load(real_vllm):
    """Keeps 8 long streams going (topping up as they finish) until 3 steady samples were taken
    while the engine was busy, or 240 s passed: on a loaded 2-core machine steady moments are rare."""
    url = real_vllm.metrics_url
    agreeing, disagreeing, busy_agreeing = 0, [], 0
    deadline = time.monotonic() + 240
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(_long_request, real_vllm.base_url, i) for i in range(8)]
        submitted = len(futures)
        time.sleep(1.0)
        while busy_agreeing < 3 and time.monotonic() < deadline:
            for i, f in enumerate(futures):
                if f.done():
                    assert f.result() > 0  # re-raises a failed request
                    futures[i] = pool.submit(_long_request, real_vllm.base_url, submitted)
                    submitted += 1
            a = engine_metrics(url)
            doc = inspect_json(url)
            b = engine_metrics(url)
            (x,) = doc["replicas"]
            mine = (x["preemptions_total"], x["generation_tokens_total"])
            for lo, got, hi in zip(_counters(a), mine, _counters(b), strict=True):
                assert lo <= got <= hi, (_counters(a), mine, _counters(b))
            if _gauges(a) == _gauges(b):
                mine = (x["kv_usage_ratio"], x["requests_running"], x["requests_waiting"])
                if mine == _gauges(a):
                    agreeing += 1
                    busy_agreeing += _gauges(a)[1] + _gauges(a)[2] > 0
                else:
                    disagreeing.append((_gauges(a), mine))
        assert all(f.result() > 0 for f in futures)
    assert len(disagreeing) <= 1, disagreeing
    assert busy_agreeing >= 3, f"too few steady samples under load ({agreeing} steady in all)"
    final = engine_metrics(url)
    assert value(final, "vllm:num_preemptions_total") > 0, "the load did not preempt: KV cache larger?"


def test_inspect_reads_cache_config_and_steady_state_exactly(real_vllm):
    url = real_vllm.metrics_url
    _wait_idle(url)
    engine = engine_metrics(url)
    (x,) = inspect_json(url)["replicas"]
    (config, _), = engine["vllm:cache_config_info"]
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
        await scrape_target(client, ReplicaConfig("cpu-vllm", real_vllm.metrics_url),
                            ScrapeConfig(timeout_s=30), state)
    target = state.target("cpu-vllm")
    assert target.up and target.backend == "vllm", target.last_error
    (s,) = target.samples
    assert (s.block_size, s.kv_capacity_tokens) == (128, 2560.0)
