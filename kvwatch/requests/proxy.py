"""Streaming reverse proxy in front of one OpenAI-compatible engine (vLLM, SGLang, TRT-LLM, ...).

One listener per replica. Every request is relayed; ``POST /v1/chat/completions`` and
``POST /v1/completions`` are also measured (accounting.py) and end as one ``RequestRecord`` handed
to ``sink``. Everything else (``/v1/models``, ``/health``, ``/metrics``, ...) passes through
untouched: status, headers (minus hop-by-hop) and body bytes as the engine sent them.

Built on raw asyncio protocols, not aiohttp: measured in ``bench/proxy_bench.py`` (docs/performance.md
"Streaming proxy"), an aiohttp server+client relay cost 2.3x nginx's CPU per chunk with uvloop and
added 15-25 ms TTFT under a burst; a protocol relay costs about what nginx does. It also sees the
first byte of a request (TTFT starts there, not when a framework's handler runs) and owns the
slow-client timer. Runs on whatever loop the agent runs; uvloop makes it about 20% cheaper.

Per upstream read the hot path is: de-chunk, find the last event boundary, one ``in`` test for
``"usage"``, write to the client, one regex search per event (``sse.CONTENT``), a bisect for the
gap. No JSON is parsed per chunk; the usage chunk is parsed once.

Per request the work is callback-driven: the request is written to a pooled keep-alive upstream
connection inside the callback that read its last byte (no task, no connect, no extra loop turn),
so a request arriving among many busy streams reaches the engine at once. Only when no idle
connection is pooled does a task connect one. Idle connections are dropped after
``UPSTREAM_IDLE_S`` (engines close theirs after 5 s: uvicorn's default), and a request whose reused
connection turns out closed before answering anything is sent again on a fresh one.

Failure semantics: the proxy never makes a request worse. Accounting errors are counted
(``kvwatch_proxy_accounting_errors_total``) and the bytes keep flowing; a client that disconnects
closes the upstream connection at once (the engine aborts the request and frees its KV); an
upstream that refuses, times out or breaks shows the client the same kind of failure (502/504
before the response head, a cut stream after it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from time import perf_counter
from urllib.parse import urlsplit

from kvwatch.config import ProxyConfig, ReplicaConfig
from kvwatch.model import InFlightRequest, LengthBands, Outcome, RequestRecord
from kvwatch.requests import sse
from kvwatch.requests.accounting import (
    End,
    InFlight,
    ModelLabels,
    RequestMeter,
    body_requesting_usage,
    estimate_prompt_tokens,
    inspect_request,
)
from kvwatch.requests.http1 import (
    HEAD_END,
    LAST_CHUNK,
    MAX_HEAD_BYTES,
    ChunkedDecoder,
    Headers,
    HttpError,
    RequestHead,
    ResponseHead,
    end_to_end,
    frame_chunk,
    parse_request_head,
    parse_response_head,
    render_head,
)

log = logging.getLogger(__name__)

METERED_PATHS = {b"/v1/chat/completions": "chat", b"/v1/completions": "completions"}
MAX_EVENT_BYTES = 1 << 20  # an SSE event larger than this is relayed as plain bytes
MAX_CAPTURE_BYTES = 8 << 20  # non-streaming response bodies read for usage
PIPELINE_BYTES = 64 << 10  # client bytes buffered while a response is still streaming
MAX_ARRIVALS = 64  # read times kept for buffered bytes; later reads share the last one (earlier: never late)
LINGER_S = 2.0  # after refusing a request, how long its remaining bytes are read and dropped
UPSTREAM_IDLE_S = 4.0  # an idle pooled upstream connection older than this is not reused
DRAIN_S = 5.0  # how long an engine may take to end a stream after [DONE] before its connection is closed
MAX_SPARES = 8  # engine connections being opened ahead of need at once (see ProxyServer.warm_spare)
DONE_EVENT = b"data: [DONE]"  # the last event of an OpenAI stream
MAX_IDLE_UPSTREAM = 64  # idle upstream connections kept per replica
ACCOUNTING_ERRORS = "kvwatch_proxy_accounting_errors"
TIMED_OUT = "kvwatch_proxy_connections_timed_out"
USAGE_REFUSED = "kvwatch_proxy_usage_injection_refused"
SHED = "kvwatch_proxy_requests_shed"  # reason: buffer (proxy.max_buffered_bytes) | connections
ACCEPT_ERRORS = "kvwatch_proxy_accept_errors"
MAX_HELD_EVENTS = 64  # events held after the final chunk while waiting for the usage chunk
MAX_HELD_BYTES = 1 << 20

Sink = Callable[[RequestRecord], None]
Count = Callable[..., None]  # NodeState.count(family, *label_values)
MeterFactory = Callable[..., RequestMeter]


@dataclass(frozen=True, slots=True)
class UpstreamAddress:
    """Where requests go: the engine's OpenAI base URL (``api_url``) split for sockets.

    A path in ``api_url`` is a prefix put before the client's path, minus a trailing ``/v1``
    (``http://engine:8000/v1`` and ``http://engine:8000`` mean the same engine).
    """

    host: str
    port: int
    tls: bool
    host_header: bytes
    base_path: bytes

    @classmethod
    def from_url(cls, url: str) -> UpstreamAddress:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"api_url must be an http(s) URL, got {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        path = parts.path.rstrip("/")
        path = path.removesuffix("/v1")
        return cls(parts.hostname, port, tls, parts.netloc.encode("idna"), path.encode())


class ProxyServer:
    """One replica's listener; ``await stop()`` closes it and every connection."""

    def __init__(self, replica: ReplicaConfig, config: ProxyConfig, labels: ModelLabels,
                 bands: LengthBands, in_flight: InFlight, sink: Sink, count: Count,
                 meter_factory: MeterFactory = RequestMeter,
                 clock: Callable[[], float] = perf_counter,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if replica.api_url is None:
            raise ValueError(f"replicas[{replica.name}].api_url: the proxy needs the engine's base URL")
        self.replica = replica.name
        self.config = config
        self.upstream = UpstreamAddress.from_url(replica.api_url)
        self.ssl_context = ssl.create_default_context() if self.upstream.tls else None
        self.labels = labels
        self.bands = bands
        self.in_flight = in_flight
        self.sink = sink
        self.count = count
        self.meter_factory = meter_factory
        self.clock = clock  # durations are measured on it (the demo passes the simulator's clock)
        self.wall_clock = wall_clock  # started_at: the agent's time base, which its scrapes share
        self.inject_usage = config.inject_usage  # proxy.inject_usage; never switched off by a request
        self.engine_forces_usage = False  # seen: a usage chunk in a stream nobody asked usage of
        self.pool = _UpstreamPool(MAX_IDLE_UPSTREAM, UPSTREAM_IDLE_S)
        self.connections: set[_ClientConnection] = set()
        self.buffered = 0  # request bytes held by all connections and exchanges (proxy.max_buffered_bytes)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._learner: asyncio.Task | None = None
        self._last_logged: dict[str, float] = {}  # what _now_and_then last let through, when
        self._spares = 0
        self.tails = 0  # engine connections reading a stream's tail after [DONE] on their own
        self._stopping = False

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self, host: str, port: int, learn_models: bool = True) -> None:
        loop = asyncio.get_running_loop()
        _log_accept_failures(loop, self)
        _warn_if_descriptors_short(self)
        self._server = await loop.create_server(lambda: _ClientConnection(self), host, port,
                                                backlog=1024, reuse_address=True)
        if learn_models:
            self._learner = self.spawn(self._learn_models())
        log.info("proxy for replica %s listening on %s:%d -> %s:%d", self.replica, host, self.port,
                 self.upstream.host, self.upstream.port)

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self._stopping = True
        if self._server is not None:
            self._server.close()
        self.pool.close()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._learner is not None:
            self._learner.cancel()
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self._server is not None:
            await self._server.wait_closed()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def connect_upstream(self) -> tuple[asyncio.BaseTransport, _UpstreamConnection]:
        up = self.upstream
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.config.upstream_connect_timeout_s):
            return await loop.create_connection(  # type: ignore[return-value]
                lambda: _UpstreamConnection(self), up.host, up.port, ssl=self.ssl_context,
                server_hostname=up.host if up.tls else None)

    def warm_spare(self) -> None:
        """A stream's late tail holds its engine connection while the client, which already has its
        response, may send its next request at once: open an idle one for it now, so that request
        does not wait for a connect (measured: bench/proxy_bench.py --scenario late-tail)."""
        if self.pool.idle or self._spares >= MAX_SPARES or self._stopping:
            return
        self._spares += 1
        self.spawn(self._open_spare())

    async def _open_spare(self) -> None:
        try:
            transport, protocol = await self.connect_upstream()
        except (OSError, TimeoutError):
            return  # a request that needs one will connect (and report the failure) itself
        finally:
            self._spares -= 1
        if self._stopping:
            transport.close()
        else:
            self.pool.give(protocol)

    def _counted(self, family: str, *labels: str) -> bool:
        """Count one occurrence; True at most once a minute per family, when it should be logged."""
        with contextlib.suppress(Exception):
            self.count(family, self.replica, *labels)
        now = time.monotonic()
        if now - self._last_logged.get(family, -60.0) <= 60:
            return False
        self._last_logged[family] = now
        return True

    def shed(self, reason: str) -> None:
        if self._counted(SHED, reason):
            log.warning("proxy %s: answering 503 (%s limit reached: proxy.%s; counted in %s_total, logged "
                        "at most once a minute)", self.replica, reason,
                        "max_buffered_bytes" if reason == "buffer" else "max_connections", SHED)

    # -- accounting hooks (never raise into the relay) --------------------------------------------
    def accounting_failed(self, where: str) -> None:
        if self._counted(ACCOUNTING_ERRORS):
            log.exception("proxy %s: request accounting failed in %s; the stream kept flowing "
                          "(counted in %s_total, logged at most once a minute)", self.replica, where,
                          ACCOUNTING_ERRORS)

    def emit(self, record: RequestRecord) -> None:
        try:
            self.sink(record)
            if record.chunks and record.output_tokens and not record.output_tokens_estimated:
                # exact usage of a finished stream teaches the in-flight estimate how many tokens
                # a chunk carries on this replica (stream intervals, speculative decoding)
                self.in_flight.calibrate(self.replica, record.output_tokens, record.chunks)
        except Exception:
            self.accounting_failed("sink")

    def record_refusal(self, head: RequestHead, status: int, t0: float, wall: float) -> None:
        """A metered request kvwatch answered itself (413): counted as rejected, never relayed."""
        endpoint = METERED_PATHS.get(head.path) if head.method == b"POST" else None
        if endpoint is None:
            return
        try:
            self.emit(RequestRecord(
                replica=self.replica, model_name=self.labels.label(None), source="proxy",
                outcome=Outcome.REJECTED, started_at=wall, endpoint=endpoint, status_code=status,
                e2e_seconds=self.clock() - t0))
        except Exception:
            self.accounting_failed("refusal")

    def usage_injection_refused(self) -> None:
        """The engine refused a body with include_usage and took the client's own: counted, logged.

        Nothing is decided for the replica from it: one client's body must not switch usage counting
        off for everyone (an operator whose engine refuses the field sets proxy.inject_usage: false).
        """
        if self._counted(USAGE_REFUSED):
            log.warning("proxy %s: the engine refused a body with stream_options.include_usage and took "
                        "the client's own; that stream is counted from chunks (counted in %s_total; set "
                        "proxy.inject_usage: false if the engine never takes it)",
                        self.replica, USAGE_REFUSED)

    def engine_sends_usage_unasked(self) -> None:
        """Engine output, which no client can forge (its text is JSON-escaped inside one event)."""
        if not self.engine_forces_usage:
            self.engine_forces_usage = True
            log.info("proxy %s: the engine sends a usage chunk unasked (--enable-force-include-usage); "
                     "kvwatch no longer asks for it, and relays it as the engine sent it", self.replica)

    async def _learn_models(self) -> None:
        """Add the engine's served model names (``/v1/models``) to the label set, once."""
        import aiohttp

        url = f"{'https' if self.upstream.tls else 'http'}://{self.upstream.host_header.decode()}" \
              f"{self.upstream.base_path.decode()}/v1/models"
        delay = 2.0
        while True:
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session, \
                        session.get(url) as response:
                    if response.status == 200:
                        doc = json.loads(await response.content.read(1 << 20))
                        self.labels.learn(m.get("id") for m in doc.get("data", []) if isinstance(m, dict))
                        return
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
                pass
            await asyncio.sleep(delay)
            delay = min(delay * 2, 60.0)


