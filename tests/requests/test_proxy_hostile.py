"""Hostile input at the proxy: what an attacker sends is refused the way RFC 9112, nginx
and Envoy refuse it, and never wedges the loop, reaches the engine, or cross-wires responses."""

from __future__ import annotations

import asyncio
import errno
import faulthandler
import time

import pytest

from kvwatch.config import ProxyConfig
from kvwatch.model import Outcome
from kvwatch.requests.http1 import ChunkedDecoder
from kvwatch.requests.proxy import ACCEPT_ERRORS, SHED
from tests.local import until

from .h11_engine import h11_engine
from .raw_client import CHUNKED_POST, body_of, send_raw, status_of, still_serving
from .raw_engine import raw_engine, read_request
from .scripted import ProxyHarness, Script, ScriptedEngine, launch_proxy, proxied


@pytest.fixture(autouse=True)
def wedge_watchdog():
    """A wedged event loop cannot fail its own test: end the process (with tracebacks) instead."""
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# -- critical 1: chunk sizes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"1\r\nA\r\n-6\r\nX",  # the input that wedged the agent for good
        b"-1\r\nA\r\n0\r\n\r\n",
        b"0x5\r\nhello\r\n0\r\n\r\n",
        b"+5\r\nhello\r\n0\r\n\r\n",
        b"1_0\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n",
        b" 5\r\nhello\r\n0\r\n\r\n",
        b"1" * 17 + b"\r\n",
        b"5;a=\x01\r\nhello\r\n0\r\n\r\n",
        b"5\nhello\r\n0\r\n\r\n",
        b"5\r\nhello\r\n0\r\nBad Trailer: x\r\n\r\n",
    ],
)
async def test_bad_chunk_sizes_from_a_client_are_400_and_never_wedge_the_loop(
    engine: ScriptedEngine, proxy: ProxyHarness, body: bytes
) -> None:
    response = await send_raw(proxy.url, CHUNKED_POST + body)
    assert status_of(response) == 400
    assert engine.seen == []
    await still_serving(proxy)


async def test_chunk_extensions_and_trailers_are_accepted_and_dropped(
    engine: ScriptedEngine, proxy: ProxyHarness
) -> None:
    payload = b'{"model":"tiny","prompt":"x","stream":true}'
    body = b'%x;name=value;q="a b"\r\n%b\r\n0\r\nX-Checksum: 1\r\n\r\n' % (len(payload), payload)
    head = CHUNKED_POST.replace(b"Host: x", b"Host: x\r\nConnection: close")
    response = await send_raw(proxy.url, head + body)
    assert status_of(response) == 200
    assert engine.seen[-1].body.endswith(payload[1:])


