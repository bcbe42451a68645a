"""One replica's listener: accepting clients, the connection cap, the descriptor limit, and what the
connections share (the engine pool, the buffer budget, the counters, the model labels).

``start_proxy`` is the agent's wiring entry point.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from time import perf_counter
from typing import Any
from urllib.parse import urlsplit

from kvwatch.config import ProxyConfig, ReplicaConfig
from kvwatch.logthrottle import LogThrottle
from kvwatch.model import LengthBands, Outcome, RequestRecord
from kvwatch.requests.accounting import InFlight, ModelLabels, RequestMeter
from kvwatch.requests.http1 import RequestHead
from kvwatch.requests.proxy.client import ClientConnection
from kvwatch.requests.proxy.exchange import METERED_PATHS
from kvwatch.requests.proxy.pool import MAX_IDLE_UPSTREAM, EngineConnection, EnginePool
from kvwatch.requests.proxy.seams import (
    ACCEPT_ERRORS,
    ACCOUNTING_ERRORS,
    REFUSED,
    REFUSED_CLIENT_GONE,
    SHED,
    TIMED_OUT,
    USAGE_REFUSED,
    Clock,
    MeterFactory,
    Sink,
)
from kvwatch.selfmetrics import Count

log = logging.getLogger("kvwatch.requests.proxy")

MAX_SPARES = 8  # engine connections being opened ahead of need at once (see ProxyServer.warm_spare)


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

    def __init__(
        self,
        replica: ReplicaConfig,
        config: ProxyConfig,
        labels: ModelLabels,
        bands: LengthBands,
        in_flight: InFlight,
        sink: Sink,
        count: Count,
        meter_factory: MeterFactory = RequestMeter,
        clock: Clock = perf_counter,
        wall_clock: Clock = time.time,
    ) -> None:
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
        self.pool = EnginePool()
        self.connections: set[ClientConnection] = set()
        self.buffered = 0  # bytes held by all connections and exchanges (proxy.max_buffered_bytes)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._learner: asyncio.Task[None] | None = None
        self.log_throttle = LogThrottle()  # every line a client or the engine can repeat goes through it
        self._spares = 0
        self.tails = 0  # engine connections reading a stream's tail after [DONE] on their own
        self._stopping = False

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self, host: str, port: int, learn_models: bool = True, reuse_port: bool = False) -> None:
        """``reuse_port``: share the port with other processes' listeners (``SO_REUSEPORT``: the relay
        worker processes of ``workers.py``), the kernel spreading connections among them."""
        loop = asyncio.get_running_loop()
        _log_accept_failures(loop, self)
        _warn_if_descriptors_short(self)
        self._server = await loop.create_server(
            lambda: ClientConnection(self),
            host,
            port,
            backlog=1024,
            reuse_address=True,
            reuse_port=reuse_port or None,
        )
        if learn_models:
            self._learner = self.spawn(self._learn_models())
        log.info(
            "proxy for replica %s listening on %s:%d -> %s:%d",
            self.replica,
            host,
            self.port,
            self.upstream.host,
            self.upstream.port,
        )

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def listens_on(self, sock: Any) -> bool:
        """Whether an exception context's listening socket is this proxy's (absent: taken as ours)."""
        if sock is None or self._server is None:
            return True
        with contextlib.suppress(Exception):
            return any(own.fileno() == sock.fileno() for own in self._server.sockets)
        return False

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

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def connect_upstream(self) -> EngineConnection:
        up = self.upstream
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.config.upstream_connect_timeout_s):
            _, protocol = await loop.create_connection(
                lambda: EngineConnection(self),
                up.host,
                up.port,
                ssl=self.ssl_context,
                server_hostname=up.host if up.tls else None,
            )
        return protocol

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
            protocol = await self.connect_upstream()
        except (OSError, TimeoutError):
            return  # a request that needs one will connect (and report the failure) itself
        finally:
            self._spares -= 1
        if self._stopping:
            protocol.abort()
        else:
            self.pool.give(protocol)

    def counted(self, family: str, *labels: str) -> None:
        """Count one occurrence of a self-metric of this replica; counting never raises into the proxy."""
        with contextlib.suppress(Exception):
            self.count(family, self.replica, *labels)

    def log_repeatable(
        self, level: int, key: str, msg: str, *args: object, exc_info: BaseException | bool | None = None
    ) -> None:
        """Log a line a client or the engine can make kvwatch repeat: throttled per ``key``."""
        self.log_throttle.log(log, level, key, msg, *args, exc_info=exc_info)

    def shed(self, reason: str) -> None:
        self.counted(SHED, reason)
        self.log_repeatable(
            logging.WARNING,
            f"{SHED}:{reason}",
            "proxy %s: answering 503 (%s limit reached: proxy.%s; counted in %s_total)",
            self.replica,
            reason,
            "max_buffered_bytes" if reason == "buffer" else "max_connections",
            SHED,
        )

    def refused(self, status: int, client_gone: bool) -> None:
        """A request kvwatch answered itself while reading it (``ClientConnection._refuse``)."""
        self.counted(REFUSED, str(status))
        if client_gone:  # nothing to tell anyone: the client left before its answer could be written
            self.counted(REFUSED_CLIENT_GONE, str(status))

    # -- accounting hooks (never raise into the relay) --------------------------------------------
    def accounting_failed(self, where: str, exc: BaseException | None = None) -> None:
        self.counted(ACCOUNTING_ERRORS)
        self.log_repeatable(
            logging.ERROR,
            ACCOUNTING_ERRORS,
            "proxy %s: request accounting failed in %s; the stream kept flowing (counted in %s_total)",
            self.replica,
            where,
            ACCOUNTING_ERRORS,
            exc_info=exc if exc is not None else True,
        )

    def emit(self, record: RequestRecord) -> None:
        try:
            self.sink(record)
            if record.chunks and record.output_tokens and not record.output_tokens_estimated:
                # exact usage of a finished stream teaches the in-flight estimate how many tokens
                # a chunk carries on this replica (stream intervals, speculative decoding)
                self.in_flight.calibrate(self.replica, record.output_tokens, record.chunks)
        except Exception as exc:
            self.accounting_failed("sink", exc)

    def record_refusal(self, head: RequestHead, status: int, t0: float, wall: float) -> None:
        """A metered request kvwatch answered itself (413): counted as rejected, never relayed."""
        endpoint = METERED_PATHS.get(head.path) if head.method == b"POST" else None
        if endpoint is None:
            return
        try:
            self.emit(
                RequestRecord(
                    replica=self.replica,
                    model_name=self.labels.label(None),
                    source="proxy",
                    outcome=Outcome.REJECTED,
                    started_at=wall,
                    endpoint=endpoint,
                    status_code=status,
                    e2e_seconds=self.clock() - t0,
                )
            )
        except Exception as exc:
            self.accounting_failed("refusal", exc)

    def usage_injection_refused(self) -> None:
        """The engine refused a body with include_usage and took the client's own: counted, logged.

        Nothing is decided for the replica from it: one client's body must not switch usage counting
        off for everyone (an operator whose engine refuses the field sets proxy.inject_usage: false).
        """
        self.counted(USAGE_REFUSED)
        self.log_repeatable(
            logging.WARNING,
            USAGE_REFUSED,
            "proxy %s: the engine refused a body with stream_options.include_usage and "
            "took the client's own; that stream is counted from chunks (counted in "
            "%s_total; set proxy.inject_usage: false if the engine never takes it)",
            self.replica,
            USAGE_REFUSED,
        )

    def engine_sends_usage_unasked(self) -> None:
        """Engine output, which no client can forge (its text is JSON-escaped inside one event)."""
        if not self.engine_forces_usage:
            self.engine_forces_usage = True
            log.info(
                "proxy %s: the engine sends a usage chunk unasked (--enable-force-include-usage); "
                "kvwatch no longer asks for it, and relays it as the engine sent it",
                self.replica,
            )

    async def _learn_models(self) -> None:
        """Add the engine's served model names (``/v1/models``) to the label set, once."""
        import aiohttp

        url = (
            f"{'https' if self.upstream.tls else 'http'}://{self.upstream.host_header.decode()}"
            f"{self.upstream.base_path.decode()}/v1/models"
        )
        delay = 2.0
        while True:
            try:
                async with (
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
                    session.get(url) as response,
                ):
                    if response.status == 200:
                        doc = json.loads(await response.content.read(1 << 20))
                        self.labels.learn(
                            name
                            for m in doc.get("data", [])
                            if isinstance(m, dict) and isinstance(name := m.get("id"), str)
                        )
                        return
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
                pass
            await asyncio.sleep(delay)
            delay = min(delay * 2, 60.0)