async def start_proxy(replica: ReplicaConfig, proxy: ProxyConfig, known_models: Iterable[str],
                      bands: LengthBands, in_flight: InFlight, sink: Sink, count: Count, *,
                      meter_factory: MeterFactory = RequestMeter,
                      learn_models: bool = True,
                      clock: Callable[[], float] = perf_counter,
                      wall_clock: Callable[[], float] = time.time) -> ProxyServer:
    """Start the replica's listener on ``replica.proxy_listen``; the agent's wiring entry point.

    ``known_models``: label values a client's ``model`` may keep (``Config.known_models``); the
    replica's ``model_name`` and, with ``learn_models``, the engine's ``/v1/models`` ids join them.
    ``sink`` gets every finished metered request; ``count`` is ``NodeState.count``. ``clock``
    measures durations; ``wall_clock`` dates requests (``started_at``, ``max_gap_ended_at``): the agent
    passes its own clock so requests and engine scrapes share one time base.
    """
    if replica.proxy_listen is None:
        raise ValueError(f"replica {replica.name}: proxy_listen is not set")
    server = ProxyServer(replica, proxy, ModelLabels(known_models, replica.model_name), bands,
                         in_flight, sink, count, meter_factory, clock, wall_clock)
    # zero series from the start, so rate() sees the first
    for family in (ACCOUNTING_ERRORS, TIMED_OUT, USAGE_REFUSED, ACCEPT_ERRORS):
        count(family, replica.name, amount=0)
    for reason in ("buffer", "connections"):
        count(SHED, replica.name, reason, amount=0)
    await server.start(replica.proxy_listen.host, replica.proxy_listen.port, learn_models)
    return server