@pytest.mark.parametrize("chunk", [b"-6", b"0x5", b"+5", b"1_0", b"1" * 17])
async def test_bad_chunk_sizes_from_the_engine_are_502_and_never_wedge_the_loop(chunk: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"
            b"1\r\nA\r\n" + chunk + b"\r\nXXXXXXXX"
        )
        await writer.drain()
        await asyncio.sleep(5)

    async with raw_engine(handler) as url, proxied(url) as harness:
        started = time.monotonic()
        response = await send_raw(harness.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(response) == 502 and time.monotonic() - started < 2


# -- critical 2: request smuggling ------------------------------------------------------------------

SMUGGLED = b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"


async def test_bare_lf_smuggling_is_refused_and_never_cross_wires_responses() -> None:
    """The attack that worked: a header value hiding ``\\nTransfer-Encoding: chunked``. h11 reads two
    headers, frames the body as chunked and finds a second request in it; through the pooled
    upstream connection the next clients would get the wrong responses."""
    async with h11_engine(delay=0.2) as engine, proxied(engine.url) as harness:
        attack = (
            b"POST /attacker HTTP/1.1\r\nHost: x\r\nX-A: a\nTransfer-Encoding: chunked\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(SMUGGLED), SMUGGLED)
        )
        answers = {"attacker": await send_raw(harness.url, attack)}
        for victim in ("victim1", "victim2"):
            request = b"GET /%b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % victim.encode()
            answers[victim] = await send_raw(harness.url, request)
        for victim in ("victim1", "victim2"):
            assert body_of(answers[victim]) == b"response to /" + victim.encode()
        assert status_of(answers["attacker"]) == 400
        assert engine.targets == [b"/victim1", b"/victim2"]


@pytest.mark.parametrize(
    "head",
    [
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
    ],
)
async def test_heads_an_engine_could_misparse_are_400_and_never_forwarded(
    engine: ScriptedEngine, proxy: ProxyHarness, head: bytes
) -> None:
    response = await send_raw(proxy.url, head + b"\r\n\r\n")
    assert status_of(response) == 400
    assert engine.seen == []
    await still_serving(proxy)


@pytest.mark.parametrize(
    "field",
    [
        b"X-A: a\nTransfer-Encoding: chunked",
        b"X-A: a\rb",
        b"X-A: a\x00b",
        b"X(A): b",
        b"X A: b",
    ],
)
async def test_engine_heads_with_control_characters_are_502(field: bytes) -> None:
    response = await through_engine_answering(b"HTTP/1.1 200 OK\r\n%b\r\ncontent-length: 2\r\n\r\nok" % field)
    assert status_of(response) == 502
    assert b"a\nTransfer" not in response and b"\x00" not in response


async def through_engine_answering(answer: bytes) -> bytes:
    """What a client of the proxy receives for ``GET /v1/models`` from an engine that sends ``answer``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    async with raw_engine(handler) as url, proxied(url) as harness:
        return await send_raw(harness.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")


# -- low: head size in one read, absolute-form and trailing-slash targets ------------------------------


async def test_request_head_over_64_kib_in_one_read_is_431(
    engine: ScriptedEngine, proxy: ProxyHarness
) -> None:
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * (70 * 1024) + b"\r\n\r\n"
    assert status_of(await send_raw(proxy.url, head)) == 431
    assert engine.seen == []


async def test_engine_head_over_64_kib_in_one_read_is_502() -> None:
    pad = b"a" * (70 * 1024)
    answer = b"HTTP/1.1 200 OK\r\nX-Pad: %b\r\ncontent-length: 2\r\n\r\nok" % pad
    response = await through_engine_answering(answer)
    assert status_of(response) == 502


CHAT_BODY = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"stream":true}'


@pytest.mark.parametrize(
    "target",
    [
        b"http://engine.example:8000/v1/chat/completions",  # absolute-form: uvicorn/httptools routes its path
        b"HTTP://engine.example/v1/chat/completions?x=1",
        b"/v1/chat/%63ompletions",  # percent-encoded: uvicorn unquotes before FastAPI routes
    ],
)
async def test_targets_the_engine_routes_to_chat_are_metered(
    engine: ScriptedEngine, proxy: ProxyHarness, target: bytes
) -> None:
    request = (
        b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (target, len(CHAT_BODY), CHAT_BODY)
    )
    response = await send_raw(proxy.url, request)
    assert status_of(response) == 200 and b"[DONE]" in response
    assert engine.seen[-1].path == "/v1/chat/completions"
    [record] = proxy.records
    assert (record.endpoint, record.outcome) == ("chat", Outcome.COMPLETED)


async def test_trailing_slash_target_is_relayed_unmetered_as_fastapi_redirects_it(
    engine: ScriptedEngine, proxy: ProxyHarness
) -> None:
    """FastAPI (Starlette ``redirect_slashes``) answers ``POST /v1/chat/completions/`` with a 307 to
    the path without the slash and generates nothing; the client's follow-up is what is metered."""
    request = (
        b"POST /v1/chat/completions/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(CHAT_BODY), CHAT_BODY)
    )
    response = await send_raw(proxy.url, request)
    assert status_of(response) == 218  # the scripted engine's catch-all route: relayed as it answered
    assert engine.seen[-1].path == "/v1/chat/completions/"
    assert proxy.records == []


# -- serious 7: usage injection decides nothing for the replica --------------------------------------


async def test_utf16_body_is_sent_as_written_and_switches_nothing_off(
    engine: ScriptedEngine, proxy: ProxyHarness
) -> None:
    """json.loads reads UTF-16; inserting ASCII after its first "{" byte corrupted it, the engine
    answered 400, the retry with the client's body succeeded, and kvwatch stopped asking the replica
    for usage until restart."""
    body = CHAT_BODY.decode().encode("utf-16")
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    await send_raw(proxy.url, request)
    assert [s.body for s in engine.seen] == [body]  # never rewritten, never retried
    plain = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(CHAT_BODY), CHAT_BODY)
    )
    response = await send_raw(proxy.url, plain)
    assert b'"stream_options":{"include_usage":true}' in engine.seen[-1].body  # still asked
    assert b'"usage"' not in response and not proxy.records[-1].output_tokens_estimated


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"tiny","messages":[],"stream":true,"stream_options":{},"max_tokens":1e999}',  # -> Infinity
        b'\xef\xbb\xbf{"model":"tiny","messages":[],"stream":true}',  # a BOM: not RFC 8259 JSON text
        b'{"model":"tiny","messages":[],"stream":true,"x":"\xff"}',  # not UTF-8
    ],
)
async def test_bodies_that_injection_could_change_are_sent_as_written(
    engine: ScriptedEngine, proxy: ProxyHarness, body: bytes
) -> None:
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    await send_raw(proxy.url, request)
    assert engine.seen[0].body == body


