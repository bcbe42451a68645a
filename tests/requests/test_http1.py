"""The proxy's HTTP/1.1 slice: strict heads, chunked bodies in any split, hop-by-hop headers."""

from __future__ import annotations

import pytest

from kvwatch.requests import http1
from kvwatch.requests.http1 import ChunkedDecoder, HttpError


def test_request_head_is_parsed_with_headers_kept_as_sent() -> None:
    head = http1.parse_request_head(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nX-Thing:  v v ")
    assert (head.method, head.path, head.version) == (b"POST", b"/v1/completions", b"HTTP/1.1")
    assert head.headers == [(b"Host", b"a"), (b"X-Thing", b"v v")]
    assert head.keep_alive


@pytest.mark.parametrize(("head", "status"), [
    (b"GET /\r\n", 400),
    (b"GET / HTTP/2.0\r\n", 505),
    (b"GET  / HTTP/1.1", 400),
    (b"GET / HTTP/1.1\r\nBad Header: x", 400),
    (b"GET / HTTP/1.1\r\n folded", 400),
    (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 200, 431),
])
def test_bad_request_heads_are_refused(head: bytes, status: int) -> None:
    with pytest.raises(HttpError) as err:
        http1.parse_request_head(head.removesuffix(b"\r\n"))
    assert err.value.status == status


@pytest.mark.parametrize(("version", "connection", "keep"), [
    (b"HTTP/1.1", None, True), (b"HTTP/1.1", b"close", False), (b"HTTP/1.0", None, False),
    (b"HTTP/1.0", b"Keep-Alive", True),
])
def test_keep_alive(version: bytes, connection: bytes | None, keep: bool) -> None:
    headers = [(b"Connection", connection)] if connection else []
    assert http1.RequestHead(b"GET", b"/", version, headers, http1.index_of(headers)).keep_alive is keep


def test_conflicting_content_lengths_are_refused() -> None:
    with pytest.raises(HttpError):
        http1.content_length([(b"Content-Length", b"3"), (b"content-length", b"4")])
    with pytest.raises(HttpError):
        http1.content_length([(b"Content-Length", b"-1")])
    assert http1.content_length([(b"Content-Length", b"3"), (b"content-length", b"3")]) == 3


def test_unknown_transfer_coding_is_refused() -> None:
    with pytest.raises(HttpError) as err:
        http1.is_chunked([(b"Transfer-Encoding", b"gzip, chunked")])
    assert err.value.status == 501


def test_end_to_end_headers_drop_hop_by_hop_and_connection_named_ones() -> None:
    headers = [(b"Connection", b"keep-alive, X-Hop"), (b"X-Hop", b"1"), (b"Keep-Alive", b"timeout=5"),
               (b"Transfer-Encoding", b"chunked"), (b"Content-Length", b"5"), (b"X-Kept", b"yes"),
               (b"Upgrade", b"h2c"), (b"Content-Type", b"text/plain")]
    head = http1.RequestHead(b"GET", b"/", b"HTTP/1.1", headers, http1.index_of(headers))
    assert http1.end_to_end(head) == [(b"X-Kept", b"yes"), (b"Content-Type", b"text/plain")]


def test_response_head() -> None:
    head = http1.parse_response_head(b"HTTP/1.1 404 Not Found\r\nX: y")
    assert (head.status, head.reason, head.headers) == (404, b"Not Found", [(b"X", b"y")])
    with pytest.raises(HttpError):
        http1.parse_response_head(b"HTTP/1.1 abc nope")


BODY = [b"data: one\n\n", b"data: two\n\n", b"x" * 300]
ENCODED = b"".join(http1.frame_chunk(p) for p in BODY) + b"0\r\nTrailer: v\r\n\r\nNEXT"


@pytest.mark.parametrize("step", [1, 2, 3, 7, 13, 64, len(ENCODED)])
def test_chunked_decoder_any_split(step: int) -> None:
    decoder = ChunkedDecoder()
    out = b""
    for i in range(0, len(ENCODED), step):
        out += decoder.feed(ENCODED[i:i + step])
    assert out == b"".join(BODY)
    assert decoder.done and decoder.rest.endswith(b"NEXT")


def test_chunked_decoder_extensions_and_one_call_per_chunk() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"5;name=v\r\nhello\r\n") == b"hello"
    assert decoder.feed(http1.frame_chunk(b"data: x\n\n")) == b"data: x\n\n"
    assert decoder.feed(b"0\r\n\r\n") == b"" and decoder.done


@pytest.mark.parametrize("bad", [b"zz\r\nabc\r\n", b"3\r\nabcX\r\n", b"1" * 2000])
def test_chunked_decoder_refuses_garbage(bad: bytes) -> None:
    with pytest.raises(HttpError):
        ChunkedDecoder().feed(bad)
