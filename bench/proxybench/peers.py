"""What the bench relays through besides kvwatch (nginx, bare aiohttp and asyncio relays), the
kvwatch role itself, and the role table."""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from proxybench.common import NGINX, _ready
from proxybench.upstreams import role_upstream

from kvwatch.buckets import INTER_CHUNK_SECONDS as GAP_BOUNDS

HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-length",
    "proxy-connection",
}


async def role_aiohttp(args: argparse.Namespace) -> None:
    """aiohttp server + aiohttp client, bytes passed through as read (iter_any)."""
    import aiohttp
    from aiohttp import web

    upstream = f"http://127.0.0.1:{args.upstream_port}"
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with session.request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as up:
            resp = web.StreamResponse(
                status=up.status, headers={k: v for k, v in up.headers.items() if k.lower() not in HOP}
            )
            await resp.prepare(request)
            async for data in up.content.iter_any():
                await resp.write(data)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port, backlog=1024).start()
    _ready(args.port)
    try:
        await asyncio.Event().wait()
    finally:
        await session.close()
        await runner.cleanup()


class _RawUp(asyncio.Protocol):
    def __init__(self, down: asyncio.Transport) -> None:
        self.down = down

    def data_received(self, data: bytes) -> None:
        self.down.write(data)

    def connection_lost(self, exc) -> None:
        self.down.close()


class _CountingUp(_RawUp):
    """The bare relay plus the least any exact per-stream meter does per engine read: a clock read,
    the events in the read counted (one bytes scan), the gap since the last one binned, a counter.

    Not a meter (no framing, usage or finish reason is understood): a floor under what kvwatch's
    accounting in Python can cost per chunk, measured in the same run as nginx."""

    def __init__(self, down: asyncio.Transport) -> None:
        super().__init__(down)
        self.events = 0
        self.last = 0.0
        self.bins = [0] * (len(GAP_BOUNDS) + 1)

    def data_received(self, data: bytes) -> None:
        self.down.write(data)
        now = time.perf_counter()
        n = data.count(b"data: ")
        if n:
            if self.events:
                self.bins[bisect.bisect_left(GAP_BOUNDS, now - self.last)] += 1
            self.events += n
            self.last = now


class _RawDown(asyncio.Protocol):
    """Raw protocols: request bytes forwarded once complete, response bytes forwarded untouched.

    A floor for the stack comparison, not a proxy: one upstream connection per client connection
    (the client's ``connection: close`` travels with the bytes), no parsing of the response."""

    upstream_port = 0
    upstream_protocol: type[_RawUp] = _RawUp

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        self.buf = b""
        self.up: asyncio.Transport | None = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.up is not None:
            return
        m = re.search(rb"(?im)^content-length:\s*(\d+)", self.buf[:end])
        if len(self.buf) < end + 4 + (int(m.group(1)) if m else 0):
            return
        asyncio.get_running_loop().create_task(self.forward(self.buf))

    async def forward(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        self.up, _ = await loop.create_connection(
            lambda: self.upstream_protocol(self.transport), "127.0.0.1", self.upstream_port
        )
        self.up.write(request)

    def connection_lost(self, exc) -> None:
        if self.up is not None:
            self.up.close()


async def role_raw(args: argparse.Namespace) -> None:
    _RawDown.upstream_port = args.upstream_port
    if args.role == "rawcount":
        _RawDown.upstream_protocol = _CountingUp
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_RawDown, "127.0.0.1", args.port, backlog=1024)
    _ready(args.port)
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def _agent_sinks() -> Iterator[tuple[Any, Callable[[Any], None]]]:
    """A ``NodeState`` and what the agent does with each finished record: request stats and the
    ledger (written to a folder removed at the end)."""
    from kvwatch.model import DEFAULT_BANDS
    from kvwatch.requests.ledger import RequestLedger
    from kvwatch.state import NodeState

    state = NodeState("bench", DEFAULT_BANDS)
    ledger_dir = tempfile.mkdtemp(prefix="kvwatch-bench-ledger-")
    ledger = RequestLedger(os.path.join(ledger_dir, "requests.jsonl"), DEFAULT_BANDS, counter=state.count)
    ledger.start()

    def sink(record) -> None:
        state.requests.observe(record)
        ledger.write(record)

    try:
        yield state, sink
    finally:
        ledger.stop()
        shutil.rmtree(ledger_dir, ignore_errors=True)