async def start_proxy(
    replica: ReplicaConfig,
    proxy: ProxyConfig,
    known_models: Iterable[str],
    bands: LengthBands,
    in_flight: InFlight,
    sink: Sink,
    count: Count,
    *,
    meter_factory: MeterFactory = RequestMeter,
    learn_models: bool = True,
    clock: Clock = perf_counter,
    wall_clock: Clock = time.time,
    reuse_port: bool = False,
) -> ProxyServer:
    """Start the replica's listener on ``replica.proxy_listen``; the agent's wiring entry point.

    ``known_models``: label values a client's ``model`` may keep (``Config.known_models``); the
    replica's ``model_name`` and, with ``learn_models``, the engine's ``/v1/models`` ids join them.
    ``sink`` gets every finished metered request; ``count`` is ``NodeState.count``. ``clock``
    measures durations; ``wall_clock`` dates requests (``started_at``, ``max_gap_ended_at``): the agent
    passes its own clock so requests and engine scrapes share one time base. ``reuse_port``: see
    ``ProxyServer.start``.
    """
    if replica.proxy_listen is None:
        raise ValueError(f"replica {replica.name}: proxy_listen is not set")
    server = ProxyServer(
        replica,
        proxy,
        ModelLabels(known_models, replica.model_name),
        bands,
        in_flight,
        sink,
        count,
        meter_factory,
        clock,
        wall_clock,
    )
    # zero series from the start, so rate() sees the first
    for family in (ACCOUNTING_ERRORS, TIMED_OUT, USAGE_REFUSED, ACCEPT_ERRORS):
        count(family, replica.name, amount=0)
    for reason in ("buffer", "connections"):
        count(SHED, replica.name, reason, amount=0)
    await server.start(replica.proxy_listen.host, replica.proxy_listen.port, learn_models, reuse_port)
    return server


