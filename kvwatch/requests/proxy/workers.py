"""Relay worker processes: the proxy on every core the agent may use (``proxy.workers``).

Each worker is a process of its own (``python -m kvwatch.requests.proxy.workers``) running the
in-process relay (``start_proxy``) on its own event loop, uvloop when installed, for *every*
proxied replica: each replica's port is bound by all workers with ``SO_REUSEPORT``, and the kernel
spreads new connections over them (by a hash of the connection's addresses). A busy replica thus
uses all workers, not one. The agent keeps one bound, not listening, socket per port so the port
stays the agent's while a worker restarts.

What a worker measures reaches the agent through ``channel.py``; the agent applies it to the same
sink, counters and in-flight tracker as the in-process proxy, so /metrics and the ledger (which
stay on the agent's process) read exactly what one process would have produced.

Limits divide among the workers, so the node-wide bounds hold: each worker gets
``proxy.max_buffered_bytes / workers`` (but at least ``proxy.max_body_bytes``, so any allowed body
still fits) and ``ceil(proxy.max_connections / workers)`` client connections per replica. The
kernel's hash does not spread connections perfectly evenly, so with many workers a replica may
shed (503) a little before ``max_connections`` clients in all; the total never exceeds it by more
than ``workers - 1``.

A worker that exits is restarted after a backoff (0.5 s doubling to 30 s, back to 0.5 s once a worker
has run a minute) and counted (``kvwatch_proxy_worker_restarts_total``). The requests it was
relaying are cut (their clients see a reset, as with any crashed proxy) and counted as lost
(``kvwatch_proxy_worker_records_lost_total{reason="worker_died"}``). Connections waiting in its
accept queue are reset by the kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvwatch.config import ProxyConfig, ReplicaConfig
from kvwatch.config.validate import HostPort
from kvwatch.model import LengthBands
from kvwatch.requests.proxy.channel import (
    AGENT_MESSAGE_BYTES,
    DATAGRAMS_REFUSED,
    RECORDS_LOST,
    WORKER_RESTARTS,
    ChannelReceiver,
    WorkerChannel,
    read_log_level,
)
from kvwatch.requests.proxy.metering import Accounting

log = logging.getLogger("kvwatch.requests.proxy.workers")

START_TIMEOUT_S = 60.0  # a worker's interpreter start and imports, on a loaded node
STOP_TIMEOUT_S = 5.0
BACKOFF_FIRST_S, BACKOFF_MAX_S, STEADY_S = 0.5, 30.0, 60.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to serve: handed to it pickled on its stdin (parent to child only)."""

    index: int
    channel_fd: int
    replicas: tuple[ReplicaConfig, ...]  # proxy_listen holds the port the agent reserved
    proxy: ProxyConfig  # already this worker's share of the limits
    known_models: tuple[str, ...]
    bands: LengthBands
    log_level: int
    learn_models: bool = True  # ask each engine's /v1/models for label values (start_proxy's)