async def role_kvwatch(args: argparse.Namespace) -> None:
    """The real proxy with full accounting: request stats, in-flight tracking and the ledger."""
    from kvwatch.agent.heap import freeze_start_up_heap
    from kvwatch.config import ProxyConfig, ReplicaConfig, parse_host_port
    from kvwatch.model import DEFAULT_BANDS
    from kvwatch.requests.proxy import start_proxy

    replica = ReplicaConfig(
        name="bench",
        metrics_url=f"http://127.0.0.1:{args.upstream_port}/metrics",
        api_url=f"http://127.0.0.1:{args.upstream_port}",
        proxy_listen=parse_host_port(f"127.0.0.1:{args.port}"),
        model_name="bench",
    )
    with _agent_sinks() as (state, sink):
        try:
            from kvwatch.requests.proxy import Accounting
        except ImportError:  # a --baseline checkout from before Accounting (a8cc5d0) takes the parts
            parts: tuple = (DEFAULT_BANDS, state.in_flight, sink, state.count)
        else:
            parts = (Accounting(DEFAULT_BANDS, state.in_flight, sink, state.count),)
        proxy = await start_proxy(replica, ProxyConfig(), frozenset({"bench"}), *parts)
        # as the agent does once started (agent/heap.py): without it, a full collection walks the
        # start-up heap on the loop (20-60 ms here), a stall the agent does not have
        freeze_start_up_heap()
        _ready(args.port)
        try:
            await asyncio.Event().wait()
        finally:
            await proxy.stop()


async def role_meter(args: argparse.Namespace) -> None:
    """The agent's end of the ``nginxlua`` target: the messages nginx_meter.lua sends, decoded and
    applied by the agent's own ``ChannelReceiver`` to the sinks the ``kvwatch`` role feeds (request
    stats, in-flight tracker, ledger). At exit it writes what it applied to ``--socket``.json."""
    import json

    from kvwatch.agent.heap import freeze_start_up_heap
    from kvwatch.requests.proxy.channel import DATAGRAMS_REFUSED, ChannelReceiver

    applied = {"records": 0, "chunks": 0, "estimated": 0, "whole": 0, "outcomes": {}}

    def tally(record) -> None:
        applied["records"] += 1
        if record.outcome.value == "completed":  # what a client that stayed counted, to compare
            applied["chunks"] += record.chunks or 0
        applied["estimated"] += record.output_tokens_estimated
        # as RequestMeter builds them: a gap per content chunk after the first, a TTFT, an e2e after it
        whole = (
            sum(record.gap_counts) == (record.chunks or 0) - 1
            and record.ttft_seconds is not None
            and record.e2e_seconds is not None
            and 0 < record.ttft_seconds <= record.e2e_seconds
        )
        applied["whole"] += whole
        applied["outcomes"][record.outcome.value] = applied["outcomes"].get(record.outcome.value, 0) + 1

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    sock.bind(args.socket)
    with _agent_sinks() as (state, agent_sink):

        def sink(record) -> None:
            agent_sink(record)
            tally(record)

        ChannelReceiver(sock, ["bench"], sink, state.count, state.in_flight)
        freeze_start_up_heap()  # as the agent does once started, and the kvwatch role (above)
        _ready(args.port)
        try:
            await asyncio.Event().wait()
        finally:
            applied["refused"] = sum(v for _, v in state.counters_for(DATAGRAMS_REFUSED))
            applied["in_flight_left"] = len(state.in_flight.current())
            Path(args.socket + ".json").write_text(json.dumps(applied))


