"""A client written against the socket, for the bytes an attacker sends and no HTTP client library
would (bad chunk sizes, bare line feeds, smuggled requests); the hostile-input tests are split over
more than one module and send them the same way."""

from __future__ import annotations

import asyncio
import time

from .scripted import ProxyHarness

CHUNKED_POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


async def send_raw(url: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Write ``data`` in one write and read until the proxy closes (the requests ask it to)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def body_of(response: bytes) -> bytes:
    return response.split(b"\r\n\r\n", 1)[1]


async def still_serving(proxy: ProxyHarness) -> None:
    """The loop is not wedged: a plain request is answered at once."""
    started = time.monotonic()
    response = await send_raw(proxy.url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_of(response) == 218 and time.monotonic() - started < 2
