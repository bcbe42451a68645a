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


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /\r\n", 400),
        (b"GET / HTTP/2.0\r\n", 505),
        (b"GET  / HTTP/1.1", 400),
        (b"GET / HTTP/1.1\r\nBad Header: x", 400),
        (b"GET / HTTP/1.1\r\n folded", 400),
        (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 200, 431),
    ],
)
def test_bad_request_heads_are_refused(head: bytes, status: int) -> None:
    with pytest.raises(HttpError) as err:
        http1.parse_request_head(head.removesuffix(b"\r\n"))
    assert err.value.status == status


@pytest.mark.parametrize(
    ("version", "connection", "keep"),
    [
        (b"HTTP/1.1", None, True),
        (b"HTTP/1.1", b"close", False),
        (b"HTTP/1.0", None, False),
        (b"HTTP/1.0", b"Keep-Alive", True),
    ],
)
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
    headers = [
        (b"Connection", b"keep-alive, X-Hop"),
        (b"X-Hop", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Content-Length", b"5"),
        (b"X-Kept", b"yes"),
        (b"Upgrade", b"h2c"),
        (b"Content-Type", b"text/plain"),
    ]
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
        out += decoder.feed(ENCODED[i : i + step])
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


# -- RFC 9112 grammar (what an engine's parser could read differently is refused) -------------------


@pytest.mark.parametrize(
    "line",
    [
        b"X-A: a\nTransfer-Encoding: chunked",
        b"X-A: a\rb",
        b"X-A: a\x00b",
        b"X-A: \x7f",
        b"X(A): b",
        b"X@A: b",
        b"X\x00A: b",
        b": empty name",
        b"X-A\t: b",
    ],
)
def test_header_lines_with_control_characters_or_non_token_names_are_refused(line: bytes) -> None:
    with pytest.raises(HttpError) as err:
        http1.parse_request_head(b"GET / HTTP/1.1\r\n" + line)
    assert err.value.status == 400
    with pytest.raises(HttpError) as err:
        http1.parse_response_head(b"HTTP/1.1 200 OK\r\n" + line)
    assert err.value.status == 502


def test_values_keep_htab_and_obs_text_as_rfc_9110_allows() -> None:
    head = http1.parse_request_head(b"GET / HTTP/1.1\r\nX-A:\ta\tb\xe9 \r\nX~!#$%&'*+.^_`|: 1")
    assert head.headers == [(b"X-A", b"a\tb\xe9"), (b"X~!#$%&'*+.^_`|", b"1")]


@pytest.mark.parametrize("target", [b"/a\x01", b"/a\x7f", b"/\xc3\xa9", b"a/b", b"ftp://h/x", b"*"])
def test_targets_outside_visible_ascii_or_origin_and_absolute_form_are_refused(target: bytes) -> None:
    with pytest.raises(HttpError) as err:
        http1.parse_request_head(b"GET " + target + b" HTTP/1.1")
    assert err.value.status == 400


@pytest.mark.parametrize(
    ("target", "forwarded", "path"),
    [
        (b"/v1/chat/completions?x=1", b"/v1/chat/completions?x=1", b"/v1/chat/completions"),
        (b"http://h:8000/v1/completions", b"/v1/completions", b"/v1/completions"),
        (b"HTTPS://h?x=1", b"/?x=1", b"/"),
        (b"http://h", b"/", b"/"),
        (b"/v1/chat%2Fcompletions", b"/v1/chat%2Fcompletions", b"/v1/chat/completions"),
    ],
)
def test_targets_become_origin_form_and_paths_are_routed_as_uvicorn_does(
    target: bytes, forwarded: bytes, path: bytes
) -> None:
    head = http1.parse_request_head(b"POST " + target + b" HTTP/1.1")
    assert (head.target, head.path) == (forwarded, path)
    assert http1.parse_request_head(b"OPTIONS * HTTP/1.1").target == b"*"


def test_status_lines_are_checked() -> None:
    for bad in (
        b"HTTP/1.1 200 O\x00K",
        b"HTTP/1.2 200 OK",
        b"HTTP/1.1 2000 OK",
        b"HTTP/1.1 20x OK",
        b"HTTP/1.1 002 OK",
    ):  # status codes are 100-599 (RFC 9110, 15); 0xx would be relayed as "2"
        with pytest.raises(HttpError):
            http1.parse_response_head(bad)
    assert http1.parse_response_head(b"HTTP/1.0 200").status == 200


def test_content_length_is_bounded() -> None:
    with pytest.raises(HttpError):
        http1.content_length([(b"Content-Length", b"9" * 5000)])  # int() would raise ValueError


@pytest.mark.parametrize("size", [b"-6", b"-1", b"0x5", b"+5", b"1_0", b" 5", b"5\x00", b"1" * 17, b"", b"g"])
def test_chunk_sizes_are_hex_digits_only(size: bytes) -> None:
    with pytest.raises(HttpError):
        ChunkedDecoder().feed(b"1\r\nA\r\n" + size + b"\r\nXXXXXXXXXXXXXXXXXXXX\r\n0\r\n\r\n")


def test_negative_chunk_size_in_one_read_ends() -> None:
    """The input that wedged the agent: it must raise, not loop."""
    with pytest.raises(HttpError):
        ChunkedDecoder().feed(b"1\r\nA\r\n-6\r\nX")


@pytest.mark.parametrize("from_client", [True, False])
@pytest.mark.parametrize(
    "line",
    [
        b"5;name",
        b"5;name=value",
        b'5;name="quoted \\" value"',
        b"5 ; a = b ; c",
        b"005",
    ],
)
def test_chunk_extensions_of_rfc_9112_are_accepted(line: bytes, from_client: bool) -> None:
    decoder = ChunkedDecoder(from_client=from_client)
    assert decoder.feed(line + b"\r\nhello\r\n0\r\n\r\n") == b"hello" and decoder.done


@pytest.mark.parametrize("line", [b"5 ", b"5\t", b"5;a=b ", b"5;a "])
def test_whitespace_after_a_clients_chunk_size_is_refused_as_rfc_9112_has_no_room_for_it(line: bytes) -> None:
    with pytest.raises(HttpError):
        ChunkedDecoder(from_client=True).feed(line + b"\r\nhello\r\n0\r\n\r\n")


@pytest.mark.parametrize("line", [b"5 ", b"5;a=b\t"])
def test_whitespace_after_an_engines_chunk_size_is_tolerated_as_h11_tolerates_it(line: bytes) -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(line + b"\r\nhello\r\n0\r\n\r\n") == b"hello" and decoder.done


@pytest.mark.parametrize(
    "data", [b"FFFFFFFFFFFFFFFF\r\n", b"FFFFFFFFFFFFFFFF\r\nAB", b"5\r\nhello\r\n" + b"FFFF\r\n"]
)
def test_chunk_sizes_announcing_more_than_the_body_limit_are_413_before_the_bytes_come(data: bytes) -> None:
    with pytest.raises(HttpError) as refused:
        ChunkedDecoder(1024, from_client=True).feed(data)
    assert refused.value.status == 413


def test_chunk_sizes_within_the_body_limit_pass() -> None:
    decoder = ChunkedDecoder(10, from_client=True)
    assert decoder.feed(b"5\r\nhello\r\n5\r\nworld\r\n0\r\n\r\n") == b"helloworld" and decoder.done


@pytest.mark.parametrize("line", [b"5;", b"5;a=\x01", b'5;a="open', b"5;a b", b"5;\nX"])
def test_malformed_chunk_extensions_are_refused(line: bytes) -> None:
    with pytest.raises(HttpError):
        ChunkedDecoder().feed(line + b"\r\nhello\r\n0\r\n\r\n")


def test_trailers_are_checked_and_bounded() -> None:
    too_many = b"0\r\n" + b"X: y\r\n" * 200 + b"\r\n"
    for bad in (b"0\r\nBad Name: x\r\n\r\n", b"0\r\nX: a\x00\r\n\r\n", too_many):
        with pytest.raises(HttpError):
            ChunkedDecoder().feed(bad)
    decoder = ChunkedDecoder()
    for _ in range(100):  # trailer bytes are counted across reads, not per read
        try:
            decoder.feed(b"0\r\n" if decoder._state == decoder._SIZE else b"X-Pad: " + b"a" * 1000 + b"\r\n")
        except HttpError:
            break
    else:
        raise AssertionError("an endless trailer section was accepted")