# ------------------------------------------------------------------------------------------------
# client side
# ------------------------------------------------------------------------------------------------


def _log_accept_failures(loop: asyncio.AbstractEventLoop, proxy: ProxyServer) -> None:
    """Make a failing ``accept()`` (out of file descriptors: EMFILE) loud: logged and counted.

    asyncio reports it to the loop's exception handler and retries a second later; clients meanwhile
    wait in the backlog or are dropped. The handler is chained, so whatever handled it before still does.
    """
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if "accept" in str(context.get("message", "")) and isinstance(exc, OSError):
            with contextlib.suppress(Exception):
                proxy.count(ACCEPT_ERRORS, proxy.replica)
            log.error("proxy %s: cannot accept a connection (%s); new clients wait or are dropped. Raise "
                      "the open-files limit (LimitNOFILE, ulimit -n) or lower proxy.max_connections",
                      proxy.replica, exc.strerror or exc)
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _warn_if_descriptors_short(proxy: ProxyServer) -> None:
    """Say at start when the open-files limit cannot hold ``proxy.max_connections``.

    Under uvloop an accept() out of descriptors never reaches Python: libuv accepts and closes the
    waiting connections with a reserved descriptor (its EMFILE trick), so those clients are dropped
    without a trace. The connection cap, kept below the limit, is what sheds them visibly (503).
    """
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * proxy.config.max_connections + MAX_IDLE_UPSTREAM + 64  # client + engine side, pool, agent
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("proxy %s: the open-files limit (%d) is below what proxy.max_connections=%d needs (~%d: "
                    "a client and an engine descriptor each); clients past it are dropped unlogged under "
                    "uvloop. Raise LimitNOFILE / ulimit -n, or lower proxy.max_connections",
                    proxy.replica, soft, proxy.config.max_connections, need)