async def test_a_usage_chunk_the_engine_forces_is_kept_when_kvwatch_did_not_ask(
    engine: ScriptedEngine,
) -> None:
    """vLLM --enable-force-include-usage sends a usage chunk unasked; a direct client sees it, so a
    client of kvwatch must too whenever kvwatch did not ask for it."""
    engine.script = Script(force_usage=True)
    async with proxied(engine.url, config=ProxyConfig(inject_usage=False)) as harness:
        plain = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(CHAT_BODY), CHAT_BODY)
        )
        response = await send_raw(harness.url, plain)
        assert b'"choices":[],"usage"' in response
        assert harness.records[-1].output_tokens == 2 and not harness.records[-1].output_tokens_estimated


async def test_include_usage_as_pydantic_reads_it_is_the_clients_own(
    engine: ScriptedEngine, proxy: ProxyHarness
) -> None:
    """``"include_usage": "true"`` is true to vLLM (pydantic's lax bool); the client asked for usage,
    so its usage chunk is relayed, not removed."""
    body = b'{"model":"tiny","messages":[],"stream":true,"stream_options":{"include_usage":"true"}}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    response = await send_raw(proxy.url, request)
    assert engine.seen[-1].body == body and b'"choices":[],"usage"' in response


# -- serious 5 and 10: memory and connections are bounded ------------------------------------------


async def test_buffered_request_bytes_have_a_global_budget(engine: ScriptedEngine) -> None:
    config = ProxyConfig(max_body_bytes=1 << 20, max_buffered_bytes=1 << 20)
    harness = await launch_proxy(engine.url, config=config)
    host, port = harness.url.removeprefix("http://").split(":")
    try:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 900000\r\n\r\n"
        )
        first = await asyncio.open_connection(host, int(port))
        first[1].write(head + b"x" * 700_000)
        await until(lambda: harness.server.budget.held >= 700_000)
        second = await send_raw(harness.url, head + b"y" * 700_000)
        assert status_of(second) == 503
        assert harness.count(SHED, "r0", "buffer") == 1
        first[1].write(b"x" * 200_000)  # the first request completes within the budget
        assert status_of(await asyncio.wait_for(first[0].read(-1), 5)) == 400  # the engine's: not JSON
        first[1].close()
        await until(lambda: harness.server.budget.held == 0)
    finally:
        await harness.server.stop()


async def test_request_body_is_dropped_once_the_response_head_came(engine: ScriptedEngine) -> None:
    engine.script = Script(contents=[(0.05, "tok")] * 20)
    async with proxied(engine.url) as harness:
        body = CHAT_BODY[:-1] + b',"pad":"' + b"p" * 500_000 + b'"}'
        host, port = harness.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        await reader.readuntil(b"\r\n\r\n")  # streaming has begun
        [conn] = harness.server.connections
        assert conn.exchange is not None and conn.exchange.body == b"" and conn.exchange.request == b""
        assert harness.server.budget.held == 0
        assert b"[DONE]" in await asyncio.wait_for(reader.read(-1), 10)
        writer.close()


