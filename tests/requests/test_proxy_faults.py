"""Every failure the proxy must survive: the client sees the same kind of failure it would see from
the engine, the engine is released, the request is recorded with the right outcome, and kvwatch's
own problems never reach the client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import ClientSession

from kvwatch.config import ProxyConfig
from kvwatch.model import Outcome
from kvwatch.requests.accounting import PROMPT_BYTES_PER_TOKEN, RequestMeter
from kvwatch.requests.http1 import frame_chunk
from kvwatch.requests.proxy import ACCOUNTING_ERRORS, TIMED_OUT, USAGE_REFUSED
from tests.local import free_port, until

from .bodies import STREAMING_CHAT
from .raw_engine import raw_engine, read_request
from .scripted import DONE, ProxyHarness, Script, ScriptedEngine, chat_chunk, launch_proxy, proxied

# -- upstream failures ---------------------------------------------------------------------------


async def test_engine_refusing_connections_gives_502_and_error(http: ClientSession) -> None:
    async with proxied(f"http://127.0.0.1:{free_port()}") as harness:
        async with http.post(f"{harness.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
            assert response.status == 502
            assert "cannot connect to the engine" in (await response.json())["error"]["message"]
        [record] = harness.records
        assert (record.outcome, record.status_code) == (Outcome.ERROR, 502)
        assert harness.in_flight.current() == []


async def test_engine_5xx_is_relayed_and_recorded_as_error(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    engine.script = Script(status=503, error_body=b'{"error":"overloaded"}')
    async with http.post(f"{proxy.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
        assert (response.status, await response.read()) == (503, b'{"error":"overloaded"}')
    [record] = proxy.records
    assert (record.outcome, record.status_code) == (Outcome.ERROR, 503)


async def test_engine_4xx_is_relayed_and_recorded_as_rejected(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    engine.script = Script(status=400)
    async with http.post(f"{proxy.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
        assert response.status == 400
        assert await response.read() == engine.script.error_body
    [record] = proxy.records
    assert (record.outcome, record.status_code) == (Outcome.REJECTED, 400)
    # a 400 to the injected body is retried as the client wrote it; 400 again: not our doing
    assert [json.loads(s.body).get("stream_options") for s in engine.seen] == [{"include_usage": True}, None]
    assert proxy.server.metering.inject_usage


async def test_engine_that_refuses_stream_options_gets_the_clients_body_and_decides_nothing(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    """A refusal is one request's business: the next request is asked for usage again (one client must
    not switch usage counting off for a replica), and the refusal is counted for the operator."""
    engine.script = Script(reject_stream_options=True)
    for _ in range(2):
        async with http.post(f"{proxy.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
            assert response.status == 200
            assert (await response.read()).endswith(DONE)
    assert proxy.server.metering.inject_usage
    assert [b"stream_options" in s.body for s in engine.seen] == [True, False, True, False]
    assert proxy.count(USAGE_REFUSED, "r0") == 2
    assert [r.output_tokens_estimated for r in proxy.records] == [True, True]
    assert [r.outcome for r in proxy.records] == [Outcome.COMPLETED] * 2
    engine.script = Script()
    async with http.post(f"{proxy.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
        assert (await response.read()).endswith(DONE)
    assert not proxy.records[-1].output_tokens_estimated  # usage counted again at once


async def test_inject_usage_off_sends_every_body_as_written(
    engine: ScriptedEngine, http: ClientSession
) -> None:
    async with proxied(engine.url, config=ProxyConfig(inject_usage=False)) as harness:
        async with http.post(f"{harness.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
            assert (await response.read()).endswith(DONE)
        assert b"stream_options" not in engine.seen[-1].body
        assert harness.records[-1].output_tokens_estimated


async def test_engine_reset_mid_stream_cuts_the_clients_stream(http: ClientSession) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for event in (
            chat_chunk({"role": "assistant", "content": ""}),
            chat_chunk({"content": "a"}),
            chat_chunk({"content": "b"}),
        ):
            writer.write(frame_chunk(event))
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.transport.abort()

    async with raw_engine(handler) as url, proxied(url) as harness:
        received = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async with http.post(f"{harness.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
                assert response.status == 200
                async for data in response.content.iter_any():
                    received += data
        assert received.count(b"data: ") == 3  # everything the engine sent, then a cut
        await until(lambda: len(harness.records) == 1)
        [record] = harness.records
        assert (record.outcome, record.output_tokens) == (Outcome.ERROR, 2)
        assert record.output_tokens_estimated
        assert record.ttft_seconds is not None


async def test_engine_silent_past_the_read_timeout_gives_504(http: ClientSession) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    timeout = ProxyConfig(upstream_read_timeout_s=0.3)
    async with raw_engine(handler) as url, proxied(url, config=timeout) as harness:
        started = time.monotonic()
        async with http.post(f"{harness.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
            assert response.status == 504
        assert time.monotonic() - started < 5
        [record] = harness.records
        assert (record.outcome, record.status_code) == (Outcome.ERROR, 504)


async def test_malformed_engine_response_gives_502(http: ClientSession) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SPDY/9 nonsense\r\n\r\n")
        await writer.drain()

    async with (
        raw_engine(handler) as url,
        proxied(url) as harness,
        http.post(f"{harness.url}/v1/chat/completions", json=STREAMING_CHAT) as response,
    ):
        assert response.status == 502


async def test_a_finished_requests_exact_prompt_scales_the_live_estimate_of_the_next(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    """The body's size / 4 is all the proxy knows of a running request's prompt; the engine's usage at
    the end of one request teaches the replica's scale, so an identical request reads as counted."""
    engine.script = Script(contents=[(0.0, "tok")] * 3, prompt_tokens=170)
    async with http.post(f"{proxy.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
        await response.read()
    await until(lambda: len(proxy.records) == 1 and proxy.in_flight.current() == [])
    assert proxy.records[0].prompt_tokens == 170
    estimate = len(json.dumps(STREAMING_CHAT).encode()) // PROMPT_BYTES_PER_TOKEN
    assert estimate != 170  # the body alone says something else

    engine.script = Script(contents=[(0.05, "tok")] * 100, prompt_tokens=170)
    async with http.post(f"{proxy.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
        await response.content.readline()
        await until(lambda: len(proxy.in_flight.current()) == 1)
        [live] = proxy.in_flight.current()
        assert live.prompt_tokens_estimate == 170
        response.close()
    await until(lambda: proxy.in_flight.current() == [])


# -- client behaviour --------------------------------------------------------------------------------


async def test_client_disconnect_closes_upstream_at_once_and_is_aborted(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    engine.script = Script(contents=[(0.05, "tok")] * 200)
    body = {**STREAMING_CHAT, "max_tokens": 3000}
    async with http.post(f"{proxy.url}/v1/chat/completions", json=body) as response:
        seen = 0
        async for _ in response.content:
            seen += 1
            if seen >= 6:
                break
        await until(lambda: len(proxy.in_flight.current()) == 1)
        [live] = proxy.in_flight.current()
        assert (live.admission_band, live.generated_tokens > 0) == ("1k-5k", True)
        live_prompt_estimate = live.prompt_tokens_estimate
        response.close()
        left_at = time.perf_counter()
    await until(lambda: engine.seen[-1].disconnected_at is not None)
    assert engine.seen[-1].disconnected_at - left_at < 1.0
    await until(lambda: len(proxy.records) == 1)
    [record] = proxy.records
    assert record.outcome is Outcome.ABORTED and record.output_tokens_estimated
    assert 0 < record.output_tokens < 200
    # no usage ever came: the prompt is only estimated, from the size of the body the client sent
    assert record.prompt_tokens is None
    assert record.prompt_tokens_estimate == len(json.dumps(body).encode()) // PROMPT_BYTES_PER_TOKEN
    assert live_prompt_estimate == record.prompt_tokens_estimate  # the live view estimated the same
    assert proxy.in_flight.current() == []


async def test_request_body_over_the_limit_is_413_and_never_reaches_the_engine(
    engine: ScriptedEngine, http: ClientSession
) -> None:
    async with proxied(engine.url, config=ProxyConfig(max_body_bytes=1000)) as harness:
        big = {**STREAMING_CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        async with http.post(f"{harness.url}/v1/chat/completions", json=big) as response:
            assert response.status == 413
            assert "proxy.max_body_bytes" in (await response.json())["error"]["message"]
        assert engine.seen == []
        [record] = harness.records
        assert (record.outcome, record.status_code, record.model_name) == (Outcome.REJECTED, 413, "tiny")


async def test_chunked_request_body_over_the_limit_is_413(
    engine: ScriptedEngine, http: ClientSession
) -> None:
    harness = await launch_proxy(engine.url, config=ProxyConfig(max_body_bytes=1000))

    async def body() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"x" * 500

    try:
        async with http.post(f"{harness.url}/v1/chat/completions", data=body()) as response:
            assert response.status == 413
        assert engine.seen == []
    finally:
        await harness.server.stop()


async def test_chunked_request_body_is_forwarded_with_a_length(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    raw = json.dumps({**STREAMING_CHAT, "stream": False}).encode()

    async def body() -> AsyncIterator[bytes]:
        yield raw[:10]
        yield raw[10:]

    async with http.post(f"{proxy.url}/v1/chat/completions", data=body()) as response:
        assert response.status == 200
    assert engine.seen[-1].body == raw
    assert engine.seen[-1].headers["Content-Length"] == str(len(raw))


async def _read_until_closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)


async def test_slow_client_head_times_out_and_is_counted(engine: ScriptedEngine) -> None:
    async with proxied(engine.url, config=ProxyConfig(client_header_timeout_s=0.3)) as harness:
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.server.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # ... and never the rest
        answer = await _read_until_closed(reader, 5)
        assert answer.startswith(b"HTTP/1.1 408 ")
        writer.close()
        assert harness.count(TIMED_OUT, "r0") == 1
        assert engine.seen == []


async def test_slow_client_body_times_out(engine: ScriptedEngine) -> None:
    async with proxied(engine.url, config=ProxyConfig(client_header_timeout_s=0.3)) as harness:
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.server.port)
        writer.write(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"mo')
        assert (await _read_until_closed(reader, 5)).startswith(b"HTTP/1.1 408 ")
        writer.close()
        assert harness.count(TIMED_OUT, "r0") == 1


async def test_silent_connection_is_closed_and_counted(engine: ScriptedEngine) -> None:
    async with proxied(engine.url, config=ProxyConfig(client_header_timeout_s=0.3)) as harness:
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.server.port)
        assert await _read_until_closed(reader, 5) == b""
        writer.close()
        assert harness.count(TIMED_OUT, "r0") == 1


async def test_malformed_request_head_gets_400(proxy: ProxyHarness) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    writer.write(b"THIS IS NOT HTTP\r\n\r\n")
    assert (await _read_until_closed(reader, 5)).startswith(b"HTTP/1.1 400 ")
    writer.close()
    assert proxy.records == []


# -- kvwatch's own failures ---------------------------------------------------------------------------


class ExplodingMeter(RequestMeter):
    def on_events(self, events: bytes, separator: bytes, now: float) -> None:
        raise RuntimeError("accounting bug")


async def test_accounting_that_raises_never_touches_the_stream(
    engine: ScriptedEngine, http: ClientSession
) -> None:
    async with proxied(engine.url, meter_factory=ExplodingMeter) as harness:
        engine.script = Script(contents=[(0.0, "a"), (0.01, "b"), (0.01, "c")])
        async with http.post(f"{engine.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
            direct = await response.read()
        async with http.post(f"{harness.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
            relayed = await response.read()
        assert relayed == direct and b'"usage"' not in relayed  # still stripped
        assert harness.count(ACCOUNTING_ERRORS, "r0") == 1
        assert harness.records == []
        assert harness.in_flight.current() == []


class UnmadeMeter(RequestMeter):
    def __init__(self, *args: object) -> None:
        raise RuntimeError("accounting bug")


async def test_a_meter_that_cannot_be_made_leaves_the_request_unmetered_and_the_stream_whole(
    engine: ScriptedEngine, http: ClientSession
) -> None:
    """The meter is made after the request is written to the engine: failing there, the stream
    still reaches the client as the engine sent it (usage kvwatch asked for is stripped), one error
    is counted, and nothing is left in flight."""
    async with proxied(engine.url, meter_factory=UnmadeMeter) as harness:
        engine.script = Script(contents=[(0.0, "a"), (0.01, "b")])
        async with http.post(f"{engine.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
            direct = await response.read()
        async with http.post(f"{harness.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
            relayed = await response.read()
        assert relayed == direct and b'"usage"' not in relayed
        assert harness.count(ACCOUNTING_ERRORS, "r0") == 1
        assert harness.records == [] and harness.in_flight.current() == []


async def test_a_sink_that_raises_is_counted(engine: ScriptedEngine, http: ClientSession) -> None:
    def sink(record: object) -> None:
        raise OSError("disk full")

    async with proxied(engine.url, sink=sink) as harness:
        async with http.post(f"{harness.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
            assert response.status == 200 and (await response.read()).endswith(DONE)
        assert harness.count(ACCOUNTING_ERRORS, "r0") == 1


# -- hostile or odd input -------------------------------------------------------------------------------


async def test_unknown_model_names_fold_into_other(engine: ScriptedEngine, http: ClientSession) -> None:
    async with proxied(engine.url, known=frozenset({"alias"})) as harness:
        for model in ("tiny", "alias", "gpt-9000-" + "x" * 200, None):
            body = {k: v for k, v in {**STREAMING_CHAT, "model": model}.items() if v is not None}
            async with http.post(f"{harness.url}/v1/chat/completions", json=body) as response:
                await response.read()
        assert [r.model_name for r in harness.records] == ["tiny", "alias", "other", "tiny"]


async def test_served_model_names_are_learned_from_the_engine(
    engine: ScriptedEngine, http: ClientSession
) -> None:
    engine.models = ["served-a"]
    async with proxied(engine.url, model_name=None, learn_models=True) as harness:
        await until(lambda: "served-a" in harness.server.metering.labels.known)
        for model in ("served-a", "else", None):
            body = {k: v for k, v in {**STREAMING_CHAT, "model": model}.items() if v is not None}
            async with http.post(f"{harness.url}/v1/chat/completions", json=body) as response:
                await response.read()
        assert [r.model_name for r in harness.records] == ["served-a", "other", "served-a"]


@pytest.mark.parametrize("answer", [{"data": 5}, {"data": {"id": "x"}}])
async def test_a_model_list_that_is_none_is_asked_again(engine: ScriptedEngine, answer: object) -> None:
    """``{"data": 5}`` raised TypeError in the learner, which it did not catch, and ``{"data": {...}}``
    ended it with nothing learned: served names were never learned, so every request without a
    model name counted as ``other``. Now such an answer is asked again, as a failed one is."""
    engine.models, engine.models_answer = ["served-a"], answer
    async with proxied(engine.url, model_name=None, learn_models=True) as harness:
        await until(lambda: "served-a" in harness.server.metering.labels.known)
        assert engine.models_asked == 2


async def test_non_json_body_goes_to_the_engine_as_sent(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    async with http.post(
        f"{proxy.url}/v1/chat/completions", data=b"not json {", headers={"Content-Type": "application/json"}
    ) as response:
        assert response.status == 400
    assert engine.seen[-1].body == b"not json {"
    [record] = proxy.records
    assert (record.outcome, record.model_name) == (Outcome.REJECTED, "tiny")


async def test_other_paths_pass_through_untouched(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    headers = {"X-Custom": "kept", "Connection": "keep-alive, X-Hop", "X-Hop": "dropped"}
    async with http.put(
        f"{proxy.url}/admin/thing?x=1&y=%20", data=b"\x00\x01binary", headers=headers
    ) as response:
        assert (response.status, response.reason) == (218, "Engine Teapot")
        assert response.headers["X-Engine"] == "scripted"
        assert await response.read() == b"engine says: PUT /admin/thing?x=1&y=%20"
    seen = engine.seen[-1]
    assert seen.body == b"\x00\x01binary" and seen.headers["X-Custom"] == "kept"
    assert "X-Hop" not in seen.headers
    async with http.get(f"{proxy.url}/v1/models") as response:
        assert (await response.json())["data"][0]["id"] == "tiny"
    assert proxy.records == []  # only completions are measured


# -- keep-alive ---------------------------------------------------------------------------------------

_GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


async def _one_response(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
    )
    return head + await asyncio.wait_for(reader.readexactly(length), 5)


async def test_idle_keep_alive_outlives_the_head_timeout_then_closes_quietly(engine: ScriptedEngine) -> None:
    """A pooled client connection is not closed by the slow-loris timer: a client that reuses it
    after longer than ``client_header_timeout`` is served; only ``client_keepalive_timeout`` closes
    it, silently (an idle connection is not a slow client)."""
    async with proxied(
        engine.url, config=ProxyConfig(client_header_timeout_s=0.2, client_keepalive_timeout_s=0.8)
    ) as harness:
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.server.port)
        writer.write(_GET_MODELS)
        assert (await _one_response(reader)).startswith(b"HTTP/1.1 200 ")
        await asyncio.sleep(0.5)  # idle: past the head timeout, within the keep-alive one
        writer.write(_GET_MODELS)
        assert (await _one_response(reader)).startswith(b"HTTP/1.1 200 ")
        started = time.monotonic()
        assert await _read_until_closed(reader, 5) == b""
        assert 0.6 < time.monotonic() - started < 3
        writer.close()
        assert harness.count(TIMED_OUT, "r0") == 0