#: ``meter``: the agent's end of the ``nginxlua`` target (nginx running nginx_meter.lua)
#: ``kvwatchbase``: the same role with kvwatch imported from ``--baseline`` (another checkout), so a
#: change is measured against the code before it in the same run, targets interleaved
ROLES = {
    "upstream": role_upstream,
    "meter": role_meter,
    "aiohttp": role_aiohttp,
    "raw": role_raw,
    "rawcount": role_raw,
    "kvwatch": role_kvwatch,
    "kvwatchbase": role_kvwatch,
}


#: nginx_meter.lua in every proxied location, and the module it needs loaded; the workers run as
#: the bench's own user (root here), so they may send to the meter's socket in its private folder
_METER_MAIN = """
user root;
load_module /usr/lib/nginx/modules/ndk_http_module.so;
load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;"""
_METER_LOCATION = """
      access_by_lua_block { meter.access() }
      body_filter_by_lua_block { meter.body() }
      log_by_lua_block { meter.log() }"""


def _meter_http(socket_path: str) -> str:
    """The http-level lines that load and configure nginx_meter.lua with the agent's settings."""
    import json

    from kvwatch.buckets import INTER_CHUNK_SECONDS
    from kvwatch.model import DEFAULT_BANDS

    conf = json.dumps(
        {
            "socket": socket_path,
            "replica": "bench",
            "models": ["bench"],
            "default_model": "bench",
            "inject_usage": True,  # proxy.inject_usage's default
            "gap_bounds": INTER_CHUNK_SECONDS,
            "band_edges": DEFAULT_BANDS.edges,
            "band_names": DEFAULT_BANDS.names,
        }
    )
    return f"""
  lua_package_path "{Path(__file__).parent}/?.lua;;";
  client_body_buffer_size 1m;
  init_by_lua_block {{ meter = require "nginx_meter"; meter.configure([=[{conf}]=]) }}
  init_worker_by_lua_block {{ meter.init_worker() }}"""


def _spawn_nginx(
    port: int,
    upstream_port: int,
    workdir: Path,
    workers: str = "1",
    more: Sequence[tuple[int, int]] = (),
    meter_socket: str | None = None,
) -> subprocess.Popen:
    """nginx as a streaming proxy on ``port`` -> ``upstream_port`` (and each (listen, upstream) pair
    in ``more``); ``workers`` is its ``worker_processes`` (a count, or ``auto``: one per core).
    With ``meter_socket``, every location runs nginx_meter.lua, sending to that socket."""
    for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi", "logs"):
        (workdir / d).mkdir(parents=True, exist_ok=True)
    routes = [(port, upstream_port), *more]
    blocks = "".join(
        f"""
  upstream engine{i} {{
    server 127.0.0.1:{up};
    keepalive 64;
  }}
  server {{
    listen 127.0.0.1:{listen} backlog=1024;
    location / {{
      proxy_pass http://engine{i};
      proxy_buffering off;
      proxy_http_version 1.1;
      proxy_set_header Connection "";{_METER_LOCATION if meter_socket else ""}
    }}
  }}"""
        for i, (listen, up) in enumerate(routes)
    )
    conf = workdir / "nginx.conf"
    conf.write_text(f"""
daemon off;{_METER_MAIN if meter_socket else ""}
worker_processes {workers};
pid {workdir}/nginx.pid;
error_log {workdir}/logs/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {workdir}/client_body;
  proxy_temp_path {workdir}/proxy;
  fastcgi_temp_path {workdir}/fastcgi;
  uwsgi_temp_path {workdir}/uwsgi;
  scgi_temp_path {workdir}/scgi;{_meter_http(meter_socket) if meter_socket else ""}{blocks}
}}
""")
    proc = subprocess.Popen([NGINX, "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "logs/err.log")])
    for _ in range(100):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.1):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("nginx did not start")
