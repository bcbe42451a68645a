"""Keep-alive connections to the engine: reused while fresh, never when unsafe, and a reused one the
engine had already closed costs the client nothing."""

from __future__ import annotations

import asyncio

from aiohttp import ClientSession

from kvwatch.model import Outcome
from tests.local import until

from .bodies import STREAMING_CHAT
from .raw_engine import raw_engine, read_request
from .scripted import ProxyHarness, Script, ScriptedEngine, proxied


async def test_sequential_requests_reuse_one_engine_connection(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    for _ in range(3):
        async with http.post(f"{proxy.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
            await response.read()
    assert len({s.peer for s in engine.seen}) == 1
    assert len(proxy.server.engine.pool.idle) == 1


async def test_concurrent_requests_use_separate_connections(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    engine.script = Script(contents=[(0.2, "slow")])

    async def one() -> None:
        async with http.post(f"{proxy.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
            await response.read()

    await asyncio.gather(one(), one(), one())
    assert len({s.peer for s in engine.seen}) == 3
    assert all(r.outcome is Outcome.COMPLETED for r in proxy.records)


async def test_aborted_exchange_never_returns_its_connection(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    engine.script = Script(contents=[(0.05, "tok")] * 100)
    async with http.post(f"{proxy.url}/v1/chat/completions", json=STREAMING_CHAT) as response:
        await response.content.readline()
        response.close()
    # the exchange is over (its record written) and the engine saw its connection closed
    await until(
        lambda: proxy.records and engine.seen[-1].disconnected_at is not None,
        what="the aborted exchange's record and the engine connection's close",
    )
    assert [r.outcome for r in proxy.records] == [Outcome.ABORTED]
    assert proxy.server.engine.pool.idle == []


async def test_a_pooled_connection_the_engine_closed_is_replaced_transparently(http: ClientSession) -> None:
    """The engine answers the first request on a connection and silently drops any later one (as a
    server whose keep-alive timer fired at the wrong moment does)."""
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        body = (
            b'{"choices":[{"message":{"content":"ok"},"finish_reason":"stop"}],'
            b'"usage":{"completion_tokens":1}}'
        )
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        await writer.drain()
        try:
            await read_request(reader)  # the reused connection's request: dropped unanswered
        except asyncio.IncompleteReadError:
            return  # kvwatch closed the idle connection itself (at shutdown)
        writer.transport.abort()

    async with raw_engine(handler) as url, proxied(url) as harness:
        for _ in range(3):
            body = {**STREAMING_CHAT, "stream": False}
            async with http.post(f"{harness.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200 and b'"ok"' in await response.read()
        assert connections == 3  # the first, then each reuse dropped and retried on a new one
        assert [r.outcome for r in harness.records] == [Outcome.COMPLETED] * 3


async def test_engine_saying_connection_close_is_not_pooled(http: ClientSession) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async with raw_engine(handler) as url, proxied(url) as harness:
        async with http.get(f"{harness.url}/health") as response:
            assert await response.read() == b"ok"
        assert harness.server.engine.pool.idle == []


async def test_the_engine_keeps_warm_connections_in_proportion_to_demand() -> None:
    """Spares follow measured demand: after requests that saw 6 at once, as they end, idle
    connections are opened until idle + in flight covers the demand (no request waits for a connect);
    never more than MAX_WARM however high demand goes; and idle past the pool's timeout, closed."""
    from kvwatch.requests.proxy.pool import MAX_WARM, Engine, EnginePool, UpstreamAddress

    accepted: list[asyncio.StreamWriter] = []
    closed = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal closed
        accepted.append(writer)
        await reader.read()  # until kvwatch closes it
        closed += 1

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = Engine(UpstreamAddress.from_url(f"http://127.0.0.1:{port}"), 2.0, EnginePool(idle_s=0.5))
    try:
        for _ in range(30):  # a steady 6 in flight: each arrival sees 6, itself included
            engine.in_flight = 5
            engine.begin()
        assert round(engine.demand) == 6
        for _ in range(2):
            engine.end()
        await until(lambda: len(engine.pool.idle) == 2, what="two spares for the two requests that ended")
        await asyncio.sleep(0.05)
        assert len(accepted) == 2  # no more than demand expects: 4 in flight + 2 idle = 6

        for _ in range(200):  # demand far above the cap
            engine.begin()
        engine.in_flight = 0  # and all of it over
        engine.keep_warm()
        await until(lambda: len(engine.pool.idle) >= MAX_WARM, timeout_s=10, what="warm up to the cap")
        await asyncio.sleep(0.1)
        engine.keep_warm()
        await asyncio.sleep(0.1)
        assert len(engine.pool.idle) == MAX_WARM and len(accepted) == MAX_WARM

        # nobody uses them: closed once idle past the pool's idle_s
        await until(lambda: not engine.pool.idle, timeout_s=5, what="idle spares closed")
        await until(lambda: closed == len(accepted), what="the engine saw every spare closed")
    finally:
        await engine.stop()
        server.close()
        for writer in accepted:
            writer.close()
        await server.wait_closed()