def _error_response(status: int, message: str, close: bool) -> bytes:
    body = json.dumps({"error": {"message": f"kvwatch proxy: {message}", "type": "proxy_error",
                                 "code": status}}).encode()
    reasons = {400: b"Bad Request", 408: b"Request Timeout", 413: b"Content Too Large",
               431: b"Request Header Fields Too Large", 501: b"Not Implemented",
               502: b"Bad Gateway", 503: b"Service Unavailable", 504: b"Gateway Timeout",
               505: b"HTTP Version Not Supported"}
    headers: Headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if close:
        headers.append((b"connection", b"close"))
    return render_head(b"HTTP/1.1 %d %b" % (status, reasons.get(status, b"Error")), headers) + body


class _ClientConnection(asyncio.Protocol):
    """One client connection: reads requests (head + body, within the slow-client timeout) and
    runs one exchange at a time (keep-alive, pipelined bytes buffered, HTTP order kept).

    A request is "received" when its first byte arrives, also when it waits in the buffer behind a
    response in progress (true pipelining): ``arrivals`` remembers when each buffered read came in,
    so TTFT and e2e include every moment the request spent inside kvwatch.
    """

    def __init__(self, proxy: ProxyServer) -> None:
        self.proxy = proxy
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head: RequestHead | None = None
        self.body = bytearray()
        self.body_length: int | None = None
        self.body_decoder: ChunkedDecoder | None = None
        self.t0 = 0.0
        self.wall = 0.0
        self.exchange: _Exchange | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.served = 0
        self.closed = False
        self.refused = False
        self.reading_paused = False
        self.read_total = 0  # bytes read from the client so far
        self.accounted = 0  # len(buf) + len(body) as counted in proxy.buffered
        self.arrivals: deque[tuple[int, float, float]] = deque()  # (offset of a read, clock, wall)

    # -- asyncio callbacks ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        proxy = self.proxy
        if len(proxy.connections) >= proxy.config.max_connections:
            proxy.shed("connections")
            self.refused = True
            transport.write(_error_response(503, "too many client connections (proxy.max_connections)", True))
            transport.close()
            return
        proxy.connections.add(self)
        self._arm_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        self.proxy.connections.discard(self)
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
            self.arrivals.append((self.read_total, self.proxy.clock(), self.proxy.wall_clock()))
        self.read_total += len(data)
        self.buf += data
        if self.exchange is not None:  # pipelined: the response in progress goes first (HTTP order)
            if len(self.buf) > PIPELINE_BYTES and not self.reading_paused:
                self.reading_paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]
            self._account()
            return
        if starts and self.served:  # an idle keep-alive connection: the request gets the whole timeout
            self._arm_timer()
        self._parse()
        self._account()

    def _account(self) -> None:
        """Keep ``proxy.buffered`` current with this connection's buffers; over budget: 503."""
        held = len(self.buf) + len(self.body)
        delta = held - self.accounted
        if not delta:
            return
        self.accounted = held
        proxy = self.proxy
        proxy.buffered += delta
        if delta > 0 and proxy.buffered > proxy.config.max_buffered_bytes and not self.refused:
            proxy.shed("buffer")
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
        config = self.proxy.config
        if self.head is None:
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
            del self.buf[:end + 4]
            self.head = head
            if length is not None and length > config.max_body_bytes:
                self._refuse(413, f"request body of {length} bytes is over the proxy's limit of "
                                  f"{config.max_body_bytes} (proxy.max_body_bytes)", head)
                return
            self.body_length = length or 0
            self.body_decoder = ChunkedDecoder() if chunked else None
            if (head.get(b"expect") or b"").lower() == b"100-continue" and (chunked or length):
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]
        if self.body_decoder is not None:
            try:
                self.body += self.body_decoder.feed(bytes(self.buf))
            except HttpError:
                self._refuse(400, "malformed chunked request body")
                return
            self.buf.clear()
            if len(self.body) > config.max_body_bytes:
                self._refuse(413, f"request body over the proxy's limit of {config.max_body_bytes} "
                                  "bytes (proxy.max_body_bytes)", self.head)
                return
            if not self.body_decoder.done:
                return
            self.buf += self.body_decoder.rest
        else:
            need = self.body_length - len(self.body)  # type: ignore[operator]
            if need:
                self.body += self.buf[:need]
                del self.buf[:need]
                if len(self.body) < self.body_length:  # type: ignore[operator]
                    return
        self._cancel_timer()
        head, body = self.head, bytes(self.body)
        self.body = bytearray()
        assert head is not None
        exchange = self.exchange = _Exchange(self, head, body, self.t0, self.wall)
        try:
            exchange.start()
        except Exception:
            log.exception("proxy %s: could not start relaying a request", self.proxy.replica)
            exchange.abandon()

    def exchange_done(self, keep_alive: bool) -> None:
        """The exchange in progress ended; serve the next request on this connection, or close."""
        self.exchange = None
        self.head = None
        self.body_decoder = None
        self.served += 1
        if self.closed:
            return
        if not keep_alive:
            self.transport.close()  # type: ignore[union-attr]
            return
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        if not self.buf:
            self._arm_timer(self.proxy.config.client_keepalive_timeout_s)
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
            self.proxy.record_refusal(head, status, self.t0, self.wall)
        self.buf.clear()
        self.body = bytearray()
        self.refused = True
        if self.transport is not None and not self.closed:
            self.transport.write(_error_response(status, reason, close=True))
            self.transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    # -- slow clients -----------------------------------------------------------------------------
    def _arm_timer(self, seconds: float | None = None) -> None:
        """The slow-loris timer by default; ``exchange_done`` arms the keep-alive idle one instead."""
        self._cancel_timer()
        loop = asyncio.get_running_loop()
        timeout = self.proxy.config.client_header_timeout_s if seconds is None else seconds
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
            with contextlib.suppress(Exception):
                self.proxy.count(TIMED_OUT, self.proxy.replica)
        if partial:
            self.transport.write(_error_response(
                408, "request head and body must arrive within proxy.client_header_timeout", True))
        self.transport.close()


