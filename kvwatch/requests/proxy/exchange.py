"""One request relayed: the engine connection it goes out on, the response back, its accounting.

Driven by callbacks: the client connection starts it once the request is read; the engine connection
calls ``on_head``, ``on_body`` per read and ``on_end``. An event stream passes through the usage
relay (``relay.py``); everything else is relayed as it comes. Output to the client is written once
per engine read (``flush``).

An exchange is in one ``Phase`` at a time and moves only along ``TRANSITIONS`` (as h11 models a
connection): a move the table does not list is a bug in kvwatch and raises ``PhaseError``. What it
uses of the replica comes in an ``ExchangeContext`` (the engine, the metering, the buffer budget),
and of its client through ``Downstream``: it never sees the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from dataclasses import dataclass
from typing import Protocol

from kvwatch.model import InFlightRequest
from kvwatch.requests import sse
from kvwatch.requests.accounting import (
    End,
    RequestInfo,
    RequestMeter,
    body_requesting_usage,
    estimate_prompt_tokens,
    inspect_request,
)
from kvwatch.requests.http1 import LAST_CHUNK, RequestHead, ResponseHead, end_to_end, frame_chunk, render_head
from kvwatch.requests.proxy.answers import error_response
from kvwatch.requests.proxy.metering import METERED_PATHS, BufferBudget, Holding, Metering
from kvwatch.requests.proxy.pool import Engine, EngineConnection
from kvwatch.requests.proxy.relay import UsageRelay

log = logging.getLogger("kvwatch.requests.proxy")

__all__ = ["METERED_PATHS", "Downstream", "Exchange", "ExchangeContext", "Phase", "PhaseError"]

MAX_CAPTURE_BYTES = 8 << 20  # non-streaming response bodies read for usage


class Phase(enum.Enum):
    SENDING_UPSTREAM = "sending upstream"  # waiting for an engine connection (pooled or connecting)
    AWAITING_HEAD = "awaiting the response head"  # the request is written on an engine connection
    HEAD_READ = "head read"  # the response head is ready for the client; nothing written to it yet
    STREAMING = "streaming"  # bytes of the response reached the client
    DONE = "done"  # the response ended complete
    FAILED = "failed"  # ended otherwise: the engine failed, the client left, or kvwatch gave up


TERMINAL = frozenset({Phase.DONE, Phase.FAILED})
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.SENDING_UPSTREAM: frozenset({Phase.AWAITING_HEAD, *TERMINAL}),
    # back to SENDING_UPSTREAM: the engine refused include_usage, or a pooled connection was closed
    Phase.AWAITING_HEAD: frozenset({Phase.SENDING_UPSTREAM, Phase.HEAD_READ, *TERMINAL}),
    Phase.HEAD_READ: frozenset({Phase.STREAMING, *TERMINAL}),
    Phase.STREAMING: TERMINAL,
    Phase.DONE: frozenset(),
    Phase.FAILED: frozenset(),
}


class PhaseError(RuntimeError):
    """A phase change ``TRANSITIONS`` does not allow: a bug in kvwatch, never the peer's doing."""


