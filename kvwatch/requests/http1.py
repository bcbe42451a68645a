"""The slice of HTTP/1.1 the proxy speaks: message heads, chunked bodies, hop-by-hop headers.

Kept minimal and strict on purpose: a head that is not plainly valid is refused with a status the
caller can send (400, 431, 505) rather than guessed at. Header names and values are kept as the
peer sent them (bytes), so forwarded headers are byte-identical.

Strict means RFC 9112's grammar, as nginx and Envoy apply it: a header name is a token; a value
holds no control character but HTAB (no CR, LF or NUL: an engine whose parser splits on a bare LF,
h11 for one, would otherwise read a header kvwatch never saw, and a smuggled request follows); the
request target is visible ASCII; a chunk size is hex digits only. Each check is one precompiled
regular expression over a bounded line, so a head costs linear time and no chunk costs more than
one ``fullmatch`` of its size line (docs/security.md lists every limit).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import unquote_to_bytes

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128
MAX_CHUNK_LINE = 1024  # a chunk-size line with its extensions
MAX_CHUNK_SIZE_DIGITS = 16  # 16 hex digits: 2**64 - 1, more than any body
MAX_CONTENT_LENGTH_DIGITS = 18
CRLF = b"\r\n"
HEAD_END = b"\r\n\r\n"

#: RFC 9110 §7.6.1 connection-specific fields, plus the framing fields the proxy sets itself.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-authorization",
    }
)
FRAMING = frozenset({b"content-length", b"transfer-encoding"})

Headers = list[tuple[bytes, bytes]]

_TCHAR = rb"!#$%&'*+\-.^_`|~0-9A-Za-z"
#: ``field-name ":" OWS field-value OWS``: a token, then anything but control characters (HTAB is
#: whitespace); obs-text (0x80-0xFF) is allowed in values, as RFC 9110 §5.5 keeps it
FIELD_LINE = re.compile(rb"([" + _TCHAR + rb"]+):([^\x00-\x08\x0a-\x1f\x7f]*)")
TOKEN = re.compile(rb"[" + _TCHAR + rb"]+")
#: origin-form, absolute-form, authority-form or "*": visible ASCII, nothing else (RFC 9112 §3.2)
TARGET = re.compile(rb"[\x21-\x7e]+")
REASON = re.compile(rb"[\t \x21-\x7e\x80-\xff]*")
_X = frozenset(b"xX")
_QUOTED = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
#: ``chunk-size *( BWS ";" BWS ext-name [ BWS "=" BWS ( token / quoted-string ) ] )`` (RFC 9112 §7.1.1):
#: whitespace only before a ";", so ``5 `` (a size with trailing whitespace) is malformed. That is
#: how a client's chunk line is read; an engine's may end in whitespace, as h11 allows it
#: (h11/_abnf.py ``chunk_header``: "some servers in the wild use it"), so no response breaks on it
CHUNK_LINE = re.compile(
    rb"([0-9A-Fa-f]{1,%d})(?:[ \t]*;[ \t]*[%b]+(?:[ \t]*=[ \t]*(?:[%b]+|%b))?)*"
    % (MAX_CHUNK_SIZE_DIGITS, _TCHAR, _TCHAR, _QUOTED)
)
CHUNK_LINE_OWS = re.compile(CHUNK_LINE.pattern + rb"[ \t]*")


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
        """The path an ASGI server routes on: percent-decoded, without the query (uvicorn's h11 and
        httptools back ends both ``unquote`` it before FastAPI matches routes)."""
        path = self.target.split(b"?", 1)[0]
        return unquote_to_bytes(path) if b"%" in path else path


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
    match = FIELD_LINE.fullmatch
    for line in lines:
        field_line = match(line)
        if field_line is None:
            raise HttpError(400, _field_problem(line))
        name, value = field_line.group(1), field_line.group(2).strip(b" \t")
        headers.append((name, value))
        index.setdefault(name.lower(), []).append(value)
    return headers, index


def _field_problem(line: bytes) -> str:
    """Why a header line was refused, without echoing it (it may carry a credential)."""
    name, sep, _ = line.partition(b":")
    if not sep or not name:
        return "malformed header line"
    if TOKEN.fullmatch(name) is None:
        return "header name is not a token"
    return "control character (CR, LF, NUL, ...) in a header value"


def parse_request_head(head: bytes) -> RequestHead:
    """``head`` is everything before the blank line (no trailing CRLF CRLF)."""
    lines = head.split(CRLF)
    parts = lines[0].split(b" ")
    if len(parts) != 3 or TOKEN.fullmatch(parts[0]) is None:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if TARGET.fullmatch(target) is None:
        raise HttpError(400, "request target holds a control or non-ASCII character")
    target = origin_form(target, method)
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        if version.startswith(b"HTTP/") and len(version) == 8:
            raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are proxied")
        raise HttpError(400, "malformed request line")
    headers, index = _parse_headers(lines[1:])
    return RequestHead(method.upper(), target, version, headers, index)


_ABSOLUTE = re.compile(rb"[Hh][Tt][Tt][Pp][Ss]?://[^/?#]*")


def origin_form(target: bytes, method: bytes) -> bytes:
    """The target as it is sent to the engine: origin-form (RFC 9112 §3.2).

    An absolute-form target (``http://host/v1/chat/completions``) becomes its path and query, as
    nginx forwards it and as uvicorn's httptools back end routes it; the engine is told its own Host.
    Anything but origin-form, absolute-form or ``OPTIONS *`` is refused.
    """
    if target[:1] == b"/" or (target == b"*" and method == b"OPTIONS"):
        return target
    authority = _ABSOLUTE.match(target)
    if authority is None:
        raise HttpError(400, "request target is not origin-form or absolute-form")
    rest = target[authority.end() :]
    if rest[:1] == b"#":
        rest = b""
    return rest if rest[:1] == b"/" else b"/" + rest


def parse_response_head(head: bytes) -> ResponseHead:
    lines = head.split(CRLF)
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if (
        version not in (b"HTTP/1.1", b"HTTP/1.0")
        or len(code) != 3
        or not code.isdigit()
        or code[:1] == b"0"
        or REASON.fullmatch(reason) is None
    ):  # 002 is no class: forwarded as 2
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
    if not value.isdigit() or len(value) > MAX_CONTENT_LENGTH_DIGITS:
        raise HttpError(400, "malformed Content-Length")
    return int(value)


def is_chunked(headers: Headers) -> bool:
    return _chunked(
        {t.strip().lower() for k, v in headers if k.lower() == b"transfer-encoding" for t in v.split(b",")}
    )


def _chunked(codings: set[bytes]) -> bool:
    if not codings:
        return False
    if codings != {b"chunked"}:
        raise HttpError(501, "only the chunked transfer coding is supported")
    return True


def end_to_end(head: RequestHead | ResponseHead, drop: frozenset[bytes] = frozenset()) -> Headers:
    """Headers minus hop-by-hop fields, fields named in Connection, framing, and ``drop``."""
    named = head.tokens(b"connection") if b"connection" in head.index else frozenset()
    return [
        (k, v)
        for k, v in head.headers
        if (low := k.lower()) not in HOP_BY_HOP
        and low not in FRAMING
        and low not in named
        and low not in drop
    ]


def render_head(first_line: bytes, headers: Headers) -> bytes:
    return first_line + CRLF + b"".join(k + b": " + v + CRLF for k, v in headers) + CRLF


def frame_chunk(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


LAST_CHUNK = b"0\r\n\r\n"


class ChunkedDecoder:
    """Incremental decoder of a chunked body: ``feed`` returns the payload bytes available so far.

    RFC 9112 §7.1: a chunk size is 1-16 hex digits (no sign, ``0x``, ``_`` or space: ``int(x, 16)``
    takes all of those, and a negative size once moved the decoder backwards forever); extensions
    are checked against the grammar and dropped; trailer fields are checked like header fields,
    bounded like a head, and dropped. Every step consumes input, so a feed ends in time linear in
    its bytes. ``done`` turns true after the last chunk; bytes after it (a pipelined next message)
    are kept in ``rest``. Errors are ``HttpError(502)``: the client side answers them with 400.
    A client's body (``from_client``) is read to the letter of the grammar: no whitespace after a
    size or an extension; with ``max_body``, chunk sizes that together announce more payload than
    that are refused at once (``HttpError(413)``), before their bytes are waited for.
    """

    __slots__ = (
        "_announced",
        "_buf",
        "_line",
        "_max_body",
        "_need",
        "_state",
        "_trailer_bytes",
        "_trailers",
        "done",
        "rest",
    )

    _SIZE, _DATA, _DATA_END, _TRAILER = range(4)

    def __init__(self, max_body: int | None = None, *, from_client: bool = False) -> None:
        self._max_body = max_body
        self._line = CHUNK_LINE if from_client else CHUNK_LINE_OWS
        self._announced = 0  # payload bytes the chunk sizes read so far announce
        self._buf = b""
        self._need = 0
        self._state = self._SIZE
        self._trailer_bytes = 0
        self._trailers = 0
        self.done = False
        self.rest = b""

    def whole_chunk(self, data: bytes) -> int:
        """Where the payload starts when ``data`` is exactly one whole chunk, framed as ``frame_chunk``
        frames it (lowercase hex size, no extension), with nothing pending and no body limit to count
        against (the engine's side): such a read may leave for the client as it came. 0 otherwise.

        Nothing is consumed: the decoder stays between chunks either way, as ``feed`` would leave it.
        """
        if self._buf or self._state != self._SIZE or self.done or self._max_body is not None:
            return 0
        nl = data.find(CRLF, 0, 18)
        size = len(data) - nl - 4
        if nl > 0 and size > 0 and data.endswith(CRLF) and data[:nl] == b"%x" % size:
            return nl + 2
        return 0

    def feed(self, data: bytes) -> bytes:
        if self.done:
            self.rest += data
            return b""
        if not self._buf and self._state == self._SIZE:  # fast path: exactly one whole chunk
            nl = data.find(CRLF, 0, 18)
            if nl > 0:
                digits = data[:nl]
                # int(x, 16) also takes a sign, spaces, "_" and a "0x" prefix; ASCII letters and digits
                # only, no x in second place, leaves what int() refuses (g-z) or what is hex
                if digits.isalnum() and (nl == 1 or digits[1] not in _X):
                    try:
                        size = int(digits, 16)
                    except ValueError:
                        size = 0  # garbage: the general path refuses it
                    end = nl + 2 + size
                    if size > 0 and len(data) == end + 2 and data.endswith(CRLF):
                        if self._max_body is None:  # the engine's side: no limit to check (_announce)
                            self._announced += size
                        else:
                            self._announce(size)
                        return data[nl + 2 : end]
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        pos, end = 0, len(buf)
        state, need = self._state, self._need
        while pos < end and not self.done:
            if state == self._DATA:
                take = min(need, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                need -= take
                if need:
                    break
                state = self._DATA_END
            elif state == self._DATA_END:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != CRLF:
                    raise HttpError(502, "chunk data not followed by CRLF")
                pos += 2
                state = self._SIZE
            elif state == self._SIZE:
                nl = buf.find(CRLF, pos, pos + MAX_CHUNK_LINE + 2)
                if nl < 0:
                    if end - pos > MAX_CHUNK_LINE:
                        raise HttpError(502, "chunk size line too long")
                    break
                line = self._line.fullmatch(buf, pos, nl)
                if line is None:
                    raise HttpError(502, "malformed chunk size (1-16 hex digits, RFC 9112 §7.1)")
                need = int(line.group(1), 16)
                self._announce(need)
                pos = nl + 2
                state = self._DATA if need else self._TRAILER
            else:  # trailer section: field lines until an empty one
                nl = buf.find(CRLF, pos, pos + MAX_HEAD_BYTES + 2)
                if nl < 0:
                    if end - pos > MAX_HEAD_BYTES:
                        raise HttpError(502, "trailer section too long")
                    break
                if nl == pos:
                    self.done = True
                else:
                    self._trailer_line(buf, pos, nl)
                pos = nl + 2
        self._state, self._need = state, need
        if self.done:
            self._buf, self.rest = b"", buf[pos:]
        else:
            self._buf = buf[pos:] if pos < end else b""
        if len(out) == 1:
            return out[0]
        return b"".join(out)

    def _announce(self, size: int) -> None:
        self._announced += size
        if self._max_body is not None and self._announced > self._max_body:
            raise HttpError(
                413, f"chunk sizes announce {self._announced} bytes, over the body limit of {self._max_body}"
            )

    def _trailer_line(self, buf: bytes, pos: int, nl: int) -> None:
        self._trailer_bytes += nl - pos + 2
        self._trailers += 1
        if self._trailer_bytes > MAX_HEAD_BYTES or self._trailers > MAX_HEADERS:
            raise HttpError(502, "trailer section too long")
        if FIELD_LINE.fullmatch(buf, pos, nl) is None:
            raise HttpError(502, "malformed trailer field")