# ------------------------------------------------------------------------------------------------
# one request relayed
# ------------------------------------------------------------------------------------------------


class _Exchange:
    """One request: upstream connection, response relay, accounting. Driven by callbacks."""

    def __init__(self, conn: _ClientConnection, head: RequestHead, body: bytes, t0: float,
                 wall: float) -> None:
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
        self.budgeted = 0  # len(body) + len(request) as counted in proxy.buffered
        self.up: _UpstreamConnection | None = None
        self.finished = False
        self.status: int | None = None
        self.head_sent = False
        self.wrote = False  # some bytes of the response were written to the client
        self.keep_alive = head.keep_alive
        self.down_chunked = False
        self.sse = False
        self.strip = False
        self.retried = False  # the engine refused include_usage once; the client's own body was sent
        self.unasked = False  # a metered stream whose body asks no usage (as the client wrote it)
        self.sep: bytes | None = None
        self.carry = b""
        self.held: list[bytes] | None = None  # final chunk and after, waiting for the usage chunk
        self.held_bytes = 0
        self.hold_final = True  # False once held events outgrew MAX_HELD_*: relayed as they come
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
            transport, protocol = await self.proxy.connect_upstream()
        except TimeoutError:
            self._end(self._fail_before_head(
                504, f"timed out connecting to the engine at {up.host}:{up.port}"))
            return
        except OSError as exc:
            self._end(self._fail_before_head(502, f"cannot connect to the engine at {up.host}:{up.port} "
                                                  f"({exc.strerror or type(exc).__name__})"))
            return
        if self.finished:  # the client left while we connected
            transport.close()
            return
        self._attach(protocol, reused=False)

    def _attach(self, protocol: _UpstreamConnection, reused: bool) -> None:
        self.up = protocol
        protocol.attach(self, reused)
        protocol.transport.write(self.request)  # type: ignore[union-attr]
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
        """The one way out: record the request, release it, hand the client connection on."""
        if self.finished:
            return
        self.finished = True
        self._drop_request()
        self._drop_capture()
        self.flush()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if self.retried and end is End.COMPLETE and self.status is not None and self.status < 400:
            self.proxy.usage_injection_refused()
        self._finish(end)
        self.conn.exchange_done(self.keep_alive and end is End.COMPLETE and not self.gone)

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
            self.handle = proxy.in_flight.start(InFlightRequest(
                proxy.replica, model, proxy.bands.band_for(info.max_tokens),
                estimate_prompt_tokens(len(self.body)), 0, self.wall, info.max_tokens))
            self.meter = proxy.meter_factory(proxy.replica, model, info, self.wall, self.t0,
                                             proxy.in_flight, self.handle)
            self.unasked = info.streaming and not info.wants_usage
            if proxy.inject_usage and not proxy.engine_forces_usage:
                return body_requesting_usage(self.body, info)
        except Exception:
            self.meter = None
            proxy.accounting_failed("request")
        return None

    def _finish(self, end: End) -> None:
        proxy = self.proxy
        if self.meter is not None:
            try:
                if self.meter.e2e is None:
                    self.meter.on_end(self.proxy.clock())
                record = self.meter.record(self.status, end)
            except Exception:
                proxy.accounting_failed("record")
            else:
                proxy.emit(record)
        if self.handle is not None:
            try:
                proxy.in_flight.finish(self.handle)
            except Exception:
                proxy.accounting_failed("in_flight")

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
    def _watch_upstream(self, protocol: _UpstreamConnection, reads: int) -> None:
        loop = asyncio.get_running_loop()
        self.idle_timer = loop.call_later(self.proxy.config.upstream_read_timeout_s,
                                          self._check_upstream, protocol, reads)

    def _check_upstream(self, protocol: _UpstreamConnection, reads: int) -> None:
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
            if not self.conn.closed:
                self.wrote = True
                self.down.write(out)  # type: ignore[union-attr]

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
        self.sse = (metered or self.strip) and head.status == 200 and not encoded and \
            content_type.startswith(b"text/event-stream")
        if metered and not self.sse and head.status == 200 and not encoded and \
                content_type.startswith(b"application/json"):
            self.capture = bytearray()
        headers = end_to_end(head)
        if not has_body:
            if length is not None and self.head.method == b"HEAD":
                headers.append((b"content-length", b"%d" % length))
        elif length is not None and not self.sse:
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
        if self.sse:
            self._relay_events(data)
            return
        self._emit(b"%x\r\n%b\r\n" % (len(data), data) if self.down_chunked else data)
        if self.capture is not None:
            proxy = self.proxy
            if len(self.capture) + len(data) <= MAX_CAPTURE_BYTES and \
                    proxy.buffered + len(data) <= proxy.config.max_buffered_bytes:
                self.capture += data
            else:
                self.capture = None  # usage unread, as for a body over MAX_CAPTURE_BYTES
            self._budget()

    def _relay_events(self, data: bytes) -> None:
        """Forward complete SSE events only (the usage chunk may need removing); hot path."""
        if self.carry:
            data = self.carry + data
            self.carry = b""
        sep = self.sep
        if sep is None:
            sep = self.sep = _separator(data)
            if sep is None:
                self._hold(data)
                return
        cut = data.rfind(sep)
        if cut < 0:
            self._hold(data)
            return
        cut += len(sep)
        if cut < len(data):
            self.carry = data[cut:]
            data = data[:cut]
        if self.strip:
            if self.held is not None or sse.USAGE_MARK in data or sse.FINISH.search(data):
                data = self._without_usage(data, sep)
                if not data:
                    return
        elif sse.USAGE_MARK in data:
            self._read_usage(data, sep)
        self._send_events(data, sep)
        if not self.carry and self.held is None and self.down_chunked and data.endswith(DONE_EVENT + sep):
            self._stream_done()

    def _stream_done(self) -> None:
        """``[DONE]`` is relayed: the client has its whole response now. The engine may write its
        last-chunk marker late (vLLM's frontend, under load, by seconds); that tail is not the
        client's wait, so the response ends here and the upstream connection reads the rest on its
        own (``release_tail``), while a next request on this client connection goes at once."""
        if self.up is not None:
            self.up.release_tail()
        self.on_end()

    def _send_events(self, data: bytes, sep: bytes) -> None:
        self._emit(b"%x\r\n%b\r\n" % (len(data), data) if self.down_chunked else data)
        meter = self.meter
        if meter is not None:
            try:
                meter.on_events(data, sep, self.proxy.clock())
            except Exception:
                self.meter = None
                self.proxy.accounting_failed("stream")

    def _hold(self, data: bytes) -> None:
        """No event boundary yet: keep the bytes, unless an 'event' grows beyond reason."""
        if len(data) > MAX_EVENT_BYTES:
            if self.held:
                self._release_held()  # events held before these bytes leave before them
            self.sse = False  # not an event stream we understand: plain relay from here on
            self.on_body(data)
        else:
            self.carry = data

    def _read_usage(self, data: bytes, sep: bytes) -> None:
        """Usage nobody here removes (the client asked, or the engine sends it anyway): read it, forward
        everything. A usage-only chunk in a stream nobody asked usage of shows the engine always
        sends one (vLLM ``--enable-force-include-usage``): then kvwatch stops asking, and so stops
        removing a chunk a direct client would see."""
        try:
            usage = sse.find_usage(data, sep)
            if self.unasked and any(sse.is_usage_only(e) for e in data.split(sep) if sse.USAGE_MARK in e):
                self.proxy.engine_sends_usage_unasked()
        except Exception:
            self.proxy.accounting_failed("usage")
            return
        self._usage(usage)

    def _usage(self, usage: sse.Usage | None) -> None:
        if usage is not None and self.meter is not None:
            try:
                self.meter.on_usage(usage)
            except Exception:
                self.meter = None
                self.proxy.accounting_failed("usage")

    def _without_usage(self, data: bytes, sep: bytes) -> bytes:
        """Remove the usage chunk kvwatch asked for; returns the events to send now.

        The final chunk (the one with a finish reason) and what follows are held until the usage
        chunk arrives, because vLLM moves fields such as ``system_fingerprint`` from that chunk
        to the usage chunk when usage is requested; they are put back (``sse.MOVED_FIELDS``).
        Only single-choice streams get here, and the hold lasts as long as the engine takes to
        write its next chunk (the usage chunk follows the final chunk in the same step).
        """
        out: list[bytes] = []  # events with their separators, as they leave
        events = data.split(sep)
        rest = events.pop()  # empty, unless separators overlap at the end ("}\n\n\n": "\n" begins the next)
        if rest:
            self.carry = rest + self.carry
        for event in events:
            if self.strip and sse.USAGE_MARK in event and sse.is_usage_only(event):
                self.strip = False  # the one chunk kvwatch asked for; any later one is the engine's
                usage, moved = self._read_usage_event(event)
                self._usage(usage)
                if self.held:
                    self.held[0] = sse.with_fields(self.held[0], moved)
                    out += [held + sep for held in self.held]
                    self.held = None
                blank = len(event) - len(event.lstrip(b"\r\n"))  # blank lines before it are not the chunk
                if blank:
                    out.append(event[:blank])
                continue
            if self.held is not None:
                self.held.append(event)
                self.held_bytes += len(event)
                too_many = len(self.held) > MAX_HELD_EVENTS or self.held_bytes > MAX_HELD_BYTES
                if event == DONE_EVENT or too_many:
                    # the stream's end without a usage chunk, or too much to hold: send it, in order
                    out += [held + sep for held in self.held]
                    self.held = None
                    self.hold_final = event == DONE_EVENT
                continue
            if sse.USAGE_MARK in event:  # usage riding on a content chunk: read, keep
                self._usage(self._read_usage_event(event)[0])
            if self.hold_final and self.strip and sse.FINISH.search(event):
                self.held, self.held_bytes = [event], len(event)
                continue
            out.append(event + sep)
        return b"".join(out)

    def _read_usage_event(self, event: bytes) -> tuple[sse.Usage | None, list[tuple[bytes, bytes]]]:
        """``sse.read_usage_event``, whose failure (a usage chunk nested 100,000 deep) is counted."""
        try:
            return sse.read_usage_event(event)
        except Exception:
            self.proxy.accounting_failed("usage")
            return None, []

    def _release_held(self) -> None:
        """End of stream without a usage chunk: send what was held, as it was."""
        held, self.held = self.held, None
        if held and self.sep is not None and not self.conn.closed:
            self._send_events(b"".join(event + self.sep for event in held), self.sep)

    def on_end(self) -> None:
        """The response was read in full."""
        if self.held:
            self._release_held()
        if self.carry:
            carry, self.carry = self.carry, b""
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
            except Exception:
                self.meter = None
                self.proxy.accounting_failed("end")
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
            log.warning("proxy %s: %s; cutting the client's stream", self.proxy.replica, reason)
            if self.held:
                self._release_held()
            self.keep_alive = False
            self.flush()
            if not self.conn.closed:
                self.down.close()  # type: ignore[union-attr]  # no last chunk: the client sees a cut
            self._end(End.UPSTREAM_FAILED)
        else:
            self._end(self._fail_before_head(status, reason))

    def _fail_before_head(self, status: int, reason: str) -> End:
        log.warning("proxy %s: %s; answering %d", self.proxy.replica, reason, status)
        self.status = status
        if not self.conn.closed:
            self._emit(_error_response(status, reason, close=True))
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
        if self.up is not None and self.up.transport is not None:
            with contextlib.suppress(RuntimeError):
                if paused:
                    self.up.transport.pause_reading()
                else:
                    self.up.transport.resume_reading()


