"""Connecting to the engine on a request's behalf, where the connect is slow: one that completes
late (its first SYN dropped, the kernel's retransmit a second later accepted) still carries the
request, and one that never completes ends in a 504 at ``proxy.upstream_connect_timeout``, recorded
as an error, with nothing left in flight. Both on asyncio's loop and on uvloop, as every
``test_proxy_*`` module (conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator

from aiohttp import ClientSession

from kvwatch.config import ProxyConfig
from kvwatch.model import Outcome

from .bodies import STREAMING_CHAT
from .scripted import launch_proxy, proxied

ANSWER = (
    b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
)


@contextlib.contextmanager
def full_listener() -> Iterator[socket.socket]:
    """A listening socket whose accept queue is full (backlog 0, one connection waiting in it): the
    kernel drops a new connection's SYN, so that connect stays under way until the SYN is sent
    again (1 s later) and finds room."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname())
    try:
        yield listener
    finally:
        filler.close()
        listener.close()


async def test_a_connect_completed_by_the_syn_retransmit_still_carries_the_request(
    http: ClientSession,
) -> None:
    with full_listener() as listener:
        got: list[bytes] = []

        def engine() -> None:
            first, _ = listener.accept()  # the filler's: room for kvwatch's SYN when it comes again
            first.close()
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                got.append(data)
                conn.sendall(ANSWER)

        harness = await launch_proxy(f"http://127.0.0.1:{listener.getsockname()[1]}")
        timer = threading.Timer(0.3, engine)  # once kvwatch's first SYN was dropped
        timer.start()
        try:
            async with http.get(f"{harness.url}/health") as response:
                assert (response.status, await response.read()) == (200, b"{}")
        finally:
            await harness.server.stop()
            timer.join(5)
    assert got and got[0].startswith(b"GET /health HTTP/1.1\r\n")


async def test_a_connect_that_never_completes_is_a_504_at_the_connect_timeout(http: ClientSession) -> None:
    with full_listener() as listener:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        async with proxied(url, config=ProxyConfig(upstream_connect_timeout_s=0.4)) as harness:
            loop = asyncio.get_running_loop()
            started = loop.time()
            async with (
                asyncio.timeout(5),
                http.post(f"{harness.url}/v1/chat/completions", json=STREAMING_CHAT) as response,
            ):
                assert response.status == 504
                assert "timed out connecting to the engine" in (await response.json())["error"]["message"]
            waited = loop.time() - started
            assert 0.4 <= waited < 2.0
            [record] = harness.records
            assert (record.outcome, record.status_code) == (Outcome.ERROR, 504)
            assert harness.in_flight.current() == []
