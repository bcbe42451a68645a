"""The simulated replica speaks vLLM's OpenAI API: the official openai client streams from it."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest

from kvwatch.sim.node import NodeConfig, SimNode
from tests.local import until

from .helpers import small_config

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def node_config(**overrides) -> NodeConfig:
    engine = small_config(
        num_gpu_blocks_override=2000, max_model_len=4000, max_num_seqs=64, max_num_batched_tokens=4096
    )
    return NodeConfig(engine=engine, **{"replicas": 1, "speed": 5.0, "tick_s": 0.01, **overrides})


@pytest.fixture
async def node():
    n = SimNode(node_config())
    await n.start()
    yield n
    await n.stop()


def client(node: SimNode, server: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=node.urls[server] + "/v1", api_key="unused", max_retries=0, timeout=30)


def hint(output_tokens: int, prompt_tokens: int | None = None) -> dict:
    h = {"output_tokens": output_tokens}
    if prompt_tokens is not None:
        h["prompt_tokens"] = prompt_tokens
    return {"kvwatch_sim": h}


async def test_chat_stream_with_usage_ends_with_stop_and_an_empty_choices_usage_chunk(node):
    async with client(node) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x" * 400}],
            stream=True,
            max_tokens=100,
            stream_options={"include_usage": True},
            extra_body=hint(40),
        )
        chunks = [ch async for ch in stream]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finishing = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert finishing == ["stop"] and chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert all(ch.usage is None for ch in chunks[:-1])
    assert content.count(" tok") == 40
    assert chunks[-1].usage.prompt_tokens == 100 + 3  # 400 chars / 4 + 3 for the message
    (e,) = node.engines
    assert (e.completed, e.stats.generation_tokens, e.used_blocks) == (1, 40, 0)


async def test_max_tokens_cut_streams_finish_reason_length(node):
    async with client(node) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            max_tokens=25,
            stream_options={"include_usage": True},
            extra_body=hint(500),
        )
        chunks = [ch async for ch in stream]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 25
    assert node.engines[0].truncated == 1


async def test_stream_without_include_usage_has_no_usage_chunk(node):
    async with client(node) as c:
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True, extra_body=hint(12)
        )
        chunks = [ch async for ch in stream]
    assert all(ch.choices for ch in chunks)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks).count(" tok") == 12


async def test_completions_stream_and_non_stream(node):
    async with client(node) as c:
        stream = await c.completions.create(
            model=MODEL,
            prompt="y" * 40,
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=hint(18),
        )
        chunks = [ch async for ch in stream]
        whole = await c.completions.create(model=MODEL, prompt="y" * 40, max_tokens=8, extra_body=hint(18))
        chat = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "z"}], extra_body=hint(7, prompt_tokens=321)
        )
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 18 and chunks[-1].usage.prompt_tokens == 10
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    assert whole.choices[0].text.count(" tok") == 8
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content.count(" tok") == 7
    assert chat.usage.prompt_tokens == 321 and chat.usage.total_tokens == 328


async def test_client_disconnect_aborts_the_request_and_frees_its_kv(node):
    (e,) = node.engines
    async with client(node) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x" * 800}],
            stream=True,
            max_tokens=3000,
            extra_body=hint(3000),
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        assert e.num_running == 1 and e.used_blocks > 0
        await stream.close()
    await until(lambda: e.aborted, what="the engine to abort the request of the client that left")
    assert e.aborted == 1 and e.in_system == 0
    assert e.used_blocks == 0 and e.live_tokens == 0  # freed in the abort itself, before any next step
    (view,) = [e.request(rid) for rid in list(e._finished)]
    assert view.state == "aborted" and view.generated_tokens < 3000


async def test_latencies_are_in_simulated_seconds_at_speed():
    n = SimNode(node_config(speed=4.0))
    await n.start()
    try:
        async with client(n) as c:
            started = time.monotonic()
            await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a"}], extra_body=hint(400)
            )
            wall = time.monotonic() - started
        (e,) = n.engines
        e2e = e.stats.h_e2e.sum  # simulated seconds (one request)
        # 400 decode steps of ~5.7 ms: ~2.3 s simulated, ~0.6 s wall at 4x; loose bounds for a busy host
        assert 1.5 < e2e < 4.0
        assert 0.3 < e2e / wall / 4.0 < 1.5
    finally:
        await n.stop()


async def test_models_health_version_and_metrics_endpoints(node):
    async with aiohttp.ClientSession() as s:
        async with s.get(node.urls[0] + "/health") as r:
            assert r.status == 200
        async with s.get(node.urls[0] + "/version") as r:
            assert (await r.json())["version"].startswith("0.33")
        async with s.get(node.urls[0] + "/v1/models") as r:
            card = (await r.json())["data"][0]
            assert card["id"] == MODEL and card["max_model_len"] == 4000
        async with s.get(node.urls[0] + "/metrics") as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert "vllm:kv_cache_usage_perc{" in await r.text()


async def test_bad_requests_get_openai_style_errors(node):
    async with client(node) as c:
        with pytest.raises(openai.BadRequestError, match="maximum context length is 4000"):
            await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=5000
            )
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await c.chat.completions.create(model="other", messages=[{"role": "user", "content": "a"}])
    async with aiohttp.ClientSession() as s:
        async with s.post(node.urls[0] + "/v1/chat/completions", data=b"{not json") as r:
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
        async with s.post(node.urls[0] + "/v1/completions", json={"prompt": {"a": 1}}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
    assert node.engines[0].arrived == 0


async def test_a_prefix_id_that_is_not_a_string_is_a_400_and_the_engine_keeps_serving():
    engine = small_config(num_gpu_blocks_override=2000, max_model_len=4000, enable_prefix_caching=True)
    n = SimNode(NodeConfig(engine=engine, replicas=1, speed=5.0, tick_s=0.01))
    await n.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            bad = {"prompt_tokens": 64, "output_tokens": 3, "prefix_id": ["system"], "prefix_tokens": 32}
            body = {"model": MODEL, "prompt": "a", "kvwatch_sim": bad}
            async with s.post(n.urls[0] + "/v1/completions", json=body) as r:
                assert r.status == 400
                assert "kvwatch_sim.prefix_id must be a string" in (await r.json())["error"]["message"]
            body["kvwatch_sim"] = {**bad, "prefix_id": "system"}
            async with s.post(n.urls[0] + "/v1/completions", json=body) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3
        assert n.engines[0].arrived == 1 and n.engines[0].completed == 1
    finally:
        await n.stop()


async def test_one_api_server_can_front_several_dp_ranks():
    n = SimNode(node_config(replicas=2, ranks_per_server=2))
    await n.start()
    try:
        assert len(n.urls) == 1 and n.replica_urls == n.urls * 2
        async with client(n) as c:
            await asyncio.gather(
                *(
                    c.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "a"}], extra_body=hint(50)
                    )
                    for _ in range(6)
                )
            )
        assert [e.completed for e in n.engines] == [3, 3]  # vLLM's internal LB spreads them
        async with aiohttp.ClientSession() as s, s.get(n.urls[0] + "/metrics") as r:
            text = await r.text()
        assert 'vllm:num_requests_running{engine="1"' in text
    finally:
        await n.stop()


async def test_continuous_usage_stats_puts_usage_on_every_chunk(node):
    async with aiohttp.ClientSession() as s:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a"}],
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "kvwatch_sim": {"output_tokens": 9},
        }
        async with s.post(node.urls[0] + "/v1/chat/completions", json=body) as r:
            events = [ln[6:] for ln in (await r.text()).split("\n\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(ev) for ev in events[:-1]]
    assert all("usage" in ch for ch in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