def worker_share(proxy: ProxyConfig, workers: int) -> ProxyConfig:
    """One worker's part of the per-replica limits (see the module docstring)."""
    return dataclasses.replace(
        proxy,
        max_connections=max(1, math.ceil(proxy.max_connections / workers)),
        max_buffered_bytes=max(proxy.max_body_bytes, proxy.max_buffered_bytes // workers),
    )


def reserve_port(listen: HostPort) -> socket.socket:
    """A bound, not listening, ``SO_REUSEPORT`` socket on the replica's address: it fixes a port 0 to
    a real one and keeps the port while workers restart (it takes no connections itself)."""
    infos = socket.getaddrinfo(
        listen.host or None, listen.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, kind, proto, _, address = infos[0]
    if address[1]:
        _held_by_no_one(family, kind, proto, address)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class WorkerStartError(OSError):
    """A relay worker exited before it served: ``kvwatch run`` stops with the message, as it does
    when a socket cannot be bound (a RuntimeError ended it in a traceback)."""


def _held_by_no_one(family: int, kind: int, proto: int, address: tuple) -> None:
    """Raise if another socket holds the port. ``SO_REUSEPORT`` lets any process of the same user
    join it, so a second agent with the same ``proxy_listen`` would start without an error and the
    kernel would split the clients between the two: a plain bind first fails where that one would not."""
    probe = socket.socket(family, kind, proto)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
        probe.bind(address)
    except OSError as exc:
        raise OSError(
            exc.errno, f"{address[0]}:{address[1]} is held by another process ({exc.strerror})"
        ) from None
    finally:
        probe.close()


class _Slot:
    """One worker position: its process now, and its channel."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: asyncio.subprocess.Process | None = None
        self.receiver: ChannelReceiver | None = None
        self.ready: asyncio.Future[None] | None = None
        self.restarts = 0


class WorkerGroup:
    """The agent's side: starts the workers, applies their accounting, restarts them; ``stop()``."""

    def __init__(
        self,
        replicas: Iterable[ReplicaConfig],
        proxy: ProxyConfig,
        known_models: Iterable[str],
        accounting: Accounting,
        workers: int,
        learn_models: bool = True,
    ) -> None:
        self.replicas = tuple(replicas)
        self.learn_models = learn_models
        for replica in self.replicas:
            if replica.proxy_listen is None or replica.api_url is None:
                raise ValueError(f"replica {replica.name}: the proxy needs proxy_listen and api_url")
        self.proxy = worker_share(proxy, workers)
        self.known_models = tuple(known_models)
        self.accounting = accounting
        self.count = accounting.count
        self.slots = [_Slot(i) for i in range(workers)]
        self.ports: dict[str, int] = {}
        self._reserved: list[socket.socket] = []
        self._bound: tuple[ReplicaConfig, ...] = ()
        self._supervisors: list[asyncio.Task[None]] = []
        self._watchers: set[asyncio.Task[None]] = set()
        self._stopping = False

    async def start(self) -> None:
        """Reserve the ports, start every worker, and return once all of them listen."""
        self.count(WORKER_RESTARTS, amount=0)
        self.count(DATAGRAMS_REFUSED, amount=0)
        bound = []
        try:
            for replica in self.replicas:
                assert replica.proxy_listen is not None
                sock = reserve_port(replica.proxy_listen)
                self._reserved.append(sock)
                port = sock.getsockname()[1]
                self.ports[replica.name] = port
                listen = HostPort(replica.proxy_listen.host, port)
                bound.append(dataclasses.replace(replica, proxy_listen=listen))
                for reason in ("worker_died", "backlog"):
                    self.count(RECORDS_LOST, replica.name, reason, amount=0)
            self._bound = tuple(bound)
            for slot in self.slots:
                await self._spawn(slot)
            waits = [s.ready for s in self.slots if s.ready is not None]
            async with asyncio.timeout(START_TIMEOUT_S):
                await asyncio.gather(*waits)
        except BaseException:
            await self.stop()
            raise
        self._supervisors = [asyncio.get_running_loop().create_task(self._supervise(s)) for s in self.slots]
        log.info(
            "proxy: %d relay worker processes serve %s",
            len(self.slots),
            ", ".join(f"{name} on :{port}" for name, port in self.ports.items()),
        )

    @property
    def pids(self) -> list[int]:
        return [s.process.pid for s in self.slots if s.process is not None and s.process.returncode is None]

    async def _spawn(self, slot: _Slot) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        slot.ready = ready

        def on_ready() -> None:
            if not ready.done():
                ready.set_result(None)

        spec = WorkerSpec(
            slot.index,
            theirs.fileno(),
            self._bound,
            self.proxy,
            self.known_models,
            self.accounting.bands,
            logging.getLogger("kvwatch").getEffectiveLevel(),
            self.learn_models,
        )
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvwatch.requests.proxy.workers",
                stdin=asyncio.subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        slot.process = process
        slot.receiver = ChannelReceiver(
            ours,
            (r.name for r in self.replicas),
            self.accounting.sink,
            self.count,
            self.accounting.in_flight,
            on_ready,
        )
        assert process.stdin is not None
        # a worker that already exited: asyncio's pipe says ConnectionError, uvloop's a closed handle
        # (RuntimeError); the watcher below reports why it ended
        with contextlib.suppress(ConnectionError, RuntimeError):
            process.stdin.write(pickle.dumps(spec))
            await process.stdin.drain()
        process.stdin.close()
        watcher = loop.create_task(self._fail_start_if_exits(slot, ready))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    async def _fail_start_if_exits(self, slot: _Slot, ready: asyncio.Future[None]) -> None:
        process = slot.process
        assert process is not None
        await process.wait()
        if not ready.done():
            ready.set_exception(
                WorkerStartError(
                    f"proxy worker {slot.index} exited at start (status {process.returncode}); "
                    "see its log above"
                )
            )

    async def _ended(self, slot: _Slot) -> None:
        """Wait until the worker has exited and everything it sent has been applied."""
        assert slot.process is not None and slot.receiver is not None
        await slot.process.wait()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_TIMEOUT_S):  # its end of the channel closed with it
                await asyncio.shield(slot.receiver.closed)
        slot.receiver.close()
        lost = slot.receiver.fail_in_flight()
        if lost and not self._stopping:
            log.error(
                "proxy worker %d: %d requests in flight were cut; counted in %s_total",
                slot.index,
                lost,
                RECORDS_LOST,
            )

    async def _supervise(self, slot: _Slot) -> None:
        delay = BACKOFF_FIRST_S
        while True:
            started = time.monotonic()
            await self._ended(slot)
            if self._stopping:
                return
            assert slot.process is not None
            self.count(WORKER_RESTARTS)
            slot.restarts += 1
            if time.monotonic() - started > STEADY_S:
                delay = BACKOFF_FIRST_S
            log.error(
                "proxy worker %d exited (status %s); restarting it in %.1f s (counted in %s_total)",
                slot.index,
                slot.process.returncode,
                delay,
                WORKER_RESTARTS,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
            if self._stopping:
                return
            try:
                await self._spawn(slot)
            except OSError:
                log.exception("proxy worker %d could not be started; trying again", slot.index)

    def set_log_level(self, level: int) -> None:
        """A reload changed the agent's log level: every running worker takes it too."""
        for slot in self.slots:
            if slot.receiver is not None:
                slot.receiver.tell_log_level(level)

    async def stop(self) -> None:
        """Stop every worker (SIGTERM: it closes its connections, so engines free KV), then the ports."""
        self._stopping = True
        for task in self._supervisors:
            task.cancel()
        for slot in self.slots:
            if slot.process is not None and slot.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.process.send_signal(signal.SIGTERM)
        for slot in self.slots:
            if slot.process is None:
                continue
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await self._ended(slot)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    slot.process.kill()
                await self._ended(slot)
        for sock in self._reserved:
            sock.close()
        self._reserved.clear()


# --------------------------------------------------------------------------------------------
# the worker process
# --------------------------------------------------------------------------------------------


async def serve(spec: WorkerSpec) -> None:
    """Run the relay for every replica until SIGTERM or until the agent's end of the channel closes."""
    from kvwatch.requests.proxy.server import start_proxy

    if spec.learn_models:  # imported now, not by the first /v1/models task: that blocks the loop
        import aiohttp  # noqa: F401  (measured: 0.3-0.5 s on a loaded machine, clients waiting)

    loop = asyncio.get_running_loop()
    sock = socket.socket(fileno=spec.channel_fd)
    channel = WorkerChannel(sock, loop)
    done = loop.create_future()

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_signal_handler(signal.SIGTERM, finish)
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent stops its workers itself
    # the agent gone (its end closed): nothing is left to account to, so stop relaying
    loop.add_reader(sock.fileno(), lambda: _from_agent(sock, finish))
    servers = []
    for replica in spec.replicas:
        servers.append(
            await start_proxy(
                replica,
                spec.proxy,
                spec.known_models,
                Accounting(spec.bands, channel, channel.sink, channel.count),
                learn_models=spec.learn_models,
                reuse_port=True,
            )
        )
    channel.ready()
    await done
    loop.remove_reader(sock.fileno())
    for server in servers:
        await server.stop()
    for _ in range(3):  # records and in-flight ends follow a closed exchange on the next loop turns
        await asyncio.sleep(0)
    channel.flush()


def _from_agent(sock: socket.socket, finish: Callable[[], None]) -> None:
    """The agent's end of the channel: closed (the agent is gone: stop relaying), or a log level."""
    try:
        data = sock.recv(AGENT_MESSAGE_BYTES, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return
    except OSError:
        data = b""
    if not data:
        finish()
        return
    level = read_log_level(data)
    if level is not None:
        logging.getLogger().setLevel(level)
        log.info("log level now %s (the agent's config was reloaded)", logging.getLevelName(level))


def main() -> None:
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)  # from the agent that started this process
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s[worker {spec.index} pid {os.getpid()}]: %(message)s",
        stream=sys.stderr,
    )
    try:  # as the agent does (commands/run.py use_uvloop): the relay is about 20% cheaper on it
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    asyncio.run(serve(spec))


if __name__ == "__main__":
    main()
