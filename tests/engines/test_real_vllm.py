"""``kvwatch inspect`` against a real vLLM agrees with vLLM's own /metrics.

* Under preempting load vLLM's gauges move every few hundred milliseconds, faster than two scrapes can
  pin them on a busy 2-core machine. So the pages are captured while the engine is busy and
  ``kvwatch inspect FILE`` reads each capture: the same bytes vLLM served, compared exactly.
* Idle, ``kvwatch inspect URL`` reads the live engine and everything must agree exactly.
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

from .real_checks import engine_metrics, inspect_json, metrics_of, value

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


def test_inspect_agrees_with_vllm_under_preempting_load(real_vllm, tmp_path):
    """Keeps 8 long streams going (topping up as they finish) and captures vLLM's page until the
    captures show it running, queueing and preempting (or 240 s passed); kvwatch's reading of every
    capture equals vLLM's own numbers in it."""
    url = real_vllm.metrics_url
    captures: list[str] = []
    deadline = time.monotonic() + 240

    def seen_everything() -> bool:
        pages = [metrics_of(text) for text in captures]
        return (sum(_gauges(m)[1] > 0 for m in pages) >= 3 and any(_gauges(m)[2] > 0 for m in pages)
                and len(pages) > 1 and _counters(pages[-1])[0] > _counters(pages[0])[0])

    with concurrent.futures.ThreadPoolExecutor(max_workers=10) as pool:
        futures = [pool.submit(_long_request, real_vllm.base_url, i) for i in range(10)]
        submitted = len(futures)
        time.sleep(1.0)
        while not seen_everything() and time.monotonic() < deadline:
            for i, f in enumerate(futures):
                if f.done():
                    assert f.result() > 0  # re-raises a failed request
                    futures[i] = pool.submit(_long_request, real_vllm.base_url, submitted)
                    submitted += 1
            captures.append(httpx.get(url, timeout=30.0).text)
            time.sleep(0.5)
        assert all(f.result() > 0 for f in futures)
    assert seen_everything(), f"{len(captures)} captures never showed vLLM running, queueing and preempting"
    for n, text in enumerate(captures):
        page = tmp_path / f"vllm-{n}.prom"
        page.write_text(text)
        engine = metrics_of(text)
        (x,) = inspect_json(str(page))["replicas"]
        assert (x["kv_usage_ratio"], x["requests_running"], x["requests_waiting"]) == _gauges(engine)
        assert (x["preemptions_total"], x["generation_tokens_total"]) == _counters(engine)
        assert x["kv_capacity_tokens"] == 2560.0


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
