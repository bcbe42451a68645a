"""The engine side: where it is, the pool of idle keep-alive connections, connecting (and spares
opened ahead of need), and one connection reading one response at a time for the response reader
attached to it (an exchange, seen here only through ``ResponseReader``).

Idle connections are dropped after ``UPSTREAM_IDLE_S`` (engines close theirs after 5 s: uvicorn's
default). A response whose client already has everything (``[DONE]`` relayed) is read to its end
here, on the connection's own (``release_tail``), then the connection goes back to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

from kvwatch.requests.http1 import (
    HEAD_END,
    MAX_HEAD_BYTES,
    ChunkedDecoder,
    HttpError,
    ResponseHead,
    parse_response_head,
)

UPSTREAM_IDLE_S = 4.0  # an idle pooled upstream connection older than this is not reused
DRAIN_S = 5.0  # how long an engine may take to end a stream after [DONE] before its connection is closed
MAX_IDLE_UPSTREAM = 64  # idle upstream connections kept per replica

MAX_WARM = 32  # idle and opening connections kept for expected requests, at most (Engine.keep_warm)
DEMAND_ALPHA = 0.2  # weight of each arriving request's concurrency in the demand EWMA

_HEAD, _CHUNKED, _LENGTH, _UNTIL_CLOSE, _ENDED = range(5)


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


class ResponseReader(Protocol):
    """What an engine connection tells the exchange whose response it reads (``Exchange``)."""

    @property
    def method(self) -> bytes: ...  # the request's: a HEAD response has no body

    @property
    def status(self) -> int | None: ...

    def on_head(self, head: ResponseHead, length: int | None, has_body: bool) -> bool: ...
    def on_body(self, data: bytes) -> None: ...
    def pass_chunk(self, frame: bytes, start: int) -> bool: ...
    def on_end(self) -> None: ...
    def on_broken(self, reason: str) -> None: ...
    def flush(self) -> None: ...
    def retry_without_usage(self) -> None: ...
    def retry_fresh(self) -> None: ...


class EnginePool:
    """Idle keep-alive connections to the engine, most recently used first."""

    def __init__(self, max_idle: int = MAX_IDLE_UPSTREAM, idle_s: float = UPSTREAM_IDLE_S) -> None:
        self.max_idle = max_idle
        self.idle_s = idle_s
        self.idle: list[EngineConnection] = []

    def take(self) -> EngineConnection | None:
        now = time.monotonic()
        while self.idle:
            protocol = self.idle.pop()
            if not protocol.closed and now - protocol.idle_since < self.idle_s:
                return protocol
            protocol.abort()
        return None

    def give(self, protocol: EngineConnection) -> None:
        if protocol.closed or len(self.idle) >= self.max_idle:
            protocol.abort()
            return
        protocol.idle_since = time.monotonic()
        self.idle.append(protocol)

    def discard(self, protocol: EngineConnection) -> None:
        with contextlib.suppress(ValueError):
            self.idle.remove(protocol)

    def sweep(self) -> None:
        """Close the idle connections older than ``idle_s``: extras a fall in demand left unused."""
        now = time.monotonic()
        stale = [p for p in self.idle if p.closed or now - p.idle_since >= self.idle_s]
        if stale:
            self.idle = [p for p in self.idle if p not in stale]
            for protocol in stale:
                protocol.abort()

    def close(self) -> None:
        for protocol in self.idle:
            protocol.abort()
        self.idle.clear()


class Engine:
    """One replica's engine as the exchanges see it: take a pooled connection or connect one.

    Keeps warm connections in proportion to measured demand, so a request does not wait for a
    connect: ``demand`` is an EWMA of the concurrency each arriving request sees (itself included),
    and after each request (and while a stream's late tail holds its connection) idle spares are
    opened until idle + opening covers ``round(demand)`` minus the requests in flight (at least one
    while tails are pending), bounded by ``MAX_WARM``; idle ones unused for ``pool.idle_s`` are
    closed (``sweep``). Owns its tasks (connects, spares), so ``stop`` ends them all.
    """

    def __init__(
        self, address: UpstreamAddress, connect_timeout_s: float, pool: EnginePool | None = None
    ) -> None:
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.ssl_context = ssl.create_default_context() if address.tls else None
        self.pool = pool if pool is not None else EnginePool()
        self.tails = 0  # engine connections reading a stream's tail after [DONE] on their own
        self.in_flight = 0  # requests between begin() and end()
        self.demand = 0.0  # EWMA of the concurrency arriving requests see
        self._spares = 0
        self._warm_scheduled = False
        self._sweeper: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.stopping = False

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- demand -----------------------------------------------------------------------------------
    def begin(self) -> None:
        """A request is about to go to the engine."""
        self.in_flight += 1
        self.demand += DEMAND_ALPHA * (self.in_flight - self.demand)

    def end(self) -> None:
        """A request is over (its connection pooled, reading a tail, or closed): warm spares for the
        next ones on the next loop turn, once the read that ended it is fully handled."""
        self.in_flight -= 1
        self._warm_soon()

    def _warm_soon(self) -> None:
        if not self._warm_scheduled:
            self._warm_scheduled = True
            asyncio.get_running_loop().call_soon(self.keep_warm)

    def keep_warm(self) -> None:
        """Open idle spares up to what demand expects beyond the requests in flight (bounded)."""
        self._warm_scheduled = False
        if self.stopping:
            return
        expected = max(round(self.demand) - self.in_flight, 1 if self.tails else 0)
        want = min(expected, MAX_WARM, self.pool.max_idle) - len(self.pool.idle) - self._spares
        for _ in range(want):  # only a request's start or end calls this: no connect loop of its own
            self._spares += 1
            self.spawn(self._open_spare())
        self._arm_sweeper()

    def _arm_sweeper(self) -> None:
        if self._sweeper is None and (self.pool.idle or self._spares) and not self.stopping:
            self._sweeper = asyncio.get_running_loop().call_later(self.pool.idle_s, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        self.pool.sweep()
        self._arm_sweeper()

    # -- connections ------------------------------------------------------------------------------
    def take(self) -> EngineConnection | None:
        """A pooled connection for a request now, or None (the caller connects one)."""
        protocol = self.pool.take()
        if self.tails and not self.pool.idle:  # tails hold connections: the next request gets a spare
            self.keep_warm()
        return protocol

    async def connect(self) -> EngineConnection:
        up = self.address
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, protocol = await loop.create_connection(
                lambda: EngineConnection(self),
                up.host,
                up.port,
                ssl=self.ssl_context,
                server_hostname=up.host if up.tls else None,
            )
        return protocol

    async def _open_spare(self) -> None:
        try:
            protocol = await self.connect()
        except (OSError, TimeoutError):
            return  # a request that needs one will connect (and report the failure) itself
        finally:
            self._spares -= 1
        if self.stopping:
            protocol.abort()
        else:
            self.pool.give(protocol)
            self._arm_sweeper()

    async def stop(self) -> None:
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.pool.close()
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=5)


class EngineConnection(asyncio.Protocol):
    """One connection to the engine; reads one response at a time for the reader attached."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.tail_timer: asyncio.TimerHandle | None = None
        self._read_state(None, False, _ENDED)

    def _read_state(self, exchange: ResponseReader | None, reused: bool, mode: int) -> None:
        """What reading one response starts from (and, with no reader, what a new connection holds)."""
        self.ex = exchange
        self.reused = reused
        self.mode = mode
        self.buf = b""
        self.decoder = ChunkedDecoder()
        self.remaining = 0
        self.reads = 0
        self.reusable = False  # the response allows this connection to carry another request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream transport (also uvloop's)

    def write(self, data: bytes) -> None:
        assert self.transport is not None  # attached connections are connected
        self.transport.write(data)

    def attach(self, exchange: ResponseReader, reused: bool) -> None:
        self._read_state(exchange, reused, _HEAD)

    def pause_reading(self, paused: bool) -> None:
        if self.transport is not None:
            with contextlib.suppress(RuntimeError):
                if paused:
                    self.transport.pause_reading()
                else:
                    self.transport.resume_reading()

    def release_tail(self) -> None:
        """The exchange is done with this response (``[DONE]`` relayed): read what the engine still
        sends of it on our own, then back to the pool; closed if it takes over ``DRAIN_S``."""
        self.ex = None
        if self.mode == _ENDED or self.closed:
            return
        if self.mode == _UNTIL_CLOSE or not self.reusable:
            self.abort()  # nothing to keep this connection for
            return
        self.pause_reading(False)  # the slow client it was paused for is gone
        loop = asyncio.get_running_loop()
        self.tail_timer = loop.call_later(DRAIN_S, self._tail_too_slow)
        self.engine.tails += 1
        loop.call_soon(self._spare_if_draining)  # after this read: its last-chunk marker may be in it

    def _spare_if_draining(self) -> None:
        if self.tail_timer is not None:
            self.engine.keep_warm()

    def _tail_done(self) -> None:
        if self.tail_timer is not None:
            self.tail_timer.cancel()
            self.tail_timer = None
            self.engine.tails -= 1

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
        if ex is not None and self.mode == _CHUNKED:
            start = self.decoder.whole_chunk(data)
            if start and ex.pass_chunk(data, start):
                self.reads += 1
                return
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
                data = data[: self.remaining]
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
            self.engine.pool.discard(self)
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
            buf = buf[end + 4 :]
            if not 100 <= head.status < 200:
                break  # interim responses (100, 103) are read and dropped
        self.buf = b""
        try:
            chunked = head.chunked()
            length = None if chunked else head.content_length()
        except HttpError as exc:
            self._broken(f"the engine sent bad framing ({exc.reason})")
            return
        has_body = ex.method != b"HEAD" and head.status not in (204, 304)
        self.reusable = (
            head.version == b"HTTP/1.1"
            and not head.closes
            and (chunked or length is not None or not has_body)
        )
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
            self.engine.pool.give(self)
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
            self.engine.pool.discard(self)
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