def _separator(data: bytes) -> bytes | None:
    """The stream's event separator, from its first complete event."""
    lf = data.find(b"\n\n")
    crlf = data.find(b"\r\n\r\n")
    if lf < 0 and crlf < 0:
        return None
    if crlf >= 0 and (lf < 0 or crlf < lf):
        return b"\r\n\r\n"
    return b"\n\n"


# ------------------------------------------------------------------------------------------------
# upstream side
# ------------------------------------------------------------------------------------------------

_HEAD, _CHUNKED, _LENGTH, _UNTIL_CLOSE, _ENDED = range(5)


class _UpstreamPool:
    """Idle keep-alive connections to the engine, most recently used first."""

    def __init__(self, max_idle: int, idle_s: float) -> None:
        self.max_idle = max_idle
        self.idle_s = idle_s
        self.idle: list[_UpstreamConnection] = []

    def take(self) -> _UpstreamConnection | None:
        now = time.monotonic()
        while self.idle:
            protocol = self.idle.pop()
            if not protocol.closed and now - protocol.idle_since < self.idle_s:
                return protocol
            protocol.abort()
        return None

    def give(self, protocol: _UpstreamConnection) -> None:
        if protocol.closed or len(self.idle) >= self.max_idle:
            protocol.abort()
            return
        protocol.idle_since = time.monotonic()
        self.idle.append(protocol)

    def discard(self, protocol: _UpstreamConnection) -> None:
        with contextlib.suppress(ValueError):
            self.idle.remove(protocol)

    def close(self) -> None:
        for protocol in self.idle:
            protocol.abort()
        self.idle.clear()


