"""The proxy in front of real engines (CPU vLLM 0.32, llama.cpp), driven by the official ``openai``
client, and the OTLP receiver fed by a real vLLM's spans.

What is compared with the engine's own numbers, and why the definitions allow the difference:
kvwatch's TTFT starts when the request reaches kvwatch and ends when the first content chunk leaves
it, so it contains the engine's TTFT (arrival in the engine's frontend -> first token) plus the hops;
per request kvwatch TTFT >= engine TTFT, and request counts are equal.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
from aiohttp import ClientSession

from kvwatch.config import Config, HostPort, OtlpConfig, ReplicaConfig
from kvwatch.model import Outcome, RequestRecord
from kvwatch.requests.otlp import OtlpReceiver
from tests.local import free_port, start_llama_server, stop_group, until

from .real_vllm import CHAT, CLOSED_WITHIN_S, LONG, disconnect_attempts, metric, vllm_metrics
from .scripted import ProxyHarness, launch_proxy, proxied


def normalized(raw: bytes) -> bytes:
    """The parts of a vLLM stream that differ between two identical requests: id and created."""
    raw = re.sub(rb'"id":"[^"]*"', b'"id":""', raw)
    return re.sub(rb'"created":\d+', b'"created":0', raw)


@pytest.fixture
async def vllm_proxy(real_vllm) -> AsyncIterator[ProxyHarness]:
    harness = await launch_proxy(real_vllm.base_url, model_name=None, learn_models=True)
    await until(lambda: "tiny" in harness.server.metering.labels.known, timeout_s=30)
    yield harness
    await harness.server.stop()


@pytest.mark.real_vllm
@pytest.mark.slow
async def test_openai_client_streams_through_the_proxy_to_vllm(real_vllm, vllm_proxy: ProxyHarness) -> None:
    client = openai.AsyncOpenAI(base_url=f"{vllm_proxy.url}/v1", api_key="unused", max_retries=0)
    try:
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="tiny",
                messages=CHAT,
                max_tokens=24,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        ]  # random weights may end early
        assert chunks and all(c.usage is None and c.choices for c in chunks)  # no usage chunk leaked
        text_chunks = [
            c
            async for c in await client.completions.create(
                model="tiny",
                prompt="Once upon a time",
                max_tokens=16,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        ]
        assert text_chunks and all(c.usage is None for c in text_chunks)
        usage = await client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        last = [c async for c in usage][-1]
        assert last.usage is not None and last.usage.completion_tokens == 8
    finally:
        await client.close()
    chat, completion, asked = vllm_proxy.records
    assert (chat.endpoint, chat.output_tokens, chat.output_tokens_estimated) == ("chat", 24, False)
    assert (completion.endpoint, completion.output_tokens) == ("completions", 16)
    assert asked.output_tokens == 8
    assert all(r.outcome is Outcome.TRUNCATED and r.model_name == "tiny" for r in vllm_proxy.records)
    assert all(r.ttft_seconds is not None and 0 < r.ttft_seconds <= r.e2e_seconds for r in vllm_proxy.records)
    for r in vllm_proxy.records:  # the longest gap lies inside the stream, dated on the wall clock
        assert 0 <= r.max_gap_seconds <= r.e2e_seconds - r.ttft_seconds + 1e-6
        gap_end = r.max_gap_ended_at - r.started_at
        assert r.ttft_seconds - 1e-6 <= gap_end <= r.e2e_seconds + 1e-6


@pytest.mark.real_vllm
@pytest.mark.slow
async def test_vllm_stream_through_the_proxy_is_what_vllm_sends(
    real_vllm, vllm_proxy: ProxyHarness, http: ClientSession
) -> None:
    for path, request in (
        ("/v1/chat/completions", {"model": "tiny", "messages": CHAT}),
        ("/v1/completions", {"model": "tiny", "prompt": "Once upon a time"}),
    ):
        body = {**request, "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True}
        # vLLM merges deltas into fewer chunks when its frontend falls behind (a loaded 2-core
        # machine), so two identical requests can be chunked differently: a proxy that changed
        # bytes fails every attempt, engine-side timing only some
        pairs = []
        for _attempt in range(3):
            async with http.post(f"{real_vllm.base_url}{path}", json=body) as response:
                direct = await response.read()
            async with http.post(f"{vllm_proxy.url}{path}", json=body) as response:
                proxied = await response.read()
            assert b'"usage"' not in proxied and b"system_fingerprint" in proxied
            pairs.append((normalized(proxied), normalized(direct)))
            if pairs[-1][0] == pairs[-1][1]:
                break
        assert pairs[-1][0] == pairs[-1][1], pairs


async def _stream_exactly(client: openai.AsyncOpenAI, max_tokens: int) -> None:
    """One streamed chat completion of ``max_tokens`` tokens, read to its end by the SDK.
    ``ignore_eos``: the random-weight model may end early; every request must hit ``max_tokens``."""
    async for _ in await client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True}
    ):
        pass


@pytest.mark.real_vllm
@pytest.mark.slow
async def test_counts_and_ttft_agree_with_vllms_own_histograms(real_vllm, vllm_proxy: ProxyHarness) -> None:
    before = await vllm_metrics(real_vllm)
    client = openai.AsyncOpenAI(base_url=f"{vllm_proxy.url}/v1", api_key="unused", max_retries=0)
    try:
        for max_tokens in (5, 10, 20):
            await _stream_exactly(client, max_tokens)
    finally:
        await client.close()

    async def finished_recorded() -> str:  # vLLM records finished-request stats on its next loop turn
        text = await vllm_metrics(real_vllm)
        counted = [
            metric(text, name) - metric(before, name)
            for name in ("vllm:request_success_total", "vllm:time_to_first_token_seconds_count")
        ]
        return text if min(counted) >= 3 else ""

    after = await until(finished_recorded, 10, "vLLM's own counts of the three requests", interval_s=0.1)
    success = metric(after, "vllm:request_success_total") - metric(before, "vllm:request_success_total")
    ttft_count = metric(after, "vllm:time_to_first_token_seconds_count") - metric(
        before, "vllm:time_to_first_token_seconds_count"
    )
    ttft_sum = metric(after, "vllm:time_to_first_token_seconds_sum") - metric(
        before, "vllm:time_to_first_token_seconds_sum"
    )
    records = vllm_proxy.records
    assert len(records) == success == ttft_count == 3
    assert sum(r.ttft_seconds for r in records) >= ttft_sum
    length = metric(after, "vllm:request_success_total", finished_reason="length") - metric(
        before, "vllm:request_success_total", finished_reason="length"
    )
    assert length == sum(r.outcome is Outcome.TRUNCATED for r in records) == 3


@pytest.mark.real_vllm
@pytest.mark.slow
async def test_client_disconnect_closes_the_engine_connection_and_vllm_aborts(real_vllm) -> None:
    """The client leaves at the first content chunk of a 1900-token request. On the wire (tcpdump),
    the proxy's FIN or RST reaches vLLM within ``CLOSED_WITHIN_S`` of the client's FIN, in every
    attempt in which vLLM was still generating. vLLM then aborts: V1 does not count aborted requests
    in ``request_success_total``, so that is read from ``generation_tokens_total``, which stops
    short of 1900, with ``num_requests_running`` back to 0.

    An attempt where vLLM finished the request before it noticed (``real_vllm.py`` says when that
    happens) proves nothing about kvwatch and is repeated, at most five times. In two clean-clone
    runs the first chunk took 8.8 and 9.3 s to reach the client, vLLM generated all 1900 tokens,
    and the first FIN to reach it came 0.32-0.33 s after the client's: ``QUIET_S``, then the
    test's own poll. A proxy that kept the engine's connection fails the first assertion: vLLM
    would finish every attempt."""
    seen = await disconnect_attempts(real_vllm.base_url)
    attempts = seen["attempts"]
    assert attempts[-1]["generated"] < LONG, f"vLLM finished before it saw the client go: {attempts}"
    aborted = [a for a in attempts if a["generated"] < LONG]
    assert all(a["upstream_closed_s"] < CLOSED_WITHIN_S for a in aborted), (
        f"the proxy kept the engine's: {attempts}"
    )
    assert seen["running_after"] == 0
    assert seen["outcome"] == Outcome.ABORTED.value and 0 < seen["output_tokens"] < LONG, seen


# -- llama.cpp ---------------------------------------------------------------------------------------


@pytest.fixture
async def llama_proxy(real_llamacpp) -> AsyncIterator[ProxyHarness]:
    harness = await launch_proxy(real_llamacpp.base_url, model_name=real_llamacpp.model)
    yield harness
    await harness.server.stop()


async def _busy_slots(base: str) -> int:
    async with httpx.AsyncClient() as client:
        slots = (await client.get(f"{base}/slots", timeout=5)).json()
    return sum(1 for s in slots if s.get("is_processing"))


@pytest.mark.real_llamacpp
async def test_openai_client_streams_through_the_proxy_to_llamacpp(
    real_llamacpp, llama_proxy: ProxyHarness
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{llama_proxy.url}/v1", api_key="unused", max_retries=0)
    try:
        # random weights: without ignore_eos the first token can be the end of the answer
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model=real_llamacpp.model,
                messages=CHAT,
                max_tokens=16,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        ]
        text_chunks = [
            c
            async for c in await client.completions.create(
                model=real_llamacpp.model,
                prompt="hello",
                max_tokens=16,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        ]
    finally:
        await client.close()
    assert chunks and text_chunks
    assert not any(c.usage is not None and not c.choices for c in chunks)  # no usage-only chunk leaked
    chat, completion = llama_proxy.records
    for rec in (chat, completion):
        assert rec.outcome in (Outcome.COMPLETED, Outcome.TRUNCATED)
        assert rec.output_tokens is not None and 0 < rec.output_tokens <= 16
        assert rec.ttft_seconds is not None and rec.model_name == real_llamacpp.model


def _timeless(raw: bytes) -> bytes:
    """A llama.cpp stream less what differs between two identical requests: ids, times, speeds, and
    how much of the prompt the second found cached (``cache_n``, ``prompt_n``)."""
    return re.sub(rb'"([a-z_]+_(?:ms|per_second|n))":[-0-9.e+]+', rb'"\1":0', normalized(raw))


@pytest.mark.real_llamacpp
async def test_llamacpp_chat_stream_through_the_proxy_is_what_llamacpp_sends(
    real_llamacpp, llama_proxy: ProxyHarness, http: ClientSession
) -> None:
    # llama.cpp writes "timings" on the last chunk: the usage chunk kvwatch asks for and removes,
    # which took "timings" with it (the client's tokens-per-second readout)
    body = {
        "model": real_llamacpp.model,
        "messages": CHAT,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    async with http.post(f"{real_llamacpp.base_url}/v1/chat/completions", json=body) as response:
        direct = await response.read()
    async with http.post(f"{llama_proxy.url}/v1/chat/completions", json=body) as response:
        proxied = await response.read()
    assert b'"timings"' in direct and b'"usage"' not in direct
    assert _timeless(proxied) == _timeless(direct)


def _leave_after_first_event(port: int, body: dict) -> None:
    """A client on its own socket and thread (not on the proxy's loop): first event, then gone."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        received = b""
        while b"data: " not in received:
            data = sock.recv(65536)
            assert data, "the proxy closed before the first event"
            received += data


@pytest.fixture(scope="module")
def long_context_llamacpp(real_llamacpp) -> Iterator[str]:
    """The session's llama-server fills its 256-token slot in ~30 ms (9k tokens/s here): faster than
    a disconnect travels. This one, same binary and model, has one 16k-token slot. llama-server caps
    a slot at the model's training context (512 for the tiny model), hence the override: without it
    the generation ends by itself at ~500 tokens and the test below would prove nothing."""
    port = free_port()
    proc = start_llama_server(
        port,
        real_llamacpp.log.with_name(f"llama-long-{port}.log"),
        "-c",
        "16384",
        "-np",
        "1",
        "-t",
        "1",
        "--override-kv",
        "llama.context_length=int:16384",
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(proc.pid)
        proc.wait(timeout=10)


async def _metric_of(base: str, name: str) -> float:
    async with httpx.AsyncClient() as client:
        return metric((await client.get(f"{base}/metrics", timeout=5)).text, name)


@pytest.mark.real_llamacpp
async def test_client_disconnect_frees_the_llamacpp_slot(long_context_llamacpp: str) -> None:
    base = long_context_llamacpp
    async with proxied(base, model_name=None) as harness:
        predicted = await _metric_of(base, "llamacpp:tokens_predicted_total")
        body = {"prompt": "hello", "max_tokens": 16000, "stream": True, "ignore_eos": True}
        await asyncio.to_thread(_leave_after_first_event, harness.server.port, body)

        async def freed() -> bool:
            return await _busy_slots(base) == 0

        await until(freed, 1.0, "llama.cpp to free the slot of a client that left", interval_s=0.05)
        await until(lambda: len(harness.records) == 1)
        assert harness.records[0].outcome is Outcome.ABORTED
        generated = await _metric_of(base, "llamacpp:tokens_predicted_total") - predicted
        assert generated < 8000, f"llama.cpp generated {generated:.0f} tokens for a client that left"


# -- OTLP from a real vLLM -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced_vllm(real_vllm) -> tuple[str, int]:
    """The session's vLLM exports OTLP/HTTP spans to a port nobody listens on until this test: (base
    url, OTLP port)."""
    assert real_vllm.otlp_port is not None
    return real_vllm.base_url, real_vllm.otlp_port


@pytest.mark.real_vllm
@pytest.mark.slow
async def test_otlp_spans_from_real_vllm_match_the_proxys_view(traced_vllm: tuple[str, int]) -> None:
    base, otlp_port = traced_vllm
    spans: list[RequestRecord] = []
    config = Config(
        replicas=(ReplicaConfig("r0", f"{base}/metrics", api_url=base, model_name="tiny"),),
        otlp=OtlpConfig(listen=HostPort("127.0.0.1", otlp_port)),
    )
    ours_since = time.time()

    def keep_ours(record: RequestRecord) -> None:
        """The shared engine may still export (retrying) the spans of an earlier test's requests."""
        if record.started_at >= ours_since:
            spans.append(record)

    receiver = OtlpReceiver(config, keep_ours, lambda *a, **k: None)
    await receiver.start()
    proxy = await launch_proxy(base)
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)
    try:
        for max_tokens in (4, 9, 17):
            await _stream_exactly(client, max_tokens)
        await until(lambda: len(spans) == 3, timeout_s=60)  # BatchSpanProcessor exports every ~5 s
    finally:
        await client.close()
        await proxy.server.stop()
        await receiver.stop()
    spans.sort(key=lambda r: r.started_at)
    assert [r.output_tokens for r in spans] == [4, 9, 17] == [r.output_tokens for r in proxy.records]
    assert [r.max_tokens for r in spans] == [4, 9, 17]
    for span, seen in zip(spans, proxy.records, strict=True):
        assert (span.source, span.replica, span.model_name) == ("otlp", "r0", "tiny")
        assert span.queue_seconds is not None and span.tpot_seconds is not None
        assert seen.ttft_seconds >= span.ttft_seconds
        assert seen.e2e_seconds >= span.e2e_seconds
    print(json.dumps([[s.ttft_seconds, p.ttft_seconds] for s, p in zip(spans, proxy.records, strict=True)]))
