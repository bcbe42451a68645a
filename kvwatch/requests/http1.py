"""The slice of HTTP/1.1 the proxy speaks: message heads, chunked bodies, hop-by-hop headers.

Kept minimal and strict on purpose: a head that is not plainly valid is refused with a status the
caller can send (400, 431, 505) rather than guessed at. Header names and values are kept as the
peer sent them (bytes), so forwarded headers are byte-identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128
CRLF = b"\r\n"
HEAD_END = b"\r\n\r\n"

#: RFC 9110 §7.6.1 connection-specific fields, plus the framing fields the proxy sets itself.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
    b"upgrade", b"proxy-authenticate", b"proxy-authorization",
})
FRAMING = frozenset({b"content-length", b"transfer-encoding"})

Headers = list[tuple[bytes, bytes]]


class HttpError(Exception):
    """A message the proxy will not relay; ``status`` is what the peer should be told."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason


class _Head:
    """Header lookups through an index built once while parsing (names lower-cased)."""

    __slots__ = ()
    headers: Headers
    index: dict[bytes, list[bytes]]

    def get(self, name: bytes) -> bytes | None:
        values = self.index.get(name)
        return values[0] if values else None

    def tokens(self, name: bytes) -> set[bytes]:
        return {t.strip().lower() for v in self.index.get(name, ()) for t in v.split(b",")}

    def content_length(self) -> int | None:
        """Declared body length; raises on conflicting or malformed values (request smuggling)."""
        return _content_length(self.index.get(b"content-length"))

    def chunked(self) -> bool:
        return _chunked(self.tokens(b"transfer-encoding") if b"transfer-encoding" in self.index else set())


@dataclass(slots=True)
class RequestHead(_Head):
    method: bytes
    target: bytes
    version: bytes  # b"HTTP/1.1" | b"HTTP/1.0"
    headers: Headers
    index: dict[bytes, list[bytes]] = field(default_factory=dict)

    @property
    def keep_alive(self) -> bool:
        tokens = self.tokens(b"connection")
        if self.version == b"HTTP/1.0":
            return b"keep-alive" in tokens
        return b"close" not in tokens

    @property
    def path(self) -> bytes:
        return self.target.split(b"?", 1)[0]


@dataclass(slots=True)
class ResponseHead(_Head):
    version: bytes
    status: int
    reason: bytes
    headers: Headers
    index: dict[bytes, list[bytes]] = field(default_factory=dict)

    @property
    def closes(self) -> bool:
        return b"close" in self.tokens(b"connection")


def index_of(headers: Headers) -> dict[bytes, list[bytes]]:
    index: dict[bytes, list[bytes]] = {}
    for name, value in headers:
        index.setdefault(name.lower(), []).append(value)
    return index


def _parse_headers(lines: list[bytes]) -> tuple[Headers, dict[bytes, list[bytes]]]:
    if len(lines) > MAX_HEADERS:
        raise HttpError(431, "too many header fields")
    headers: Headers = []
    index: dict[bytes, list[bytes]] = {}
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or b" " in name or b"\t" in name:
            raise HttpError(400, "malformed header line")
        value = value.strip(b" \t")
        headers.append((name, value))
        index.setdefault(name.lower(), []).append(value)
    return headers, index


def parse_request_head(head: bytes) -> RequestHead:
    """``head`` is everything before the blank line (no trailing CRLF CRLF)."""
    lines = head.split(CRLF)
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1]:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are proxied")
    headers, index = _parse_headers(lines[1:])
    return RequestHead(method.upper(), target, version, headers, index)


def parse_response_head(head: bytes) -> ResponseHead:
    lines = head.split(CRLF)
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise HttpError(502, "upstream sent a malformed status line")
    try:
        headers, index = _parse_headers(lines[1:])
    except HttpError as exc:
        raise HttpError(502, f"upstream sent a malformed head ({exc.reason})") from None
    return ResponseHead(version, int(code), reason, headers, index)


def content_length(headers: Headers) -> int | None:
    """Declared body length; raises on conflicting or malformed values (request smuggling)."""
    return _content_length(index_of(headers).get(b"content-length"))