def _log_accept_failures(loop: asyncio.AbstractEventLoop, proxy: ProxyServer) -> None:
    """Make a failing ``accept()`` (out of file descriptors: EMFILE) visible: counted, logged throttled.

    asyncio reports it to the loop's exception handler and retries a second later; clients meanwhile
    wait in the backlog or are dropped. A failed accept is handled here and goes no further (the
    default handler would print a traceback per failure); everything else is passed on to whatever
    handled it before.
    """
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if (
            "accept" in str(context.get("message", ""))
            and isinstance(exc, OSError)
            and proxy.listens_on(context.get("socket"))
        ):
            proxy.counted(ACCEPT_ERRORS)
            proxy.log_repeatable(
                logging.ERROR,
                ACCEPT_ERRORS,
                "proxy %s: cannot accept a connection (%s); new clients wait or are "
                "dropped (counted in %s_total). Raise the open-files limit (LimitNOFILE, "
                "ulimit -n) or lower proxy.max_connections",
                proxy.replica,
                exc.strerror or exc,
                ACCEPT_ERRORS,
            )
            return
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
        log.warning(
            "proxy %s: the open-files limit (%d) is below what proxy.max_connections=%d needs (~%d: "
            "a client and an engine descriptor each); clients past it are dropped unlogged under "
            "uvloop. Raise LimitNOFILE / ulimit -n, or lower proxy.max_connections",
            proxy.replica,
            soft,
            proxy.config.max_connections,
            need,
        )
