"""``kvwatch inspect`` against a real llama-server agrees with its own /metrics and /slots.

Same bracketing as the vLLM test (engine A, inspect X, engine B): counters A <= X <= B always; the
``requests_processing`` gauge equal to A's when A == B, but for a dip below it in at most a
quarter of those windows: a window spans ``kvwatch inspect``'s start (hundreds of decode steps), in
which 2-5 requests end and the next begin, and a read between an end and the next start sees that
slot idle; both slots can be between requests at once (a clean-clone CI run caught two dips of one
in one run, a later one a dip of two, 2 -> 0 -> 2). Never above A: kvwatch reports no slot busy
that the engine did not show busy.
The tiny model generates thousands of tokens/s, so four client threads keep both slots busy.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import openai
import pytest

from kvwatch.agent.engines import scrape_target
from kvwatch.config import ReplicaConfig, ScrapeConfig
from kvwatch.model import LengthBands
from kvwatch.state import NodeState
from tests.local import free_port, start_llama_server, stop_group, wait_until

from .real_checks import engine_metrics, inspect_json, value

pytestmark = pytest.mark.real_llamacpp


def _slots(base_url: str) -> list[dict]:
    return httpx.get(f"{base_url}/slots", timeout=30.0).json()


def _hammer(base_url: str, model: str, stop: threading.Event) -> int:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=60)
    done = 0
    while not stop.is_set():
        client.completions.create(
            model=model, prompt="hello world the a", max_tokens=200, extra_body={"ignore_eos": True}
        )
        done += 1
    return done


def _wait_idle(real) -> None:
    wait_until(
        lambda: value(engine_metrics(real.metrics_url), "llamacpp:requests_processing") == 0,
        60,
        "llama-server to go idle",
        interval_s=0.2,
    )


def test_inspect_agrees_with_llamacpp_under_load(real_llamacpp):
    real, url = real_llamacpp, real_llamacpp.metrics_url
    steady, disagreeing, caught_live = 0, [], 0
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(_hammer, real.base_url, real.model, stop) for _ in range(4)]
        try:
            deadline = time.monotonic() + 6.0
            while time.monotonic() < deadline:
                a = engine_metrics(url)
                doc = inspect_json(url)
                b = engine_metrics(url)
                (x,) = doc["replicas"]
                predicted = "llamacpp:tokens_predicted_total"
                assert value(a, predicted) <= x["generation_tokens_total"] <= value(b, predicted)
                busy_a, busy_b = (value(m, "llamacpp:requests_processing") for m in (a, b))
                if busy_a == busy_b:
                    if x["requests_running"] == busy_a:
                        steady += 1
                    else:
                        disagreeing.append((busy_a, x["requests_running"]))
                assert x["kv_capacity_tokens"] == 512.0  # -c 512 split over 2 slots
                caught_live += (x["live_tokens"] or 0) > 0
        finally:
            stop.set()
            requests_done = sum(f.result() for f in futures)
    assert requests_done > 10
    assert all(0 <= seen < busy for busy, seen in disagreeing), disagreeing
    assert len(disagreeing) <= steady // 4, (steady, disagreeing)
    assert steady >= 3
    assert caught_live >= 1, "never saw a processing slot: /slots not read while busy?"


def test_idle_slots_keep_their_tokens_as_evictable(real_llamacpp):
    real = real_llamacpp
    _wait_idle(real)
    slots = _slots(real.base_url)
    doc = inspect_json(real.metrics_url)
    (x,) = doc["replicas"]
    assert x["kv_capacity_tokens"] == sum(s["n_ctx"] for s in slots) == 512
    assert x["live_tokens"] == 0.0 and x["requests_running"] == 0.0
    assert x["kv_evictable_tokens"] == sum(s.get("n_prompt_tokens", 0) for s in slots)
    assert [s["tokens_in_use"] for s in doc["slots"]] == [s.get("n_prompt_tokens") for s in slots]
    engine = engine_metrics(real.metrics_url)
    assert x["generation_tokens_total"] == value(engine, "llamacpp:tokens_predicted_total")
    assert x["prefix_cache_hits_total"] == value(engine, "llamacpp:prompt_tokens_cached_total")


async def test_scraper_reads_metrics_and_slots_of_the_real_server(real_llamacpp):
    state = NodeState("n", LengthBands())
    async with httpx.AsyncClient() as client:
        await scrape_target(
            client,
            ReplicaConfig("cpu-llama", real_llamacpp.metrics_url, model_name="tiny"),
            ScrapeConfig(timeout_s=30),
            state,
        )
    target = state.target("cpu-llama")
    assert target.up and target.backend == "llamacpp", target.last_error
    assert target.extra_page_error is None
    (s,) = target.samples
    assert s.version_hint.endswith("KV from /slots (2 slots)")
    assert (s.model_name, s.kv_capacity_tokens) == ("tiny", 512.0)


async def test_a_default_llama_server_s_shared_pool_is_the_configured_capacity(tmp_path):
    """Without -np, llama-server runs 4 slots sharing one pool (kv_unified), and /slots gives each slot
    the whole pool: their sum was kvwatch's capacity, 4x the pool (here 2x: the tiny model's training
    context of 512 caps each slot's n_ctx at 512 of the 1024 cells). kv_capacity_tokens says the pool."""
    port = free_port()
    proc = start_llama_server(port, tmp_path / "llama.log", "-c", "1024", "-t", "1")
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    try:
        slots = httpx.get(f"http://127.0.0.1:{port}/slots", timeout=30.0).json()
        assert [s["n_ctx"] for s in slots] == [512] * 4  # the shared pool is 1024 cells
        state = NodeState("n", LengthBands())
        async with httpx.AsyncClient() as client:
            for name, configured in (("summed", None), ("configured", 1024)):
                replica = ReplicaConfig(name, metrics_url, model_name="tiny", kv_capacity_tokens=configured)
                await scrape_target(client, replica, ScrapeConfig(timeout_s=30), state)
        (summed,) = state.target("summed").samples
        assert (
            summed.kv_capacity_tokens == 2048.0 and "set kv_capacity_tokens to its -c" in summed.version_hint
        )
        (configured,) = state.target("configured").samples
        assert configured.kv_capacity_tokens == 1024.0 and configured.kv_usage_ratio == 0.0
    finally:
        stop_group(proc.pid, grace_s=5.0)
        proc.wait(timeout=10)
