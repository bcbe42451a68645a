"""Hostile input at the proxy (issue #11): what an attacker sends is refused the way RFC 9112, nginx
and Envoy refuse it, and never wedges the loop, reaches the engine, or cross-wires responses."""

from __future__ import annotations

import asyncio
import faulthandler
import time

import pytest

from kvwatch.model import Outcome

from .h11_engine import h11_engine
from .scripted import ProxyHarness, ScriptedEngine, launch_proxy
from .test_proxy_faults import raw_engine, read_request


@pytest.fixture(autouse=True)
def wedge_watchdog():
    """A wedged event loop cannot fail its own test: end the process (with tracebacks) instead."""
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


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


# -- critical 1: chunk sizes ------------------------------------------------------------------------

CHUNKED_POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("body", [
    b"1\r\nA\r\n-6\r\nX",  # the input that wedged the agent for good
    b"-1\r\nA\r\n0\r\n\r\n", b"0x5\r\nhello\r\n0\r\n\r\n", b"+5\r\nhello\r\n0\r\n\r\n",
    b"1_0\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n", b" 5\r\nhello\r\n0\r\n\r\n",
    b"1" * 17 + b"\r\n", b"5;a=\x01\r\nhello\r\n0\r\n\r\n", b"5\nhello\r\n0\r\n\r\n",
    b"5\r\nhello\r\n0\r\nBad Trailer: x\r\n\r\n",
])
async def test_bad_chunk_sizes_from_a_client_are_400_and_never_wedge_the_loop(
        engine: ScriptedEngine, proxy: ProxyHarness, body: bytes) -> None:
    response = await send_raw(proxy.url, CHUNKED_POST + body)
    assert status_of(response) == 400
    assert engine.seen == []
    await still_serving(proxy)


async def test_chunk_extensions_and_trailers_are_accepted_and_dropped(
        engine: ScriptedEngine, proxy: ProxyHarness) -> None:
    payload = b'{"model":"tiny","prompt":"x","stream":true}'
    body = b"%x;name=value;q=\"a b\"\r\n%b\r\n0\r\nX-Checksum: 1\r\n\r\n" % (len(payload), payload)
    head = CHUNKED_POST.replace(b"Host: x", b"Host: x\r\nConnection: close")
    response = await send_raw(proxy.url, head + body)
    assert status_of(response) == 200
    assert engine.seen[-1].body.endswith(payload[1:])


@pytest.mark.parametrize("chunk", [b"-6", b"0x5", b"+5", b"1_0", b"1" * 17])
async def test_bad_chunk_sizes_from_the_engine_are_502_and_never_wedge_the_loop(chunk: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"1\r\nA\r\n" + chunk + b"\r\nXXXXXXXX")
        await writer.drain()
        await asyncio.sleep(5)

    async with raw_engine(handler) as url:
        harness = await launch_proxy(url)
        try:
            started = time.monotonic()
            response = await send_raw(harness.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(response) == 502 and time.monotonic() - started < 2
        finally:
            await harness.server.stop()


# -- critical 2: request smuggling ------------------------------------------------------------------

SMUGGLED = b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"


async def test_bare_lf_smuggling_is_refused_and_never_cross_wires_responses() -> None:
    """The attack that worked: a header value hiding ``\\nTransfer-Encoding: chunked``. h11 reads two
    headers, frames the body as chunked and finds a second request in it; through the pooled
    upstream connection the next clients would get the wrong responses."""
    async with h11_engine(delay=0.2) as engine:
        harness = await launch_proxy(engine.url)
        try:
            attack = (b"POST /attacker HTTP/1.1\r\nHost: x\r\nX-A: a\nTransfer-Encoding: chunked\r\n"
                      b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(SMUGGLED), SMUGGLED))
            answers = {"attacker": await send_raw(harness.url, attack)}
            for victim in ("victim1", "victim2"):
                request = b"GET /%b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % victim.encode()
                answers[victim] = await send_raw(harness.url, request)
            for victim in ("victim1", "victim2"):
                assert body_of(answers[victim]) == b"response to /" + victim.encode()
            assert status_of(answers["attacker"]) == 400
            assert engine.targets == [b"/victim1", b"/victim2"]
        finally:
            await harness.server.stop()


