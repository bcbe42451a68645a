"""Hostile input at the proxy, round two: a client can neither flood the log nor make kvwatch hand
handled errors to asyncio, and chunk sizes are refused as soon as they say too much."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvloop

from kvwatch.config import ProxyConfig
from kvwatch.requests.proxy import ACCEPT_ERRORS, REFUSED, REFUSED_CLIENT_GONE
from tests.local import until

from .raw_client import CHUNKED_POST, send_raw, status_of, still_serving
from .scripted import ProxyHarness, ScriptedEngine, launch_proxy, proxied

#: a bare LF inside a header value: refused with 400 while the head is parsed
BARE_LF_HEAD = b"GET /x HTTP/1.1\r\nHost: x\r\nX-A: a\nB: c\r\n\r\n"


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What reaches the loop's exception handler (asyncio would print each with its traceback)."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    yield seen
    loop.set_exception_handler(previous)


async def send_and_close_at_once(port: int, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, data)
    finally:
        sock.close()


async def test_a_refusal_to_a_client_that_already_left_is_counted_and_not_an_error(
    loop_errors: list, engine: ScriptedEngine, caplog
) -> None:
    """Before: ``_refuse`` called ``write_eof()`` on the dead socket (ENOTCONN) and asyncio logged
    "Exception in callback ClientConnection._parse_scheduled()" with its traceback, every time."""
    harness = await launch_proxy(engine.url)  # after loop_errors: the proxy's handler chains to it
    try:
        tries = 20
        for _ in range(tries):
            await send_and_close_at_once(harness.server.port, BARE_LF_HEAD)
        # each refusal ends counted, or (the failure this guards against) handed to the loop
        await until(
            lambda: harness.count(REFUSED, "r0", "400") + len(loop_errors) >= tries,
            what=f"the {tries} refusals handled",
        )
        assert loop_errors == []
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert harness.count(REFUSED, "r0", "400") == tries
        gone = harness.count(REFUSED_CLIENT_GONE, "r0", "400")
        # asyncio's loop reads a client's EOF with its bytes, so some answers find the connection
        # closed; uvloop reads the EOF in a later read, after the answer went to the kernel
        assert gone <= tries and (gone > 0 or isinstance(asyncio.get_running_loop(), uvloop.Loop))
        await still_serving(harness)
    finally:
        await harness.server.stop()


async def test_a_refusal_the_client_reads_is_counted_as_delivered(proxy: ProxyHarness) -> None:
    response = await send_raw(proxy.url, BARE_LF_HEAD)
    assert status_of(response) == 400
    assert proxy.count(REFUSED, "r0", "400") == 1 and proxy.count(REFUSED_CLIENT_GONE, "r0", "400") == 0


async def test_failed_accepts_are_counted_logged_once_and_not_passed_to_asyncio(
    loop_errors: list, engine: ScriptedEngine, caplog
) -> None:
    """Out of descriptors asyncio reports every failed accept(); before, each became an ERROR plus
    asyncio's own traceback (886 of them in a second)."""
    async with proxied(engine.url) as harness:
        loop = asyncio.get_running_loop()
        [listener] = harness.server._server.sockets  # type: ignore[union-attr]
        for _ in range(500):
            loop.call_exception_handler(
                {
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(errno.EMFILE, "Too many open files"),
                    "socket": listener,
                }
            )
        assert harness.count(ACCEPT_ERRORS, "r0") == 500
        assert loop_errors == []
        logged = [r for r in caplog.records if "cannot accept" in r.getMessage()]
        assert len(logged) == 1
        other = {"message": "something else entirely", "exception": RuntimeError("x")}
        loop.call_exception_handler(other)
        assert loop_errors == [other]  # what the proxy does not handle still reaches asyncio


async def test_an_engine_that_refuses_connections_is_one_warning_not_one_per_request(caplog) -> None:
    """Before: one "cannot connect to the engine" WARNING per request (1,910 in a second)."""
    with socket.socket() as placeholder:  # a port nobody listens on
        placeholder.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{placeholder.getsockname()[1]}"
    async with proxied(dead) as harness:
        caplog.set_level(logging.WARNING)
        for _ in range(30):
            response = await send_raw(harness.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(response) == 502
        warned = [r for r in caplog.records if "cannot connect to the engine" in r.getMessage()]
        assert len(warned) == 1


async def test_a_chunk_size_over_the_body_limit_is_413_at_once(engine: ScriptedEngine) -> None:
    """Before: kvwatch waited for 2**64 - 1 bytes until the body timeout answered 408."""
    async with proxied(engine.url, config=ProxyConfig(client_header_timeout_s=30)) as harness:
        started = time.monotonic()
        response = await send_raw(harness.url, CHUNKED_POST + b"FFFFFFFFFFFFFFFF\r\nAB", timeout=10)
        assert status_of(response) == 413 and time.monotonic() - started < 5
        assert engine.seen == []
        assert [r.status_code for r in harness.records] == [413]  # a metered request: counted as rejected


async def test_a_chunk_size_with_trailing_whitespace_is_400(
    engine: ScriptedEngine, proxy: ProxyHarness
) -> None:
    response = await send_raw(proxy.url, CHUNKED_POST + b"5 \r\nhello\r\n0\r\n\r\n")
    assert status_of(response) == 400
    assert engine.seen == []
