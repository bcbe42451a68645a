"""Fuzz target for the proxy's HTTP/1 parsers (``kvwatch/requests/http1.py``).

One input is tried as a request head, a response head and a chunked body (fed whole, and byte
by byte). The invariants are what the proxy's safety rests on:

- a parser returns or raises ``HttpError``; nothing else escapes (no ValueError from ``int()``, no
  infinite loop: a hang is a finding);
- an accepted head holds no byte an engine's parser could read differently: names are tokens,
  values have no control character but HTAB, the target is visible ASCII; re-rendered as the proxy
  forwards it, it parses back to the same head;
- the chunked decoder gives the same payload (or the same refusal) however its input is split.

Run by hand, with coverage guidance (docs/security.md, "Testing hostile input")::

    .venv/bin/pip install atheris
    .venv/bin/python fuzz/http1.py -max_total_time=600 fuzz/corpus/http1

The normal test suite runs the same ``one_input`` under hypothesis for a few seconds
(``tests/requests/test_http1_fuzz.py``).
"""

from __future__ import annotations

import contextlib

from kvwatch.requests import http1
from kvwatch.requests.http1 import ChunkedDecoder, HttpError

# RFC 9110 §5.6.2 and §5.5, written out here rather than taken from the code under test
TCHAR = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
CONTROL = frozenset([*range(0x00, 0x09), *range(0x0A, 0x20), 0x7F])
VISIBLE_ASCII = frozenset(range(0x21, 0x7F))


def is_token(data: bytes) -> bool:
    return bool(data) and all(b in TCHAR for b in data)


def check_head_fields(headers: http1.Headers) -> None:
    for name, value in headers:
        assert is_token(name), name
        assert not any(b in CONTROL for b in value), value
        assert value == value.strip(b" \t")


def check_request_head(data: bytes) -> None:
    try:
        head = http1.parse_request_head(data)
    except HttpError:
        return
    assert is_token(head.method)
    assert head.target and all(b in VISIBLE_ASCII for b in head.target)
    assert head.target[:1] == b"/" or head.target == b"*"
    check_head_fields(head.headers)
    forwarded = http1.render_head(head.method + b" " + head.target + b" " + head.version, head.headers)
    again = http1.parse_request_head(forwarded[:-4])
    assert (again.method, again.target, again.version, again.headers) == (
        head.method,
        head.target,
        head.version,
        head.headers,
    )
    for check in (head.content_length, head.chunked):
        with contextlib.suppress(HttpError):
            check()


def check_response_head(data: bytes) -> None:
    try:
        head = http1.parse_response_head(data)
    except HttpError as exc:
        assert exc.status == 502
        return
    assert 100 <= head.status <= 999  # three digits when the proxy renders it again
    check_head_fields(head.headers)
    forwarded = http1.render_head(b"HTTP/1.1 %d %b" % (head.status, head.reason), head.headers)
    again = http1.parse_response_head(forwarded[:-4])
    assert (again.status, again.reason, again.headers) == (head.status, head.reason, head.headers)


def decode(
    pieces: list[bytes], max_body: int | None = None, from_client: bool = False
) -> tuple[bytes, bool, bytes] | str:
    decoder = ChunkedDecoder(max_body, from_client=from_client)
    out = bytearray()
    try:
        for piece in pieces:
            out += decoder.feed(piece)
    except HttpError as exc:
        return f"refused {exc.status}"
    return bytes(out), decoder.done, decoder.rest


CLIENT_BODY_LIMIT = 64  # small, so that fuzzed sizes cross it


def check_chunked(data: bytes) -> None:
    bytewise = [data[i : i + 1] for i in range(len(data))]
    whole = decode([data])
    assert whole == decode(bytewise), whole
    # a client's body: the strict grammar and the body limit, the same however the input is split
    strict = decode([data], CLIENT_BODY_LIMIT, from_client=True)
    assert strict == decode(bytewise, CLIENT_BODY_LIMIT, from_client=True), strict
    if not isinstance(strict, str):  # what a client may send, an engine may send too, read alike
        assert strict == whole and len(strict[0]) <= CLIENT_BODY_LIMIT
    # the proxy's fast path: a read whole_chunk takes is one chunk feed reads alike, framed as the
    # proxy would frame its payload, so relaying it as it came changes no byte
    start = ChunkedDecoder().whole_chunk(data)
    if start:
        payload = data[start:-2]
        assert whole == (payload, False, b""), whole
        assert http1.frame_chunk(payload) == data


def one_input(data: bytes) -> None:
    check_request_head(data)
    check_response_head(data)
    check_chunked(data)


if __name__ == "__main__":
    from atheris_main import fuzz  # fuzz/ is the script's folder, so it is on sys.path

    fuzz(one_input)
