"""One client connection: the per-client HTTP/1.1 protocol.

Reads requests (head + body, within the slow-client timeout) and runs one exchange at a time
(keep-alive; pipelined bytes buffered, HTTP order kept). A request is "received" when its first
byte arrives, also when it waits in the buffer behind a response in progress (true pipelining):
``arrivals`` remembers when each buffered read came in, so TTFT and e2e include every moment the
request spent inside kvwatch. A request that begins on an idle connection is parsed one loop turn
after its read, so the other reads of that turn are stamped first: a burst of requests read in one
turn is not stamped one parse after another. What every connection buffers counts in
``proxy.max_buffered_bytes``.

A connection gets a ``ClientContext`` (the config, the buffer budget, the set of open connections, the
metering, and what its exchanges get), never the server.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import cast

from kvwatch.config import ProxyConfig
from kvwatch.requests.http1 import (
    HEAD_END,
    MAX_HEAD_BYTES,
    ChunkedDecoder,
    HttpError,
    RequestHead,
    parse_request_head,
)
from kvwatch.requests.proxy.answers import error_response
from kvwatch.requests.proxy.exchange import Exchange, ExchangeContext
from kvwatch.requests.proxy.metering import BufferBudget, Holding, Metering
from kvwatch.requests.proxy.seams import TIMED_OUT

log = logging.getLogger("kvwatch.requests.proxy")

PIPELINE_BYTES = 64 << 10  # client bytes buffered while a response is still streaming
MAX_ARRIVALS = 64  # read times kept for buffered bytes; later reads share the last one (earlier: never late)
LINGER_S = 2.0  # after refusing a request, how long its remaining bytes are read and dropped


@dataclass(frozen=True, slots=True)
class ClientContext:
    """What a replica's client connections share."""

    config: ProxyConfig
    budget: BufferBudget
    connections: set[ClientConnection]  # open and served (a shed one never joins)
    metering: Metering
    exchanges: ExchangeContext


