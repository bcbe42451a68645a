"""One request relayed: the engine connection it goes out on, the response back, its accounting.

Driven by callbacks: the client connection starts it once the request is read; the engine connection
calls ``on_head``, ``on_body`` per read and ``on_end``. An event stream passes through the usage
relay (``relay.py``); everything else is relayed as it comes. Output to the client is written once
per engine read (``flush``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from kvwatch.model import InFlightRequest
from kvwatch.requests import sse
from kvwatch.requests.accounting import (
    End,
    RequestMeter,
    body_requesting_usage,
    estimate_prompt_tokens,
    inspect_request,
)
from kvwatch.requests.http1 import LAST_CHUNK, RequestHead, ResponseHead, end_to_end, frame_chunk, render_head
from kvwatch.requests.proxy.answers import error_response
from kvwatch.requests.proxy.relay import UsageRelay

if TYPE_CHECKING:
    from kvwatch.requests.proxy.client import ClientConnection
    from kvwatch.requests.proxy.pool import EngineConnection

log = logging.getLogger("kvwatch.requests.proxy")

METERED_PATHS = {b"/v1/chat/completions": "chat", b"/v1/completions": "completions"}
MAX_CAPTURE_BYTES = 8 << 20  # non-streaming response bodies read for usage


class Exchange:
    """One request: upstream connection, response relay, accounting. Driven by callbacks."""

    def __init__(
        self, conn: ClientConnection, head: RequestHead, body: bytes, t0: float, wall: float
    ) -> None:
        self.conn = conn
        self.proxy = conn.proxy
        self.down = conn.transport
        self.head = head
        self.body = body
        self.t0 = t0
        self.wall = wall
        self.meter: RequestMeter | None = None
        self.handle: int | None = None
        self.streaming = False
        self.request = b""  # what is sent upstream; both dropped once the response head came
        self.budgeted = 0  # len(body) + len(request) + len(capture) as counted in proxy.buffered
        self.relay_budgeted = 0  # bytes the usage relay holds back, as counted in proxy.buffered
        self.up: EngineConnection | None = None
        self.finished = False
        self.status: int | None = None
        self.head_sent = False
        self.wrote = False  # some bytes of the response were written to the client
        self.keep_alive = head.keep_alive
        self.down_chunked = False
        self.relay: UsageRelay | None = None  # an event stream this exchange reads
        self.strip = False  # kvwatch asked for usage: its usage chunk is removed
        self.retried = False  # the engine refused include_usage once; the client's own body was sent
        self.unasked = False  # a metered stream whose body asks no usage (as the client wrote it)
        self.continuous = False  # the body asks usage on every chunk (stream_options.continuous_usage_stats)
        self.capture: bytearray | None = None
        self.gone = False
        self.idle_timer: asyncio.TimerHandle | None = None
        self.out = b""  # bytes for the client, written once per upstream read (see flush)

    # -- the request ------------------------------------------------------------------------------
    def start(self) -> None:
        endpoint = METERED_PATHS.get(self.head.path) if self.head.method == b"POST" else None
        injected = self._start_metering(endpoint) if endpoint else None
        self.strip = injected is not None
        self.request = self._upstream_request(injected if injected is not None else self.body)
        self._budget()
        self._send()

    def _budget(self) -> None:
        """Count the bytes this exchange holds (the request body, what goes upstream, a JSON response
        read for its usage) in proxy.buffered."""
        held = len(self.body) + len(self.request) + (len(self.capture) if self.capture is not None else 0)
        self.proxy.buffered += held - self.budgeted
        self.budgeted = held

    def _budget_relay(self, relay: UsageRelay, held: int) -> None:
        """Count what the usage relay holds back in proxy.buffered; over the budget it holds nothing
        more: what it kept goes to the client now, and the rest of the stream passes as it comes."""
        proxy = self.proxy
        proxy.buffered += held - self.relay_budgeted
        grew = held > self.relay_budgeted
        self.relay_budgeted = held
        if grew and proxy.buffered > proxy.config.max_buffered_bytes:
            out = relay.overflow()
            events, sep = relay.events, relay.sep
            if out:
                self._emit(frame_chunk(out) if self.down_chunked else out)
            if events and sep is not None:
                self._meter_events(events, sep)
            proxy.buffered -= self.relay_budgeted
            self.relay_budgeted = 0

    def _drop_request(self) -> None:
        """The response head came: no retry can need the request now, so its bytes go."""
        self.body = self.request = b""
        self._budget()

    def _drop_capture(self) -> None:
        self.capture = None
        self._budget()

    def _send(self) -> None:
        """On a pooled connection right now, else on a new one from a task."""
        proxy = self.proxy
        protocol = proxy.pool.take()
        if protocol is not None:
            self._attach(protocol, reused=True)
        else:
            proxy.spawn(self._connect())
        if proxy.tails and not proxy.pool.idle:  # tails hold connections: the next request gets a spare
            proxy.warm_spare()

    async def _connect(self) -> None:
        up = self.proxy.upstream
        try:
            protocol = await self.proxy.connect_upstream()
        except TimeoutError:
            self._end(
                self._fail_before_head(504, f"timed out connecting to the engine at {up.host}:{up.port}")
            )
            return
        except OSError as exc:
            self._end(
                self._fail_before_head(
                    502,
                    f"cannot connect to the engine at {up.host}:{up.port} "
                    f"({exc.strerror or type(exc).__name__})",
                )
            )
            return
        if self.finished:  # the client left while we connected
            protocol.abort()
            return
        self._attach(protocol, reused=False)

    def _attach(self, protocol: EngineConnection, reused: bool) -> None:
        self.up = protocol
        protocol.attach(self, reused)
        protocol.write(self.request)
        self._watch_upstream(protocol, protocol.reads)

    def retry_without_usage(self) -> None:
        """The engine refused the body with include_usage (400/422): send the client's own body.

        Counted if that succeeds; it changes nothing for the next request (``usage_injection_refused``).
        """
        self.retried, self.strip, self.status = True, False, None
        self.request = self._upstream_request(self.body)
        self._budget()
        self._send()

    def retry_fresh(self) -> None:
        """A pooled connection closed before answering anything: the request again, on a new one."""
        self.status = None
        self.proxy.spawn(self._connect())

    def _end(self, end: End) -> None:
        """The one way out: release the request, hand the client connection on, then record it."""
        if self.finished:
            return
        self.finished = True
        self._drop_request()
        self._drop_capture()
        if self.relay_budgeted:
            self.proxy.buffered -= self.relay_budgeted
            self.relay_budgeted = 0
        self.flush()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if self.retried and end is End.COMPLETE and self.status is not None and self.status < 400:
            self.proxy.usage_injection_refused()
        meter = self.meter
        if meter is not None and meter.e2e is None:
            try:
                meter.on_end(self.proxy.clock())  # e2e ends now, not when the record is built
            except Exception as exc:
                self.meter = None
                self.proxy.accounting_failed("end", exc)
        # the connection goes on first: its next request (pipelined, or arriving as the client reads
        # this response's end) is not held behind this one's record, sink, ledger line and in-flight
        # entry, which run on the next loop turn, once each
        self.conn.exchange_done(self.keep_alive and end is End.COMPLETE and not self.gone)
        asyncio.get_running_loop().call_soon(self._finish, end)

    def abandon(self) -> None:
        """A bug in kvwatch: drop what is in flight and close the client connection."""
        self.keep_alive = False
        if self.up is not None:
            self.up.abort()
        self._end(End.UPSTREAM_FAILED)

    def _start_metering(self, endpoint: str) -> bytes | None:
        proxy = self.proxy
        try:
            info = inspect_request(self.body, endpoint)
            self.streaming = info.streaming
            model = proxy.labels.label(info.model)
            self.handle = proxy.in_flight.start(
                InFlightRequest(
                    proxy.replica,
                    model,
                    proxy.bands.band_for(info.max_tokens),
                    estimate_prompt_tokens(len(self.body)),
                    0,
                    self.wall,
                    info.max_tokens,
                )
            )
            self.meter = proxy.meter_factory(
                proxy.replica, model, info, self.wall, self.t0, proxy.in_flight, self.handle
            )
            self.unasked = info.streaming and not info.wants_usage
            self.continuous = info.continuous_usage
            if proxy.inject_usage and not proxy.engine_forces_usage:
                return body_requesting_usage(self.body, info)
        except Exception as exc:
            self.meter = None
            proxy.accounting_failed("request", exc)
        return None

    def _finish(self, end: End) -> None:
        """The request's bookkeeping: its record to the sink, its in-flight entry closed."""
        proxy = self.proxy
        if self.meter is not None:
            try:
                record = self.meter.record(self.status, end)
            except Exception as exc:
                proxy.accounting_failed("record", exc)
            else:
                proxy.emit(record)
        if self.handle is not None:
            try:
                proxy.in_flight.finish(self.handle)
            except Exception as exc:
                proxy.accounting_failed("in_flight", exc)

    def _upstream_request(self, body: bytes) -> bytes:
        up = self.proxy.upstream
        drop = {b"host", b"expect"}
        if self.streaming:
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
            self.proxy.config.upstream_read_timeout_s, self._check_upstream, protocol, reads
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
            if not self.conn.closed and self.down is not None:
                self.wrote = True
                self.down.write(out)

    # -- callbacks from the upstream connection ---------------------------------------------------
    def on_head(self, head: ResponseHead, length: int | None, has_body: bool) -> bool:
        """The response head arrived; returns False to discard this response (retry)."""
        self.status = head.status
        if self.strip and head.status in (400, 422):
            return False  # the upstream connection drops this answer and calls retry_without_usage
        if self.gone:
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
            self.relay = UsageRelay(self.strip, self.unasked, self.continuous)
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
        self.head_sent = True
        self._drop_request()
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
                    meter.on_events(events, sep, self.proxy.clock())
                except Exception as exc:
                    self.meter = None
                    self.proxy.accounting_failed("stream", exc)
            if relay.noted:
                self._take_notes(relay)
            held = len(relay.carry) + relay.held_bytes
            if held != self.relay_budgeted:
                self._budget_relay(relay, held)
            if relay.done and self.down_chunked:
                self._stream_done()
            return
        self._emit(b"%x\r\n%b\r\n" % (len(data), data) if self.down_chunked else data)
        if self.capture is not None:
            proxy = self.proxy
            if (
                len(self.capture) + len(data) <= MAX_CAPTURE_BYTES
                and proxy.buffered + len(data) <= proxy.config.max_buffered_bytes
            ):
                self.capture += data
            else:
                self.capture = None  # usage unread, as for a body over MAX_CAPTURE_BYTES
            self._budget()

    def _meter_events(self, events: bytes, sep: bytes) -> None:
        meter = self.meter
        if meter is not None:
            try:
                meter.on_events(events, sep, self.proxy.clock())
            except Exception as exc:
                self.meter = None
                self.proxy.accounting_failed("stream", exc)

    def _send_events(self, events: bytes, sep: bytes) -> None:
        self._emit(frame_chunk(events) if self.down_chunked else events)
        self._meter_events(events, sep)

    def _take_notes(self, relay: UsageRelay) -> None:
        """What the usage relay saw: usage for the meter, errors to count, an engine that forces usage."""
        relay.noted = False
        errors, relay.errors = relay.errors, []
        for exc in errors:
            self.proxy.accounting_failed("usage", exc)
        if relay.forced_usage:
            self.proxy.engine_sends_usage_unasked()
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
                self.proxy.accounting_failed("usage", exc)

    def _release_held(self, relay: UsageRelay) -> bytes:
        """End of stream: send what the relay held, as it was; returns the incomplete rest."""
        held, carry = relay.finish()
        if held and relay.sep is not None and not self.conn.closed:
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
                meter.on_end(self.proxy.clock())
            except Exception as exc:
                self.meter = None
                self.proxy.accounting_failed("end", exc)
        self._end(End.COMPLETE)

    def on_broken(self, reason: str) -> None:
        """The upstream connection failed before the response was complete."""
        self._upstream_failed(502, reason)

    def _upstream_failed(self, status: int, reason: str) -> None:
        if self.finished:
            return
        if self.head_sent and not self.wrote:  # nothing reached the client yet: it can get a 502
            self.out, self.head_sent, self.down_chunked = b"", False, False
        if self.head_sent:
            self.proxy.log_repeatable(
                logging.WARNING,
                "stream_cut",
                "proxy %s: %s; cutting the client's stream",
                self.proxy.replica,
                reason,
            )
            if self.relay is not None:
                self._release_held(self.relay)  # the incomplete rest is not sent: the stream is cut
            self.keep_alive = False
            self.flush()
            if not self.conn.closed and self.down is not None:
                self.down.close()  # no last chunk: the client sees a cut
            self._end(End.UPSTREAM_FAILED)
        else:
            self._end(self._fail_before_head(status, reason))

    def _fail_before_head(self, status: int, reason: str) -> End:
        self.proxy.log_repeatable(
            logging.WARNING,
            f"answer_{status}",
            "proxy %s: %s; answering %d",
            self.proxy.replica,
            reason,
            status,
        )
        self.status = status
        if not self.conn.closed:
            self._emit(error_response(status, reason, close=True))
        self.keep_alive = False
        return End.UPSTREAM_FAILED

    # -- from the client connection ---------------------------------------------------------------
    def client_gone(self) -> None:
        """The client disconnected: close upstream now so the engine aborts and frees its KV.

        A client that leaves once the final chunk (the one with a finish reason) was relayed aborted
        nothing: the engine is done. The official ``openai`` client closes its connection as soon as
        it reads ``[DONE]``, which often beats the engine's last-chunk marker to kvwatch; that
        request ends by its finish reason, not as ``aborted``.
        """
        if self.gone or self.finished:
            return
        self.gone = True
        if self.up is not None:
            self.up.abort()
        if not self.finished:
            meter = self.meter
            if meter is not None:
                with contextlib.suppress(Exception):
                    meter.on_end(self.proxy.clock())
            self._end(End.COMPLETE if meter is not None and meter.finish_reason else End.CLIENT_GONE)

    def pause_upstream(self, paused: bool) -> None:
        if self.up is not None:
            self.up.pause_reading(paused)