class _UpstreamConnection(asyncio.Protocol):
    """One connection to the engine; reads one response at a time for the exchange attached."""

    def __init__(self, proxy: ProxyServer) -> None:
        self.proxy = proxy
        self.ex: _Exchange | None = None
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self.mode = _ENDED
        self.buf = b""
        self.decoder = ChunkedDecoder()
        self.remaining = 0
        self.reads = 0
        self.reusable = False  # the response allows this connection to carry another request
        self.tail_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def attach(self, exchange: _Exchange, reused: bool) -> None:
        self.ex = exchange
        self.reused = reused
        self.mode = _HEAD
        self.buf = b""
        self.decoder = ChunkedDecoder()
        self.remaining = 0
        self.reads = 0
        self.reusable = False

    def release_tail(self) -> None:
        """The exchange is done with this response (``[DONE]`` relayed): read what the engine still
        sends of it on our own, then back to the pool; closed if it takes over ``DRAIN_S``."""
        self.ex = None
        if self.mode == _ENDED or self.closed:
            return
        if self.mode == _UNTIL_CLOSE or not self.reusable:
            self.abort()  # nothing to keep this connection for
            return
        if self.transport is not None:
            with contextlib.suppress(RuntimeError):
                self.transport.resume_reading()  # the slow client it was paused for is gone
        loop = asyncio.get_running_loop()
        self.tail_timer = loop.call_later(DRAIN_S, self._tail_too_slow)
        self.proxy.tails += 1
        loop.call_soon(self._spare_if_draining)  # after this read: its last-chunk marker may be in it

    def _spare_if_draining(self) -> None:
        if self.tail_timer is not None:
            self.proxy.warm_spare()

    def _tail_done(self) -> None:
        if self.tail_timer is not None:
            self.tail_timer.cancel()
            self.tail_timer = None
            self.proxy.tails -= 1

    def _tail_too_slow(self) -> None:
        self.abort()

    def abort(self) -> None:
        """Close now and forget the exchange (which is told by whoever called this)."""
        self._tail_done()
        self.ex = None
        self.mode = _ENDED
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        ex = self.ex
        self._received(data)
        if ex is not None:
            ex.flush()

    def _received(self, data: bytes) -> None:
        self.reads += 1
        mode = self.mode
        if mode == _CHUNKED:
            try:
                payload = self.decoder.feed(data)
            except HttpError as exc:
                self._broken(exc.reason)
                return
            if payload and self.ex is not None:  # None: a tail after [DONE], read and dropped
                self.ex.on_body(payload)
            if self.decoder.done:
                self.reusable = self.reusable and not self.decoder.rest
                self._end()
        elif mode == _HEAD:
            self._read_head(data)
        elif mode == _LENGTH:
            if len(data) >= self.remaining:
                self.reusable = self.reusable and len(data) == self.remaining
                data = data[:self.remaining]
                self.remaining = 0
                if self.ex is not None:
                    self.ex.on_body(data)
                self._end()
            else:
                self.remaining -= len(data)
                if self.ex is not None:
                    self.ex.on_body(data)
        elif mode == _UNTIL_CLOSE:
            if self.ex is not None:
                self.ex.on_body(data)
        else:  # bytes on an idle connection: nothing asked for them
            self.proxy.pool.discard(self)
            self.abort()

    def _read_head(self, data: bytes) -> None:
        ex = self.ex
        assert ex is not None
        buf = self.buf + data
        while True:
            end = buf.find(HEAD_END, 0, MAX_HEAD_BYTES + len(HEAD_END))
            if end < 0:
                if len(buf) >= MAX_HEAD_BYTES + len(HEAD_END):
                    self._broken("the engine's response head is larger than 64 KiB")
                else:
                    self.buf = buf
                return
            try:
                head = parse_response_head(buf[:end])
            except HttpError as exc:
                self._broken(exc.reason)
                return
            buf = buf[end + 4:]
            if not 100 <= head.status < 200:
                break  # interim responses (100, 103) are read and dropped
        self.buf = b""
        try:
            chunked = head.chunked()
            length = None if chunked else head.content_length()
        except HttpError as exc:
            self._broken(f"the engine sent bad framing ({exc.reason})")
            return
        has_body = ex.head.method != b"HEAD" and head.status not in (204, 304)
        self.reusable = head.version == b"HTTP/1.1" and not head.closes and (
            chunked or length is not None or not has_body)
        if not ex.on_head(head, length, has_body):
            self.abort()
            ex.retry_without_usage()
            return
        if not has_body or length == 0:
            self.reusable = self.reusable and not buf
            self._end()
            return
        if chunked:
            self.mode = _CHUNKED
        elif length is not None:
            self.mode, self.remaining = _LENGTH, length
        else:
            self.mode = _UNTIL_CLOSE
        if buf:
            self._received(buf)

    def _end(self) -> None:
        """The response is complete: back to the pool (or closed) first, then the exchange is told,
        so a pipelined next request can already use this connection."""
        ex, self.ex, self.mode = self.ex, None, _ENDED
        self._tail_done()
        if self.reusable and not self.closed:
            self.proxy.pool.give(self)
        else:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        if ex is not None:
            ex.on_end()

    def _broken(self, reason: str) -> None:
        ex = self.ex
        self.abort()
        if ex is not None:
            ex.on_broken(reason)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._tail_done()
        ex = self.ex
        if ex is None:
            self.proxy.pool.discard(self)
            return
        if self.mode == _UNTIL_CLOSE:
            self._end()
            return
        self.ex, self.mode = None, _ENDED
        if self.reused and self.reads == 0:  # a pooled connection the engine had closed
            ex.retry_fresh()
            return
        what = "before responding" if ex.status is None else "mid-response"
        ex.on_broken(f"the engine closed the connection {what}" + (f" ({exc})" if exc else ""))