async def test_connections_per_proxy_are_capped_with_503(engine: ScriptedEngine) -> None:
    harness = await launch_proxy(engine.url, config=ProxyConfig(max_connections=2))
    host, port = harness.url.removeprefix("http://").split(":")
    try:
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        await until(lambda: len(harness.server.connections) == 2)
        response = await send_raw(harness.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(response) == 503 and b"proxy.max_connections" in response
        assert harness.count(SHED, "r0", "connections") == 1
        for _, writer in idle:
            writer.close()
        await until(lambda: not harness.server.connections)
        await still_serving(harness)
    finally:
        await harness.server.stop()


async def test_a_failing_accept_is_logged_and_counted(proxy: ProxyHarness, caplog) -> None:
    """What asyncio reports when accept() runs out of file descriptors (base_events/selector_events)."""
    loop = asyncio.get_running_loop()
    loop.call_exception_handler(
        {
            "message": "socket.accept() out of system resource",
            "exception": OSError(errno.EMFILE, "Too many open files"),
        }
    )
    assert proxy.count(ACCEPT_ERRORS, "r0") == 1
    assert any("cannot accept a connection (Too many open files)" in r.getMessage() for r in caplog.records)


def events_of(response: bytes) -> bytes:
    """The body of a response, de-chunked if it came chunked."""
    head, _, body = response.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return body
    decoder = ChunkedDecoder()
    events = decoder.feed(body)
    assert decoder.done
    return events


async def test_an_engine_that_forces_usage_keeps_its_chunk_from_the_first_stream_and_loses_no_count(
    engine: ScriptedEngine, proxy: ProxyHarness
) -> None:
    """vLLM 0.32 with --enable-force-include-usage sends usage on every chunk and a usage chunk, asked or
    not. kvwatch still asks (it cannot know beforehand), sees usage on a chunk it did not ask it on,
    and removes nothing: every client, from the first stream on, gets what a direct one gets, and every
    stream is counted exactly."""
    engine.script = Script(force_usage=True)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(CHAT_BODY), CHAT_BODY)
    )
    direct = events_of(await send_raw(engine.url, request))
    assert direct.count(b'"usage":{') == 5 and b'"choices":[],"usage"' in direct  # 4 chunks + usage chunk
    for _ in range(3):
        assert events_of(await send_raw(proxy.url, request)) == direct
        assert b"include_usage" in engine.seen[-1].body  # still asked: nothing decided for the replica
    await until(lambda: len(proxy.records) == 3)
    assert [(r.output_tokens, r.output_tokens_estimated) for r in proxy.records] == [(2, False)] * 3


async def test_an_engine_that_forces_usage_keeps_its_chunk_once_kvwatch_has_seen_it(
    engine: ScriptedEngine, proxy: ProxyHarness
) -> None:
    """An n=2 stream is never asked for usage; a usage chunk in it shows the engine sends one always,
    so kvwatch stops asking and no longer removes what a direct client would see."""
    engine.script = Script(force_usage=True)
    unasked = b'{"model":"tiny","messages":[],"stream":true,"n":2}'
    for body in (unasked, CHAT_BODY):
        response = await send_raw(
            proxy.url,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body),
        )
        assert engine.seen[-1].body == body and b'"choices":[],"usage"' in response
    assert [r.output_tokens_estimated for r in proxy.records] == [False, False]


async def test_a_json_response_read_for_usage_counts_in_the_budget(engine: ScriptedEngine) -> None:
    """A non-streaming answer is read whole for its usage; within the budget it is, over it it is not."""
    body = b'{"model":"tiny","messages":[]}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    roomy = await launch_proxy(engine.url)
    tight = await launch_proxy(engine.url, config=ProxyConfig(max_body_bytes=64, max_buffered_bytes=64))
    try:
        for harness in (roomy, tight):
            response = await send_raw(harness.url, request)
            assert status_of(response) == 200 and b'"usage"' in response  # the client's bytes, always
            await until(lambda h=harness: h.server.budget.held == 0)
        assert roomy.records[-1].output_tokens == 2 and not roomy.records[-1].output_tokens_estimated
        assert tight.records[-1].output_tokens is None  # read nothing it had no room for
    finally:
        await roomy.server.stop()
        await tight.server.stop()


async def test_an_open_files_limit_too_low_for_the_connection_cap_is_said_at_start(
    engine: ScriptedEngine, caplog
) -> None:
    """Under uvloop libuv drops clients it has no descriptor for without telling Python: the only
    trace kvwatch can leave is the warning at start."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with proxied(engine.url, config=ProxyConfig(max_connections=soft)):
        assert any(
            "open-files limit" in r.getMessage() and "proxy.max_connections" in r.getMessage()
            for r in caplog.records
        )