class Downstream(Protocol):
    """The client connection as an exchange uses it (``ClientConnection``)."""

    closed: bool

    @property
    def transport(self) -> asyncio.Transport | None: ...

    def exchange_done(self, keep_alive: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class ExchangeContext:
    """What a replica's exchanges share: the engine, the accounting, the buffer budget, a timeout."""

    engine: Engine
    metering: Metering
    budget: BufferBudget
    upstream_read_timeout_s: float


class Exchange:
    """One request: upstream connection, response relay, accounting. Driven by callbacks."""

    def __init__(
        self,
        context: ExchangeContext,
        client: Downstream,
        head: RequestHead,
        body: bytes,
        t0: float,
        wall: float,
    ) -> None:
        self.context = context
        self.metering = context.metering
        self.client = client
        self.down = client.transport
        self.head = head
        self.body = body
        self.t0 = t0
        self.wall = wall
        self.phase = Phase.SENDING_UPSTREAM
        self.info: RequestInfo | None = None  # a metered request's, as the client wrote it
        self.meter: RequestMeter | None = None
        self.handle: int | None = None
        self.request = b""  # what is sent upstream; both dropped once the response head came
        self.holding = Holding(context.budget)  # body + request + capture
        self.relay_holding = Holding(context.budget)  # what the usage relay holds back
        self.up: EngineConnection | None = None
        self.status: int | None = None
        self.keep_alive = head.keep_alive
        self.down_chunked = False  # the response goes to the client chunked
        self.relay: UsageRelay | None = None  # an event stream this exchange reads
        self.strip = False  # kvwatch asked for usage: its usage chunk is removed
        self.retried = False  # the engine refused include_usage once; the client's own body was sent
        self.capture: bytearray | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.out = b""  # bytes for the client, written once per upstream read (see flush)

    # -- phases -----------------------------------------------------------------------------------
    def _to(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise PhaseError(f"exchange cannot go from {self.phase.value} to {phase.value}")
        self.phase = phase

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL

    @property
    def method(self) -> bytes:
        return self.head.method

    # -- the request ------------------------------------------------------------------------------
    def start(self) -> None:
        self.context.engine.begin()  # matched by end() in _end, which every started exchange reaches
        endpoint = METERED_PATHS.get(self.head.path) if self.head.method == b"POST" else None
        injected = self._read_request(endpoint) if endpoint else None
        self.strip = injected is not None
        self.request = self._upstream_request(injected if injected is not None else self.body)
        self._budget()
        self._send()
        # after the write: the engine starts on the request while the meter is made (no response can
        # be read before this returns to the loop, and t0 is when the request's first byte came)
        if self.info is not None and not self.finished:
            self._start_meter(self.info)

    def _budget(self) -> None:
        """Count the bytes this exchange holds (the request body, what goes upstream, a JSON response
        read for its usage) in proxy.max_buffered_bytes."""
        held = len(self.body) + len(self.request) + (len(self.capture) if self.capture is not None else 0)
        self.holding.hold(held)

    def _budget_relay(self, relay: UsageRelay, held: int) -> None:
        """Count what the usage relay holds back in the budget; over it the relay holds nothing more:
        what it kept goes to the client now, and the rest of the stream passes as it comes."""
        if not self.relay_holding.hold(held):
            out = relay.overflow()
            events, sep = relay.events, relay.sep
            if out:
                self._emit(frame_chunk(out) if self.down_chunked else out)
            if events and sep is not None:
                self._meter_events(events, sep)
            self.relay_holding.release()

    def _drop_request(self) -> None:
        """The response head came: no retry can need the request now, so its bytes go."""
        self.body = self.request = b""
        self._budget()

    def _drop_capture(self) -> None:
        self.capture = None
        self._budget()

    def _send(self) -> None:
        """On a pooled connection right now, else on a new one from a task."""
        engine = self.context.engine
        protocol = engine.take()
        if protocol is not None:
            self._attach(protocol, reused=True)
        else:
            engine.spawn(self._connect())

    async def _connect(self) -> None:
        up = self.context.engine.address
        try:
            protocol = await self.context.engine.connect()
        except TimeoutError:
            self._fail_before_head(504, f"timed out connecting to the engine at {up.host}:{up.port}")
            return
        except OSError as exc:
            self._fail_before_head(
                502,
                f"cannot connect to the engine at {up.host}:{up.port} ({exc.strerror or type(exc).__name__})",
            )
            return
        if self.finished:  # the client left while we connected
            protocol.abort()
            return
        self._attach(protocol, reused=False)

    def _attach(self, protocol: EngineConnection, reused: bool) -> None:
        self._to(Phase.AWAITING_HEAD)
        self.up = protocol
        protocol.attach(self, reused)
        protocol.write(self.request)
        self._watch_upstream(protocol, protocol.reads)

    def retry_without_usage(self) -> None:
        """The engine refused the body with include_usage (400/422): send the client's own body.

        Counted if that succeeds; it changes nothing for the next request (``usage_injection_refused``).
        """
        if self.finished:
            return
        self._to(Phase.SENDING_UPSTREAM)
        self.retried, self.strip, self.status = True, False, None
        self.request = self._upstream_request(self.body)
        self._budget()
        self._send()

    def retry_fresh(self) -> None:
        """A pooled connection closed before answering anything: the request again, on a new one."""
        self._to(Phase.SENDING_UPSTREAM)
        self.status = None
        self.context.engine.spawn(self._connect())

    def _end(self, end: End) -> None:
        """The one way out: release the request, hand the client connection on, then record it."""
        if self.finished:
            return
        self._to(Phase.DONE if end is End.COMPLETE else Phase.FAILED)
        self._drop_request()
        self._drop_capture()
        self.relay_holding.release()
        self.flush()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        metering = self.metering
        if self.retried and end is End.COMPLETE and self.status is not None and self.status < 400:
            metering.usage_injection_refused()
        meter = self.meter
        if meter is not None and meter.e2e is None:
            try:
                meter.on_end(metering.accounting.clock())  # e2e ends now, not when the record is built
            except Exception as exc:
                self.meter = None
                metering.accounting_failed("end", exc)
        # the connection goes on first: its next request (pipelined, or arriving as the client reads
        # this response's end) is not held behind this one's record, sink, ledger line and in-flight
        # entry, which run on the next loop turn, once each
        self.client.exchange_done(self.keep_alive and end is End.COMPLETE)
        self.context.engine.end()
        asyncio.get_running_loop().call_soon(self._finish, end)

    def abandon(self) -> None:
        """A bug in kvwatch: drop what is in flight and close the client connection."""
        self.keep_alive = False
        if self.up is not None:
            self.up.abort()
        self._end(End.UPSTREAM_FAILED)

    def _read_request(self, endpoint: str) -> bytes | None:
        """What the meter and the engine need of the body: its ``info``, and the body with usage
        asked where the proxy asks it. A failure here leaves the request unmetered, as sent."""
        try:
            info = inspect_request(self.body, endpoint)
            injected = body_requesting_usage(self.body, info) if self.metering.asks_usage() else None
        except Exception as exc:
            self.metering.accounting_failed("request", exc)
            return None
        self.info = info
        return injected

    def _start_meter(self, info: RequestInfo) -> None:
        metering = self.metering
        try:
            model = metering.labels.label(info.model)
            self.handle = metering.accounting.in_flight.start(
                InFlightRequest(
                    metering.replica,
                    model,
                    metering.accounting.bands.band_for(info.max_tokens),
                    estimate_prompt_tokens(info.body_bytes),
                    0,
                    self.wall,
                    info.max_tokens,
                )
            )
            self.meter = metering.accounting.meter_factory(
                metering.replica, model, info, self.wall, self.t0, metering.accounting.in_flight, self.handle
            )
        except Exception as exc:
            self.meter = None
            metering.accounting_failed("request", exc)

    def _finish(self, end: End) -> None:
        """The request's bookkeeping: its record to the sink, its in-flight entry closed."""
        metering = self.metering
        prompt_tokens = None  # the engine's count, where usage came: it calibrates prompt estimates
        if self.meter is not None:
            try:
                record = self.meter.record(self.status, end)
            except Exception as exc:
                metering.accounting_failed("record", exc)
            else:
                metering.emit(record)
                prompt_tokens = record.prompt_tokens
        if self.handle is not None:
            try:
                metering.accounting.in_flight.finish(self.handle, prompt_tokens)
            except Exception as exc:
                metering.accounting_failed("in_flight", exc)

    def _upstream_request(self, body: bytes) -> bytes:
        up = self.context.engine.address
        drop = {b"host", b"expect"}
        if self.info is not None and self.info.streaming:
            drop.add(b"accept-encoding")  # the relay reads the event stream: identity encoding
        headers = end_to_end(self.head, frozenset(drop))
        headers.append((b"host", up.host_header))
        if body or self.head.method in (b"POST", b"PUT", b"PATCH"):
            headers.append((b"content-length", b"%d" % len(body)))
        target = self.head.target if self.head.target == b"*" else up.base_path + self.head.target
        line = self.head.method + b" " + target + b" HTTP/1.1"
        return render_head(line, headers) + body

    # -- upstream idle timeout (checked once per interval, not reset per chunk) --------------------
    def _watch_upstream(self, protocol: EngineConnection, reads: int) -> None:
        loop = asyncio.get_running_loop()
        self.idle_timer = loop.call_later(
            self.context.upstream_read_timeout_s, self._check_upstream, protocol, reads
        )

    def _check_upstream(self, protocol: EngineConnection, reads: int) -> None:
        self.idle_timer = None
        if self.finished or protocol is not self.up:
            return
        if protocol.reads != reads:
            self._watch_upstream(protocol, protocol.reads)
            return
        protocol.abort()
        self._upstream_failed(504, "the engine sent nothing for proxy.upstream_read_timeout")

    # -- output to the client ------------------------------------------------------------------------
    def _emit(self, data: bytes) -> None:
        self.out = self.out + data if self.out else data

    def flush(self) -> None:
        """One write per upstream read: a response head and its first events, or a final chunk,
        the end of the stream and the last-chunk marker, leave in one syscall, not three."""
        if self.out:
            out, self.out = self.out, b""
            if not self.client.closed and self.down is not None:
                if self.phase is Phase.HEAD_READ:
                    self._to(Phase.STREAMING)
                self.down.write(out)

    # -- callbacks from the upstream connection ---------------------------------------------------
    def on_head(self, head: ResponseHead, length: int | None, has_body: bool) -> bool:
        """The response head arrived; returns False to discard this response (retry)."""
        self.status = head.status
        if self.strip and head.status in (400, 422):
            return False  # the upstream connection drops this answer and calls retry_without_usage
        if self.finished:
            return False
        metered = self.meter is not None
        content_type = (head.get(b"content-type") or b"").lower()
        encoded = (head.get(b"content-encoding") or b"identity").lower() != b"identity"
        if (
            (metered or self.strip)
            and head.status == 200
            and not encoded
            and content_type.startswith(b"text/event-stream")
        ):
            info = self.info
            self.relay = UsageRelay(
                self.strip,
                info is not None and info.streaming and not info.wants_usage,
                info is not None and info.continuous_usage,
            )
        elif metered and head.status == 200 and not encoded and content_type.startswith(b"application/json"):
            self.capture = bytearray()
        headers = end_to_end(head)
        if not has_body:
            if length is not None and self.head.method == b"HEAD":
                headers.append((b"content-length", b"%d" % length))
        elif length is not None and self.relay is None:
            headers.append((b"content-length", b"%d" % length))
        elif self.head.version == b"HTTP/1.1":
            headers.append((b"transfer-encoding", b"chunked"))
            self.down_chunked = True
        else:
            self.keep_alive = False  # HTTP/1.0 client: the body ends when the connection does
        if not self.keep_alive:
            headers.append((b"connection", b"close"))
        self._emit(render_head(b"HTTP/1.1 %d %b" % (head.status, head.reason), headers))
        self._to(Phase.HEAD_READ)
        self._drop_request()
        return True

    def pass_chunk(self, frame: bytes, start: int) -> bool:
        """Hot path, one engine read at an engine's pace: ``frame`` is one whole chunk, framed as this
        exchange would frame it (``ChunkedDecoder.whole_chunk``; its payload from ``start``), and holds
        one complete content event that the relay would pass unchanged (no usage, no finish reason,
        nothing carried or held). It leaves as it came, in one write, and the meter counts it: what
        ``on_body`` and ``flush`` would do, without de-chunking and framing it again.

        False, with nothing changed, leaves the read to the general path.
        """
        relay = self.relay
        if (
            relay is None
            or relay.carry
            or relay.held is not None
            or relay.plain
            or relay.done
            or self.out
            or not self.down_chunked
            or self.phase is not Phase.STREAMING
        ):
            return False
        sep = relay.sep
        end = len(frame) - 2
        if (
            sep is None
            or frame.find(sep, start) != end - len(sep)
            or not sse.is_plain_content(frame, start, end)
        ):
            return False
        meter = self.meter
        if meter is not None:
            try:
                meter.on_content(1, self.metering.accounting.clock())
            except Exception as exc:
                self.meter = None
                self.metering.accounting_failed("stream", exc)
        if not self.client.closed and self.down is not None:
            self.down.write(frame)
        return True

    def on_body(self, data: bytes) -> None:
        relay = self.relay
        if relay is not None:  # hot path: one event stream's read
            out = relay.feed(data)
            if out:
                self._emit(b"%x\r\n%b\r\n" % (len(out), out) if self.down_chunked else out)
            events, sep, meter = relay.events, relay.sep, self.meter
            if events and sep is not None and meter is not None:
                try:
                    meter.on_events(events, sep, self.metering.accounting.clock())
                except Exception as exc:
                    self.meter = None
                    self.metering.accounting_failed("stream", exc)
            if relay.noted:
                self._take_notes(relay)
            held = len(relay.carry) + relay.held_bytes
            if held != self.relay_holding.held:
                self._budget_relay(relay, held)
            if relay.done and self.down_chunked:
                self._stream_done()
            return
        self._emit(b"%x\r\n%b\r\n" % (len(data), data) if self.down_chunked else data)
        if self.capture is not None:
            if len(self.capture) + len(data) <= MAX_CAPTURE_BYTES and self.context.budget.fits(len(data)):
                self.capture += data
            else:
                self.capture = None  # usage unread, as for a body over MAX_CAPTURE_BYTES
            self._budget()

    def _meter_events(self, events: bytes, sep: bytes) -> None:
        meter = self.meter
        if meter is not None:
            try:
                meter.on_events(events, sep, self.metering.accounting.clock())
            except Exception as exc:
                self.meter = None
                self.metering.accounting_failed("stream", exc)

    def _send_events(self, events: bytes, sep: bytes) -> None:
        self._emit(frame_chunk(events) if self.down_chunked else events)
        self._meter_events(events, sep)

    def _take_notes(self, relay: UsageRelay) -> None:
        """What the usage relay saw: usage for the meter, errors to count, an engine that forces usage."""
        relay.noted = False
        errors, relay.errors = relay.errors, []
        for exc in errors:
            self.metering.accounting_failed("usage", exc)
        if relay.forced_usage:
            self.metering.engine_sends_usage_unasked()
        usage, relay.usage = relay.usage, None
        if usage is not None:
            self._usage(usage)

    def _stream_done(self) -> None:
        """``[DONE]`` is relayed: the client has its whole response now. The engine may write its
        last-chunk marker late (vLLM's frontend, under load, by seconds); that tail is not the
        client's wait, so the response ends here and the upstream connection reads the rest on its
        own (``release_tail``), while a next request on this client connection goes at once."""
        if self.up is not None:
            self.up.release_tail()
        self.on_end()

    def _usage(self, usage: sse.Usage) -> None:
        if self.meter is not None:
            try:
                self.meter.on_usage(usage)
            except Exception as exc:
                self.meter = None
                self.metering.accounting_failed("usage", exc)

    def _release_held(self, relay: UsageRelay) -> bytes:
        """End of stream: send what the relay held, as it was; returns the incomplete rest."""
        held, carry = relay.finish()
        if held and relay.sep is not None and not self.client.closed:
            self._send_events(held, relay.sep)
        return carry

    def on_end(self) -> None:
        """The response was read in full."""
        if self.relay is not None:
            carry = self._release_held(self.relay)
            if carry:
                self._emit(frame_chunk(carry) if self.down_chunked else carry)
        if self.down_chunked:
            self._emit(LAST_CHUNK)
        meter = self.meter
        if meter is not None:
            try:
                if self.capture is not None:
                    capture = bytes(self.capture)
                    self._drop_capture()
                    meter.on_json_body(capture)
                meter.on_end(self.metering.accounting.clock())
            except Exception as exc:
                self.meter = None
                self.metering.accounting_failed("end", exc)
        self._end(End.COMPLETE)

    def on_broken(self, reason: str) -> None:
        """The upstream connection failed before the response was complete."""
        self._upstream_failed(502, reason)

    def _upstream_failed(self, status: int, reason: str) -> None:
        if self.finished:
            return
        if self.phase is Phase.HEAD_READ:  # nothing reached the client yet: it can get a 502
            self.out, self.down_chunked = b"", False
        elif self.phase is Phase.STREAMING:
            self.metering.log_repeatable(
                logging.WARNING,
                "stream_cut",
                "proxy %s: %s; cutting the client's stream",
                self.metering.replica,
                reason,
            )
            if self.relay is not None:
                self._release_held(self.relay)  # the incomplete rest is not sent: the stream is cut
            self.keep_alive = False
            self.flush()
            if not self.client.closed and self.down is not None:
                self.down.close()  # no last chunk: the client sees a cut
            self._end(End.UPSTREAM_FAILED)
            return
        self._fail_before_head(status, reason)

    def _fail_before_head(self, status: int, reason: str) -> None:
        """Answer the client kvwatch's own error (no byte of a response reached it) and end."""
        self.metering.log_repeatable(
            logging.WARNING,
            f"answer_{status}",
            "proxy %s: %s; answering %d",
            self.metering.replica,
            reason,
            status,
        )
        self.status = status
        if not self.client.closed:
            self._emit(error_response(status, reason, close=True))
        self.keep_alive = False
        self._end(End.UPSTREAM_FAILED)

    # -- from the client connection ---------------------------------------------------------------
    def client_gone(self) -> None:
        """The client disconnected: close upstream now so the engine aborts and frees its KV.

        A client that leaves once the final chunk (the one with a finish reason) was relayed aborted
        nothing: the engine is done. The official ``openai`` client closes its connection as soon as
        it reads ``[DONE]``, which often beats the engine's last-chunk marker to kvwatch; that
        request ends by its finish reason, not as ``aborted``.
        """
        if self.finished:
            return
        self.keep_alive = False
        if self.up is not None:
            self.up.abort()
        meter = self.meter
        if meter is not None:
            with contextlib.suppress(Exception):
                meter.on_end(self.metering.accounting.clock())
        self._end(End.COMPLETE if meter is not None and meter.every_choice_finished else End.CLIENT_GONE)

    def pause_upstream(self, paused: bool) -> None:
        if self.up is not None:
            self.up.pause_reading(paused)
