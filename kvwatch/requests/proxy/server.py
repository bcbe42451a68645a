"""One replica's listener: accepting clients, the connection cap, the descriptor limit, and what the
connections share (the engine pool, the buffer budget, the counters, the model labels).

``start_proxy`` is the agent's wiring entry point.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

from kvwatch.config import ProxyConfig, ReplicaConfig
from kvwatch.jsonsafe import loads
from kvwatch.requests.accounting import ModelLabels
from kvwatch.requests.proxy.client import ClientConnection, ClientContext
from kvwatch.requests.proxy.exchange import ExchangeContext
from kvwatch.requests.proxy.metering import Accounting, BufferBudget, Metering
from kvwatch.requests.proxy.pool import MAX_IDLE_UPSTREAM, Engine, EnginePool, UpstreamAddress
from kvwatch.requests.proxy.seams import (
    ACCEPT_ERRORS,
    ACCOUNTING_ERRORS,
    SHED,
    TIMED_OUT,
    USAGE_REFUSED,
)

log = logging.getLogger("kvwatch.requests.proxy")

__all__ = ["ProxyServer", "UpstreamAddress", "start_proxy"]


class ProxyServer:
    """One replica's listener; ``await stop()`` closes it and every connection.

    It builds what the pieces share (``Metering``, ``BufferBudget``, ``Engine``) and hands each piece
    only its context: a connection or an exchange never reaches back into the server. What a test
    reads of a replica's proxy it reads from the piece that holds it (``budget.held``,
    ``engine.pool``, ``metering.labels``).
    """

    def __init__(
        self, replica: ReplicaConfig, config: ProxyConfig, labels: ModelLabels, accounting: Accounting
    ) -> None:
        if replica.api_url is None:
            raise ValueError(f"replicas[{replica.name}].api_url: the proxy needs the engine's base URL")
        self.replica = replica.name
        self.config = config
        self.upstream = UpstreamAddress.from_url(replica.api_url)
        self.metering = Metering(replica.name, labels, accounting, config.inject_usage)
        self.budget = BufferBudget(config.max_buffered_bytes)
        self.engine = Engine(self.upstream, config.upstream_connect_timeout_s, EnginePool())
        self.connections: set[ClientConnection] = set()
        self.clients = ClientContext(
            config,
            self.budget,
            self.connections,
            self.metering,
            ExchangeContext(self.engine, self.metering, self.budget, config.upstream_read_timeout_s),
        )
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._learner: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self, host: str, port: int, learn_models: bool = True, reuse_port: bool = False) -> None:
        """``reuse_port``: share the port with other processes' listeners (``SO_REUSEPORT``: the relay
        worker processes of ``workers.py``), the kernel spreading connections among them."""
        loop = asyncio.get_running_loop()
        _log_accept_failures(loop, self)
        _warn_if_descriptors_short(self)
        clients = self.clients
        self._server = await loop.create_server(
            lambda: ClientConnection(clients),
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
        if self._server is not None:
            self._server.close()
        self.engine.stopping = True
        self.engine.pool.close()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._learner is not None:
            self._learner.cancel()
        await self.engine.stop()
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
                        served = _served_models(loads(await response.content.read(1 << 20)))
                        if served is not None:
                            self.metering.labels.learn(served)
                            return
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass  # not an answer (or not JSON): asked again
            await asyncio.sleep(delay)
            delay = min(delay * 2, 60.0)


def _served_models(doc: object) -> list[str] | None:
    """The ``id`` of each model in an OpenAI model list (``{"data": [{"id": ...}, ...]}``); None when
    the document is not one, so that the engine is asked again."""
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    return [name for m in data if isinstance(m, dict) and isinstance(name := m.get("id"), str)]


async def start_proxy(
    replica: ReplicaConfig,
    proxy: ProxyConfig,
    known_models: Iterable[str],
    accounting: Accounting,
    *,
    learn_models: bool = True,
    reuse_port: bool = False,
) -> ProxyServer:
    """Start the replica's listener on ``replica.proxy_listen``; the agent's wiring entry point.

    ``known_models``: label values a client's ``model`` may keep (``Config.known_models``); the
    replica's ``model_name`` and, with ``learn_models``, the engine's ``/v1/models`` ids join them.
    ``accounting``: where requests are counted; the agent passes its own ``wall_clock`` there, so
    requests (``started_at``, ``max_gap_ended_at``) and engine scrapes share one time base.
    ``reuse_port``: see ``ProxyServer.start``.
    """
    if replica.proxy_listen is None:
        raise ValueError(f"replica {replica.name}: proxy_listen is not set")
    server = ProxyServer(replica, proxy, ModelLabels(known_models, replica.model_name), accounting)
    # zero series from the start, so rate() sees the first
    count = accounting.count
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
            proxy.metering.counted(ACCEPT_ERRORS)
            proxy.metering.log_repeatable(
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