class ClientConnection(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    def __init__(self, context: ClientContext) -> None:
        self.context = context
        self.config = context.config
        self.metering = context.metering
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head: RequestHead | None = None
        self.body = bytearray()
        self.body_length = 0
        self.body_decoder: ChunkedDecoder | None = None
        self.t0 = 0.0
        self.wall = 0.0
        self.exchange: Exchange | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.served = 0
        self.closed = False
        self.refused = False
        self.reading_paused = False
        self.parse_scheduled = False  # a request began in a read: parsed on the next loop turn
        self.read_total = 0  # bytes read from the client so far
        self.holding = Holding(context.budget)  # len(buf) + len(body)
        self.arrivals: deque[tuple[int, float, float]] = deque()  # (offset of a read, clock, wall)

    # -- asyncio callbacks ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = stream = cast(asyncio.Transport, transport)  # a stream transport (also uvloop's)
        context = self.context
        if len(context.connections) >= self.config.max_connections:
            self.metering.shed("connections")
            self.refused = True
            stream.write(error_response(503, "too many client connections (proxy.max_connections)", True))
            stream.close()
            return
        context.connections.add(self)
        self._arm_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        self.context.connections.discard(self)
        self.buf.clear()
        self.body = bytearray()
        self._account()
        if self.exchange is not None:
            self.exchange.client_gone()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        starts = not self.buf and self.head is None  # this read's first byte begins a request
        self._forget_arrivals(self.read_total - len(self.buf))
        if len(self.arrivals) < MAX_ARRIVALS:
            accounting = self.metering.accounting
            self.arrivals.append((self.read_total, accounting.clock(), accounting.wall_clock()))
        self.read_total += len(data)
        self.buf += data
        if self.exchange is not None:  # pipelined: the response in progress goes first (HTTP order)
            if len(self.buf) > PIPELINE_BYTES and not self.reading_paused and self.transport is not None:
                self.reading_paused = True
                self.transport.pause_reading()
            self._account()
            return
        if starts:  # accounted after the parse, as if parsed now: a whole request read is not held
            if self.served:  # an idle keep-alive connection: the request gets the whole timeout
                self._arm_timer()
            self.parse_scheduled = True
            asyncio.get_running_loop().call_soon(self._parse_scheduled)
            return
        if not self.parse_scheduled:
            self._parse()
        self._account()

    def _parse_scheduled(self) -> None:
        self.parse_scheduled = False
        if not self.closed and not self.refused:
            self._parse()
        self._account()

    def _account(self) -> None:
        """Keep the buffer budget current with this connection's buffers; over budget: 503."""
        if not self.holding.hold(len(self.buf) + len(self.body)) and not self.refused:
            self.metering.shed("buffer")
            self.body = bytearray()
            self._refuse(503, "the proxy holds as many request bytes as it may (proxy.max_buffered_bytes)")
            self._account()

    def _forget_arrivals(self, start: int) -> None:
        """Drop the read times of bytes before offset ``start`` (no request can begin there now)."""
        arrivals = self.arrivals
        while len(arrivals) > 1 and arrivals[1][0] <= start:
            arrivals.popleft()

    def _stamp_request_start(self) -> None:
        """t0 and started_at of the request whose first byte is ``buf[0]``: when that byte was read."""
        self._forget_arrivals(self.read_total - len(self.buf))
        _, self.t0, self.wall = self.arrivals[0]

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.pause_upstream(True)

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.pause_upstream(False)

    # -- request parsing --------------------------------------------------------------------------
    def _parse(self) -> None:
        config = self.config
        head = self.head
        if head is None:
            if not self.buf:
                return
            self._stamp_request_start()
            end = self.buf.find(HEAD_END, 0, MAX_HEAD_BYTES + len(HEAD_END))
            if end < 0:  # the limit holds however the head arrives, in one read or many
                if len(self.buf) >= MAX_HEAD_BYTES + len(HEAD_END):
                    self._refuse(431, "request head larger than 64 KiB")
                return
            try:
                head = parse_request_head(bytes(self.buf[:end]))
                length = head.content_length()
                chunked = head.chunked()
                if chunked and length is not None:
                    raise HttpError(400, "both Content-Length and Transfer-Encoding")
            except HttpError as exc:
                self._refuse(exc.status, exc.reason)
                return
            del self.buf[: end + 4]
            self.head = head
            if length is not None and length > config.max_body_bytes:
                self._refuse(
                    413,
                    f"request body of {length} bytes is over the proxy's limit of "
                    f"{config.max_body_bytes} (proxy.max_body_bytes)",
                    head,
                )
                return
            self.body_length = length or 0
            self.body_decoder = ChunkedDecoder(config.max_body_bytes, from_client=True) if chunked else None
            if (
                (head.get(b"expect") or b"").lower() == b"100-continue"
                and (chunked or length)
                and self.transport is not None
            ):
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.body_decoder is not None:
            try:
                self.body += self.body_decoder.feed(bytes(self.buf))
            except HttpError as exc:
                if exc.status == 413:  # announced over the limit: said now, not after the body timeout
                    self._refuse(413, f"{exc.reason} (proxy.max_body_bytes)", head)
                else:
                    self._refuse(400, "malformed chunked request body")
                return
            self.buf.clear()
            if len(self.body) > config.max_body_bytes:
                self._refuse(
                    413,
                    f"request body over the proxy's limit of {config.max_body_bytes} "
                    "bytes (proxy.max_body_bytes)",
                    head,
                )
                return
            if not self.body_decoder.done:
                return
            self.buf += self.body_decoder.rest
        else:
            need = self.body_length - len(self.body)
            if need:
                self.body += self.buf[:need]
                del self.buf[:need]
                if len(self.body) < self.body_length:
                    return
        self._cancel_timer()
        body = bytes(self.body)
        self.body = bytearray()
        exchange = self.exchange = Exchange(self.context.exchanges, self, head, body, self.t0, self.wall)
        try:
            exchange.start()
        except Exception:
            log.exception("proxy %s: could not start relaying a request", self.metering.replica)
            exchange.abandon()

    def exchange_done(self, keep_alive: bool) -> None:
        """The exchange in progress ended; serve the next request on this connection, or close."""
        self.exchange = None
        self.head = None
        self.body_decoder = None
        self.served += 1
        transport = self.transport
        if self.closed or transport is None:
            return
        if not keep_alive:
            transport.close()
            return
        if self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()
        if not self.buf:
            self._arm_timer(self.config.client_keepalive_timeout_s)
            return
        self._arm_timer()  # a pipelined request: received when its first byte came (arrivals)
        self._parse()
        self._account()

    def _refuse(self, status: int, reason: str, head: RequestHead | None = None) -> None:
        """Answer a request kvwatch will not relay, then close the connection.

        The rest of the request is read and dropped for a moment first (a lingering close, as
        nginx does), so a client still sending its body gets the answer rather than a reset.
        """
        self._cancel_timer()
        if head is not None and status == 413:
            self.metering.record_refusal(head, status, self.t0, self.wall)
        self.buf.clear()
        self.body = bytearray()
        self.refused = True
        transport = self.transport
        delivered = transport is not None and not self.closed
        if transport is not None and delivered:
            try:
                transport.write(error_response(status, reason, close=True))
                transport.write_eof()
            except OSError:  # the client already left (ENOTCONN from shutdown()): nobody to answer
                delivered = False
                transport.abort()
            else:
                asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        self.metering.refused(status, client_gone=not delivered)

    # -- slow clients -----------------------------------------------------------------------------
    def _arm_timer(self, seconds: float | None = None) -> None:
        """The slow-loris timer by default; ``exchange_done`` arms the keep-alive idle one instead."""
        self._cancel_timer()
        loop = asyncio.get_running_loop()
        timeout = self.config.client_header_timeout_s if seconds is None else seconds
        self.timer = loop.call_later(timeout, self._timed_out)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timed_out(self) -> None:
        self.timer = None
        if self.exchange is not None or self.closed or self.transport is None:
            return
        partial = bool(self.buf) or self.head is not None
        if partial or self.served == 0:  # an idle keep-alive connection just closes
            self.metering.counted(TIMED_OUT)
        if partial:
            self.transport.write(
                error_response(
                    408, "request head and body must arrive within proxy.client_header_timeout", True
                )
            )
        self.transport.close()