def _content_length(raw: list[bytes] | None) -> int | None:
    if not raw:
        return None
    values = {v.strip() for v in raw}
    if len(values) > 1:
        raise HttpError(400, "conflicting Content-Length values")
    value = values.pop()
    if not value.isdigit():
        raise HttpError(400, "malformed Content-Length")
    return int(value)


def is_chunked(headers: Headers) -> bool:
    return _chunked({t.strip().lower() for k, v in headers if k.lower() == b"transfer-encoding"
                     for t in v.split(b",")})


def _chunked(codings: set[bytes]) -> bool:
    if not codings:
        return False
    if codings != {b"chunked"}:
        raise HttpError(501, "only the chunked transfer coding is supported")
    return True


def end_to_end(head: RequestHead | ResponseHead, drop: frozenset[bytes] = frozenset()) -> Headers:
    """Headers minus hop-by-hop fields, fields named in Connection, framing, and ``drop``."""
    named = head.tokens(b"connection") if b"connection" in head.index else frozenset()
    return [(k, v) for k, v in head.headers
            if (low := k.lower()) not in HOP_BY_HOP and low not in FRAMING and low not in named
            and low not in drop]


def render_head(first_line: bytes, headers: Headers) -> bytes:
    return first_line + CRLF + b"".join(k + b": " + v + CRLF for k, v in headers) + CRLF


def frame_chunk(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


LAST_CHUNK = b"0\r\n\r\n"


class ChunkedDecoder:
    """Incremental decoder of a chunked body: ``feed`` returns the payload bytes available so far.

    Chunk extensions and trailers are read and dropped. ``done`` turns true after the last chunk;
    bytes after it (a pipelined next message) are kept in ``rest``.
    """

    __slots__ = ("_buf", "_need", "_state", "done", "rest")

    _SIZE, _DATA, _DATA_END, _TRAILER = range(4)

    def __init__(self) -> None:
        self._buf = b""
        self._need = 0
        self._state = self._SIZE
        self.done = False
        self.rest = b""

    def feed(self, data: bytes) -> bytes:
        if self.done:
            self.rest += data
            return b""
        if not self._buf and self._state == self._SIZE:  # fast path: exactly one whole chunk
            nl = data.find(CRLF, 0, 18)
            if nl > 0:
                try:
                    size = int(data[:nl], 16)
                except ValueError:
                    size = 0  # extensions or garbage: the general path decides
                end = nl + 2 + size
                if size > 0 and len(data) == end + 2 and data.endswith(CRLF):
                    return data[nl + 2:end]
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        pos, end = 0, len(buf)
        state, need = self._state, self._need
        while pos < end and not self.done:
            if state == self._DATA:
                take = min(need, end - pos)
                out.append(buf[pos:pos + take])
                pos += take
                need -= take
                if need:
                    break
                state = self._DATA_END
            elif state == self._DATA_END:
                if end - pos < 2:
                    break
                if buf[pos:pos + 2] != CRLF:
                    raise HttpError(502, "upstream chunk not followed by CRLF")
                pos += 2
                state = self._SIZE
            elif state == self._SIZE:
                nl = buf.find(CRLF, pos)
                if nl < 0:
                    if end - pos > 1024:
                        raise HttpError(502, "upstream chunk size line too long")
                    break
                size_text = buf[pos:nl].split(b";", 1)[0].strip()
                try:
                    need = int(size_text, 16)
                except ValueError:
                    raise HttpError(502, "upstream sent a malformed chunk size") from None
                pos = nl + 2
                state = self._DATA if need else self._TRAILER
            else:  # trailer section: lines until an empty one
                nl = buf.find(CRLF, pos)
                if nl < 0:
                    if end - pos > MAX_HEAD_BYTES:
                        raise HttpError(502, "upstream trailer section too long")
                    break
                if nl == pos:
                    self.done = True
                pos = nl + 2
        self._state, self._need = state, need
        if self.done:
            self._buf, self.rest = b"", buf[pos:]
        else:
            self._buf = buf[pos:] if pos < end else b""
        if len(out) == 1:
            return out[0]
        return b"".join(out)