@pytest.mark.parametrize("head", [
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\nTransfer-Encoding: chunked",  # bare LF in a value
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\rTransfer-Encoding: chunked",  # bare CR
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x00b",  # NUL
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x1bb",  # other control characters
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX(A): b",  # a name that is not a token
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX\x00A: b",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nTransfer-Encoding\n: chunked",
    b"GET /v1/models\x01 HTTP/1.1\r\nHost: x",  # control character in the target
    b"GET /v1/models\x7f HTTP/1.1\r\nHost: x",
    b"GET /v1/m\xc3\xa9 HTTP/1.1\r\nHost: x",  # non-ASCII target
    b"GET /v1/models HTTP/1.1\nHost: x",  # bare LF ending the request line
    b"GET v1/models HTTP/1.1\r\nHost: x",  # neither origin-form nor absolute-form
    b"G(T /v1/models HTTP/1.1\r\nHost: x",  # a method that is not a token
])
async def test_heads_an_engine_could_misparse_are_400_and_never_forwarded(
        engine: ScriptedEngine, proxy: ProxyHarness, head: bytes) -> None:
    response = await send_raw(proxy.url, head + b"\r\n\r\n")
    assert status_of(response) == 400
    assert engine.seen == []
    await still_serving(proxy)


@pytest.mark.parametrize("field", [
    b"X-A: a\nTransfer-Encoding: chunked", b"X-A: a\rb", b"X-A: a\x00b", b"X(A): b", b"X A: b",
])
async def test_engine_heads_with_control_characters_are_502(field: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + field + b"\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async with raw_engine(handler) as url:
        harness = await launch_proxy(url)
        try:
            response = await send_raw(harness.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(response) == 502
            assert b"a\nTransfer" not in response and b"\x00" not in response
        finally:
            await harness.server.stop()


# -- low: head size in one read, absolute-form and trailing-slash targets ------------------------------


async def test_request_head_over_64_kib_in_one_read_is_431(engine: ScriptedEngine,
                                                            proxy: ProxyHarness) -> None:
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * (70 * 1024) + b"\r\n\r\n"
    assert status_of(await send_raw(proxy.url, head)) == 431
    assert engine.seen == []


async def test_engine_head_over_64_kib_in_one_read_is_502() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * (70 * 1024) + b"\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async with raw_engine(handler) as url:
        harness = await launch_proxy(url)
        try:
            response = await send_raw(harness.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(response) == 502
        finally:
            await harness.server.stop()


CHAT_BODY = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"stream":true}'


@pytest.mark.parametrize("target", [
    b"http://engine.example:8000/v1/chat/completions",  # absolute-form: uvicorn/httptools routes its path
    b"HTTP://engine.example/v1/chat/completions?x=1",
    b"/v1/chat/%63ompletions",  # percent-encoded: uvicorn unquotes before FastAPI routes
])
async def test_targets_the_engine_routes_to_chat_are_metered(engine: ScriptedEngine, proxy: ProxyHarness,
                                                             target: bytes) -> None:
    request = (b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Content-Length: %d\r\n\r\n%b" % (target, len(CHAT_BODY), CHAT_BODY))
    response = await send_raw(proxy.url, request)
    assert status_of(response) == 200 and b"[DONE]" in response
    assert engine.seen[-1].path == "/v1/chat/completions"
    [record] = proxy.records
    assert (record.endpoint, record.outcome) == ("chat", Outcome.COMPLETED)


async def test_trailing_slash_target_is_relayed_unmetered_as_fastapi_redirects_it(
        engine: ScriptedEngine, proxy: ProxyHarness) -> None:
    """FastAPI (Starlette ``redirect_slashes``) answers ``POST /v1/chat/completions/`` with a 307 to
    the path without the slash and generates nothing; the client's follow-up is what is metered."""
    request = (b"POST /v1/chat/completions/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
               b"Content-Length: %d\r\n\r\n%b" % (len(CHAT_BODY), CHAT_BODY))
    response = await send_raw(proxy.url, request)
    assert status_of(response) == 218  # the scripted engine's catch-all route: relayed as it answered
    assert engine.seen[-1].path == "/v1/chat/completions/"
    assert proxy.records == []
