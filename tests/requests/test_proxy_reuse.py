"""A request on a reused (keep-alive) client connection: "received" is its first byte, always, and it
never waits for anything a direct connection would not make it wait for.

* True pipelining (the client sends before its previous response is complete): HTTP order is kept,
  and the time the request waited behind the previous response is in its TTFT and e2e.
* An engine that ends its stream late after ``[DONE]`` (vLLM's frontend does, under load): the client
  has its whole response at ``[DONE]``, and its next request goes to the engine at once, on another
  engine connection (a spare opened as soon as the tail was seen pending), while the late tail is
  read on its own and the connection pooled again.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import ClientSession

from kvwatch.model import Outcome
from kvwatch.requests.http1 import frame_chunk
from tests.local import until

from .bodies import STREAMING_CHAT
from .raw_engine import raw_engine, read_request
from .scripted import DONE, ProxyHarness, Script, ScriptedEngine, chat_chunk, proxied


def _request(body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )


async def _read_response(reader: asyncio.StreamReader) -> bytes:
    """One chunked response, through its last-chunk marker."""
    head = await reader.readuntil(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return body
        body += chunk[:-2]


async def test_a_pipelined_request_is_received_at_its_first_byte(
    engine: ScriptedEngine, proxy: ProxyHarness
) -> None:
    engine.script = Script(contents=[(0.1, "a"), (0.1, "b"), (0.1, "c")])  # ~0.3 s per response
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    try:
        writer.write(_request({**STREAMING_CHAT, "max_tokens": 7}))
        await asyncio.sleep(0.1)
        second_sent = time.time()
        writer.write(_request({**STREAMING_CHAT, "max_tokens": 9}))  # pipelined: the first is still streaming
        first, second = await _read_response(reader), await _read_response(reader)
    finally:
        writer.close()
    assert b'"a"' in first and b"[DONE]" in first and b"[DONE]" in second  # HTTP order kept
    await until(lambda: len(proxy.records) == 2)
    one, two = proxy.records
    assert (one.max_tokens, two.max_tokens) == (7, 9)
    assert abs(two.started_at - second_sent) < 0.02  # its first byte, not when the first response ended
    waited = one.started_at + one.e2e_seconds - two.started_at  # behind the first response, in kvwatch
    assert waited > 0.1
    assert two.ttft_seconds >= waited + 0.1  # the wait plus the engine's own time to its first token
    assert engine.seen[1].received >= engine.seen[0].done_at  # type: ignore[operator]


async def test_a_late_stream_end_after_done_costs_the_next_request_nothing(http: ClientSession) -> None:
    """The engine writes ``[DONE]`` and its last-chunk marker 1 s apart."""
    tail_s = 1.0
    received: list[tuple[float, tuple]] = []  # (when the engine read a request, kvwatch's side)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            received.append((time.perf_counter(), writer.get_extra_info("peername")))
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for event in (chat_chunk({"content": "hi"}), chat_chunk({}, "stop"), DONE):
                writer.write(frame_chunk(event))
            await writer.drain()
            await asyncio.sleep(tail_s)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with raw_engine(handler) as url, proxied(url) as harness:
        ends = []
        for _ in range(2):  # one keep-alive client connection (aiohttp's pool)
            sent = time.perf_counter()
            async with http.post(f"{harness.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
                assert b"[DONE]" in await response.read()
            ends.append(time.perf_counter() - sent)
        assert max(ends) < tail_s / 2  # the response ended at [DONE], not at the engine's marker
        assert received[1][0] - received[0][0] < tail_s / 2  # the second request went at once ...
        assert received[1][1] != received[0][1]  # ... on another engine connection
        assert [r.outcome for r in harness.records] == [Outcome.COMPLETED] * 2
        assert all(r.e2e_seconds < tail_s / 2 for r in harness.records)

        # the tails are read on their own and both connections go back to the pool (beside any
        # spare opened while a tail was pending)
        def pooled() -> set:
            return {c.transport.get_extra_info("sockname") for c in harness.server.engine.pool.idle}

        await until(lambda: {received[0][1], received[1][1]} <= pooled(), timeout_s=3 * tail_s)


async def test_a_tail_that_never_ends_closes_its_engine_connection(http: ClientSession, monkeypatch) -> None:
    monkeypatch.setattr("kvwatch.requests.proxy.pool.DRAIN_S", 0.2)
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
            + frame_chunk(chat_chunk({"content": "hi"}) + chat_chunk({}, "stop") + DONE)
        )
        await writer.drain()
        await reader.read()  # nothing more from us; kvwatch gives up on the tail and closes
        closed.set()

    async with raw_engine(handler) as url, proxied(url) as harness:
        async with http.post(f"{harness.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
            assert b"[DONE]" in await response.read()
        await asyncio.wait_for(closed.wait(), 2)
        spares = harness.server.engine.pool.idle  # opened for a next request while the tail was pending
        assert len(spares) == 1 and spares[0].reads == 0 and not spares[0].closed
        assert [r.outcome for r in harness.records] == [Outcome.COMPLETED]
