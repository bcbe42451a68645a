"""Streaming-proxy benchmark: direct vs nginx vs kvwatch (and bare relays), in one run.

Every target relays the same local SSE upstream to the same client. The upstream, the client and
the proxy under test run in separate processes, so the proxy's CPU (``/proc/<pid>/stat`` utime +
stime, children included: nginx's worker) is its own. Each content chunk carries the upstream's
``perf_counter_ns`` send time (CLOCK_MONOTONIC, shared by all processes on the host) as its text, so
the client measures per-chunk latency end to end; the "added" figures subtract the direct run's.

TTFT here is the path's share of it: the client's TTFT minus the upstream's own (request received
-> first content chunk written, both stamped into the stream), so the upstream's timer jitter does not
count; "added" subtracts the direct connection's value.

Phases per target:
  steady  64 streams in flight (200 chunks, 10 ms apart, like an engine); new requests arrive one by
          one as streams finish: TTFT of those arrivals, latency of every chunk, proxy CPU.
  burst   64 requests at once (3 rounds): TTFT p99.
  flat    64 streams of 200 chunks as fast as the upstream can write: chunks per CPU-second.

Scenario ``late-tail`` (``--scenario late-tail``): the upstream writes ``[DONE]`` and then waits
0.5-2 s before its last-chunk marker (vLLM's frontend does so under load). 16 clients each send 6
requests one after the other on one keep-alive connection, the next as soon as the previous response
is complete: TTFT of the requests on reused connections, against direct and nginx.

  .venv/bin/python bench/proxy_bench.py                       # direct, nginx, kvwatch (uvloop)
  .venv/bin/python bench/proxy_bench.py --targets direct,nginx,aiohttp,aiohttp-uvloop,raw,raw-uvloop
  .venv/bin/python bench/proxy_bench.py --scenario late-tail
  .venv/bin/python bench/proxy_bench.py --scenario late-tail --baseline /tmp/base \\
      --targets direct,nginx,kvwatch-uvloop,kvwatchbase-uvloop         # this checkout against another
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _harness import percentile as _pct

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
NGINX = "/usr/sbin/nginx"

#: the role chunk's id carries the upstream's receive time of the request (perf_counter_ns)
ROLE_CHUNK = (
    b'data: {"id":"chatcmpl-%d","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)
CONTENT_CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[{"index":0,"delta":{"content":"%d"},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
FINISH_CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[{"index":0,"delta":{"content":""},"logprobs":null,'
    b'"finish_reason":"stop","stop_reason":null}]}\n\n'
)
USAGE_CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[],"usage":{"prompt_tokens":12,"total_tokens":%d,'
    b'"completion_tokens":%d}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _use_uvloop(on: bool) -> None:
    if on:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _ready(port: int) -> None:
    print(f"READY {port}", flush=True)


def _frame(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


# --------------------------------------------------------------------------------------------
# role: upstream (an OpenAI-style SSE engine, paced by flags)
# --------------------------------------------------------------------------------------------


class _Upstream(asyncio.Protocol):
    chunks = 200
    interval = 0.01
    tail: tuple[float, float] | None = None  # seconds between [DONE] and the last-chunk marker

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        """One request at a time; keep-alive unless the request says ``connection: close``."""
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1")
        m = re.search(r"(?im)^content-length:\s*(\d+)", head)
        length = int(m.group(1)) if m else 0
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4 : end + 4 + length]
        self.buf = self.buf[end + 4 + length :]
        close = re.search(r"(?im)^connection:\s*close", head) is not None
        asyncio.get_running_loop().create_task(self.stream(body, time.perf_counter_ns(), close))

    async def stream(self, body: bytes, received_ns: int, close: bool) -> None:
        t = self.transport
        assert t is not None
        usage = b'"include_usage":true' in body or b'"include_usage": true' in body
        t.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + _frame(ROLE_CHUNK % received_ns)
        )
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(self.chunks):
            if self.interval:
                delay = start + (i + 1) * self.interval - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
            if self.closed:
                return
            t.write(_frame(CONTENT_CHUNK % time.perf_counter_ns()))
        tail = _frame(FINISH_CHUNK)
        if usage:
            tail += _frame(USAGE_CHUNK % (self.chunks + 12, self.chunks))
        if self.tail is None:
            t.write(tail + _frame(DONE) + b"0\r\n\r\n")
        else:
            t.write(tail + _frame(DONE))
            await asyncio.sleep(random.uniform(*self.tail))
            if self.closed:
                return
            t.write(b"0\r\n\r\n")
        if close:
            t.close()


async def role_upstream(args: argparse.Namespace) -> None:
    _Upstream.chunks = args.chunks
    _Upstream.interval = args.interval
    if args.tail:
        low, high = (float(x) for x in args.tail.split(","))
        _Upstream.tail = (low, high)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Upstream, "127.0.0.1", args.port, backlog=1024)
    _ready(args.port)
    async with server:
        await server.serve_forever()


# --------------------------------------------------------------------------------------------
# role: bare relays (stack comparison, no accounting)
# --------------------------------------------------------------------------------------------

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


class _RawDown(asyncio.Protocol):
    """Raw protocols: request bytes forwarded once complete, response bytes forwarded untouched.

    A floor for the stack comparison, not a proxy: one upstream connection per client connection
    (the client's ``connection: close`` travels with the bytes), no parsing of the response."""

    upstream_port = 0

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
            lambda: _RawUp(self.transport), "127.0.0.1", self.upstream_port
        )
        self.up.write(request)

    def connection_lost(self, exc) -> None:
        if self.up is not None:
            self.up.close()


async def role_raw(args: argparse.Namespace) -> None:
    _RawDown.upstream_port = args.upstream_port
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_RawDown, "127.0.0.1", args.port, backlog=1024)
    _ready(args.port)
    async with server:
        await server.serve_forever()


async def role_kvwatch(args: argparse.Namespace) -> None:
    """The real proxy with full accounting: request stats, in-flight tracking and the ledger."""
    from kvwatch.config import ProxyConfig, ReplicaConfig, parse_host_port
    from kvwatch.model import DEFAULT_BANDS
    from kvwatch.requests.ledger import RequestLedger
    from kvwatch.requests.proxy import start_proxy
    from kvwatch.state import NodeState

    state = NodeState("bench", DEFAULT_BANDS)
    replica = ReplicaConfig(
        name="bench",
        metrics_url=f"http://127.0.0.1:{args.upstream_port}/metrics",
        api_url=f"http://127.0.0.1:{args.upstream_port}",
        proxy_listen=parse_host_port(f"127.0.0.1:{args.port}"),
        model_name="bench",
    )
    ledger_dir = tempfile.mkdtemp(prefix="kvwatch-bench-ledger-")
    ledger = RequestLedger(os.path.join(ledger_dir, "requests.jsonl"), DEFAULT_BANDS, counter=state.count)
    ledger.start()

    def sink(record) -> None:
        state.requests.observe(record)
        ledger.write(record)

    proxy = await start_proxy(
        replica, ProxyConfig(), frozenset({"bench"}), DEFAULT_BANDS, state.in_flight, sink, state.count
    )
    _ready(args.port)
    try:
        await asyncio.Event().wait()
    finally:
        await proxy.stop()
        ledger.stop()
        shutil.rmtree(ledger_dir, ignore_errors=True)


#: ``kvwatchbase``: the same role with kvwatch imported from ``--baseline`` (another checkout), so a
#: change is measured against the code before it in the same run, targets interleaved
ROLES = {
    "upstream": role_upstream,
    "aiohttp": role_aiohttp,
    "raw": role_raw,
    "kvwatch": role_kvwatch,
    "kvwatchbase": role_kvwatch,
}
BASELINE_ENV = "KVWATCH_BENCH_BASELINE"


# --------------------------------------------------------------------------------------------
# client (runs in the orchestrator process; its CPU is not measured)
# --------------------------------------------------------------------------------------------

_STAMP = re.compile(rb'"content":"(\d+)"')
_RECEIVED = re.compile(rb'"id":"chatcmpl-(\d+)"')


class _Client(asyncio.Protocol):
    def __init__(self, request: bytes, sent_ns: int, done: asyncio.Future, sample: _Stream) -> None:
        self.request = request
        self.sent_ns = sent_ns
        self.done = done
        self.sample = sample
        self.tail = b""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter_ns()
        data = self.tail + data
        cut = data.rfind(b"\n\n")
        self.tail = data[cut + 2 :] if cut >= 0 else data
        stamps = _STAMP.findall(data[: cut + 2]) if cut >= 0 else []
        if self.sample.upstream_received_ns is None and (m := _RECEIVED.search(data)):
            self.sample.upstream_received_ns = int(m.group(1))
        if stamps and self.sample.ttft_ns is None:
            self.sample.ttft_ns = now - self.sent_ns
            if self.sample.upstream_received_ns is not None:  # minus the upstream's own TTFT
                self.sample.ttft_ns -= int(stamps[0]) - self.sample.upstream_received_ns
        for s in stamps:
            self.sample.latencies_ns.append(now - int(s))
        self.sample.chunks += len(stamps)

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(None)


@dataclass
class _Stream:
    ttft_ns: int | None = None  # client TTFT minus the upstream's own (request in -> first chunk out)
    upstream_received_ns: int | None = None
    chunks: int = 0
    latencies_ns: list[int] = field(default_factory=list)


REQUEST_BODY = (
    b'{"model":"bench","messages":[{"role":"user","content":"benchmark prompt"}],'
    b'"stream":true,"max_tokens":256}'
)


async def one_stream(port: int) -> _Stream:
    loop = asyncio.get_running_loop()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
        % (port, len(REQUEST_BODY), REQUEST_BODY)
    )
    done = loop.create_future()
    sample = _Stream()
    sent = time.perf_counter_ns()
    transport, _ = await loop.create_connection(
        lambda: _Client(request, sent, done, sample), "127.0.0.1", port
    )
    try:
        await asyncio.wait_for(done, 120)
    finally:
        transport.close()
    return sample


def _cpu_seconds(pids: Sequence[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK


def _children(pid: int) -> list[int]:
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out += [int(p) for p in task.read_text().split()]
    return out


async def steady(port: int, streams: int, seconds: float) -> tuple[list[int], list[int], int]:
    """Keep ``streams`` in flight; requests after the first wave arrive one by one."""
    arrivals: list[int] = []
    latencies: list[int] = []
    chunks = 0
    deadline = time.monotonic() + seconds

    async def lane(first: bool) -> None:
        nonlocal chunks
        while time.monotonic() < deadline:
            s = await one_stream(port)
            if not first and s.ttft_ns is not None:
                arrivals.append(s.ttft_ns)
            first = False
            latencies.extend(s.latencies_ns)
            chunks += s.chunks

    lanes = []
    for _ in range(streams):  # stagger the first wave over one stream's lifetime
        lanes.append(asyncio.create_task(lane(True)))
        await asyncio.sleep(2.0 / streams)
    await asyncio.gather(*lanes)
    return arrivals, latencies, chunks


async def burst(port: int, streams: int, rounds: int) -> list[int]:
    ttfts: list[int] = []
    for _ in range(rounds):
        samples = await asyncio.gather(*(one_stream(port) for _ in range(streams)))
        ttfts += [s.ttft_ns for s in samples if s.ttft_ns is not None]
    return ttfts


class _KeepAliveClient(asyncio.Protocol):
    """One connection, one request at a time: the next is sent once the previous response is complete
    (its last-chunk marker read), as aiohttp, httpx and the ``openai`` SDK do."""

    def __init__(self, request: bytes, count: int, done: asyncio.Future) -> None:
        self.request = request
        self.left = count
        self.done = done
        self.samples: list[_Stream] = []
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.sent_ns = 0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        self._send()

    def _send(self) -> None:
        self.left -= 1
        self.samples.append(_Stream())
        self.sent_ns = time.perf_counter_ns()
        self.transport.write(self.request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter_ns()
        sample = self.samples[-1]
        self.buf += data
        if sample.upstream_received_ns is None and (m := _RECEIVED.search(self.buf)):
            sample.upstream_received_ns = int(m.group(1))
        if (
            sample.ttft_ns is None
            and sample.upstream_received_ns is not None
            and (stamp := _STAMP.search(self.buf))
        ):
            sample.ttft_ns = now - self.sent_ns - (int(stamp.group(1)) - sample.upstream_received_ns)
        if self.buf.endswith(b"\r\n0\r\n\r\n"):  # the response is complete
            self.buf = b""
            if self.left:
                self._send()
            elif not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_exception(RuntimeError(f"connection lost: {exc}"))


async def reused_connections(port: int, clients: int, requests: int) -> list[int]:
    """TTFT of every request after each client's first (those go on a reused connection)."""
    loop = asyncio.get_running_loop()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (port, len(REQUEST_BODY), REQUEST_BODY)
    )

    async def one_client() -> list[_Stream]:
        done = loop.create_future()
        transport, protocol = await loop.create_connection(
            lambda: _KeepAliveClient(request, requests, done), "127.0.0.1", port
        )
        try:
            await asyncio.wait_for(done, 120)
        finally:
            transport.close()
        return protocol.samples

    lanes = []
    for _ in range(clients):
        lanes.append(asyncio.create_task(one_client()))
        await asyncio.sleep(0.05)
    samples = await asyncio.gather(*lanes)
    return [s.ttft_ns for lane in samples for s in lane[1:] if s.ttft_ns is not None]


# --------------------------------------------------------------------------------------------
# orchestration
# --------------------------------------------------------------------------------------------


def _spawn(
    role: str, port: int, upstream_port: int, extra: Sequence[str] = (), uvloop: bool = False
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        __file__,
        "--role",
        role,
        "--port",
        str(port),
        "--upstream-port",
        str(upstream_port),
        *extra,
    ]
    if uvloop:
        cmd.append("--uvloop")
    tree = os.environ.get(BASELINE_ENV, "") if role == "kvwatchbase" else str(ROOT)
    if not tree:
        raise SystemExit("target kvwatchbase needs --baseline DIR (a checkout of the code to compare)")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, cwd=tree, env={**os.environ, "PYTHONPATH": tree}
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"{role} did not start: {line!r}")
    return proc


def _spawn_nginx(
    port: int, upstream_port: int, workdir: Path, workers: str = "1", more: Sequence[tuple[int, int]] = ()
) -> subprocess.Popen:
    """nginx as a streaming proxy on ``port`` -> ``upstream_port`` (and each (listen, upstream) pair
    in ``more``); ``workers`` is its ``worker_processes`` (a count, or ``auto``: one per core)."""
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
      proxy_set_header Connection "";
    }}
  }}"""
        for i, (listen, up) in enumerate(routes)
    )
    conf = workdir / "nginx.conf"
    conf.write_text(f"""
daemon off;
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
  scgi_temp_path {workdir}/scgi;{blocks}
}}
""")
    proc = subprocess.Popen([NGINX, "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "logs/err.log")])
    for _ in range(100):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.1):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("nginx did not start")


@dataclass
class Result:
    target: str
    steady_ttft_ns: list[int]
    steady_latency_ns: list[int]
    steady_chunks: int
    steady_cpu_s: float
    burst_ttft_ns: list[int]
    flat_chunks: int
    flat_cpu_s: float
    flat_wall_s: float


def _measure(target: str, port: int, pids: list[int], args) -> Result:
    """Runs the phases against ``port`` (the upstreams are the same for every target)."""

    async def run() -> Result:
        await asyncio.gather(*(one_stream(port) for _ in range(8)))  # warm-up
        c0 = _cpu_seconds(pids)
        arrivals, latencies, chunks = await steady(port, args.streams, args.seconds)
        c1 = _cpu_seconds(pids)
        burst_ttfts = await burst(port, args.streams, 3)
        return Result(target, arrivals, latencies, chunks, c1 - c0, burst_ttfts, 0, 0.0, 0.0)

    return asyncio.run(run())


def _measure_flat(port: int, pids: list[int], streams: int, rounds: int) -> tuple[int, float, float]:
    async def run() -> tuple[int, float, float]:
        await asyncio.gather(*(one_stream(port) for _ in range(4)))
        c0, w0 = _cpu_seconds(pids), time.monotonic()
        chunks = 0
        for _ in range(rounds):
            samples = await asyncio.gather(*(one_stream(port) for _ in range(streams)))
            chunks += sum(s.chunks for s in samples)
        return chunks, _cpu_seconds(pids) - c0, time.monotonic() - w0

    return asyncio.run(run())


def _start_target(name: str, up_port: int, workdir: Path) -> tuple[int, subprocess.Popen | None, list[int]]:
    if name == "direct":
        return up_port, None, []
    port = _free_port()
    if name == "nginx":
        proc = _spawn_nginx(port, up_port, workdir / f"nginx-{up_port}")
    else:
        role, _, loop = name.partition("-")
        proc = _spawn(role, port, up_port, uvloop=loop == "uvloop")
    return port, proc, _children(proc.pid)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()


def orchestrate_late_tail(args: argparse.Namespace) -> int:
    """Scenario late-tail: the upstream ends its streams 0.5-2 s after [DONE]; reused connections."""
    targets = args.targets.split(",")
    if "direct" not in targets:
        targets.insert(0, "direct")
    _use_uvloop(True)
    up_port = _free_port()
    upstream = _spawn(
        "upstream", up_port, 0, ["--chunks", "20", "--interval", "0.01", "--tail", "0.5,2.0"], uvloop=True
    )
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-bench-"))
    ttfts: dict[str, list[int]] = {name: [] for name in targets}
    try:
        for n in range(args.rounds):
            for name in targets:
                port, proc, _pids = _start_target(name, up_port, workdir)
                try:
                    ttfts[name] += asyncio.run(reused_connections(port, 16, 6))
                finally:
                    _stop(proc)
                print(f"# round {n + 1}: {name} done", file=sys.stderr, flush=True)
    finally:
        _stop(upstream)
        shutil.rmtree(workdir, ignore_errors=True)
    base = {q: _pct(ttfts["direct"], q) for q in (50, 99)}
    nginx = {q: _pct(ttfts["nginx"], q) for q in (50, 99)} if "nginx" in ttfts else None
    print("| target | requests | TTFT p50 ms | TTFT p99 ms | added p50 ms | added p99 ms | p99 vs nginx ms |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, values in ttfts.items():
        row = {
            "target": name,
            "requests": len(values),
            "ttft_p50_ms": _ms(_pct(values, 50)),
            "ttft_p99_ms": _ms(_pct(values, 99)),
            "added_ttft_p50_ms": _ms(_pct(values, 50) - base[50]),
            "added_ttft_p99_ms": _ms(_pct(values, 99) - base[99]),
            "p99_vs_nginx_ms": _ms(_pct(values, 99) - nginx[99]) if nginx else None,
        }
        rows.append(row)
        vs_nginx = "-" if row["p99_vs_nginx_ms"] is None else f"{row['p99_vs_nginx_ms']:+.3f}"
        print(
            f"| {name} | {len(values)} | {row['ttft_p50_ms']:.3f} | {row['ttft_p99_ms']:.3f} | "
            f"{row['added_ttft_p50_ms']:+.3f} | {row['added_ttft_p99_ms']:+.3f} | {vs_nginx} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(
        f"\n{args.rounds} round(s) x 16 clients x 6 sequential requests on one keep-alive connection each "
        f"(TTFT of the 5 on a reused connection); upstream: 20 chunks x 10 ms, [DONE], then 0.5-2 s before "
        f"the last-chunk marker; cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}"
    )
    return 0


def orchestrate(args: argparse.Namespace) -> int:
    targets = args.targets.split(",")
    if "direct" not in targets:
        targets.insert(0, "direct")
    if args.uvloop_client:
        _use_uvloop(True)
    paced_port, flat_port = _free_port(), _free_port()
    paced = _spawn("upstream", paced_port, 0, ["--chunks", "200", "--interval", "0.01"], uvloop=True)
    flat = _spawn("upstream", flat_port, 0, ["--chunks", "200", "--interval", "0"], uvloop=True)
    rounds: list[list[Result]] = []
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-bench-"))
    try:
        for n in range(args.rounds):  # targets interleaved, so a busy spell on the host hits all
            results: list[Result] = []
            for name in targets:
                port, proc, pids = _start_target(name, paced_port, workdir)
                try:
                    r = _measure(name, port, pids, args)
                finally:
                    _stop(proc)
                port, proc, pids = _start_target(name, flat_port, workdir)
                try:
                    r.flat_chunks, r.flat_cpu_s, r.flat_wall_s = _measure_flat(port, pids, args.streams, 2)
                finally:
                    _stop(proc)
                results.append(r)
                print(f"# round {n + 1}: {name} done", file=sys.stderr, flush=True)
            rounds.append(results)
    finally:
        _stop(paced)
        _stop(flat)
        shutil.rmtree(workdir, ignore_errors=True)
    per_round = [_rows(results) for results in rounds]
    rows = [
        {
            key: (_median([r[i][key] for r in per_round]) if key != "target" else value)
            for key, value in row.items()
        }
        for i, row in enumerate(per_round[0])
    ]
    _print(rows, args)
    return 0


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ms(ns: float) -> float:
    return ns / 1e6


def _rows(results: list[Result]) -> list[dict]:
    direct = results[0]
    base_ttft = {q: _pct(direct.steady_ttft_ns, q) for q in (50, 99)}
    base_lat = {q: _pct(direct.steady_latency_ns, q) for q in (50, 99)}
    base_burst = _pct(direct.burst_ttft_ns, 99)
    nginx = next((r for r in results if r.target == "nginx"), None)
    nginx_cpu_per_k = (1000 * nginx.steady_cpu_s / nginx.steady_chunks) if nginx else None
    nginx_flat_per_k = (1000 * nginx.flat_cpu_s / nginx.flat_chunks) if nginx else None
    nginx_burst_added = (_pct(nginx.burst_ttft_ns, 99) - base_burst) if nginx else None
    rows = []
    for r in results:
        row = {
            "target": r.target,
            "steady_arrivals": len(r.steady_ttft_ns),
            "ttft_p50_ms": _ms(_pct(r.steady_ttft_ns, 50)),
            "ttft_p99_ms": _ms(_pct(r.steady_ttft_ns, 99)),
            "added_ttft_p50_ms": _ms(_pct(r.steady_ttft_ns, 50) - base_ttft[50]),
            "added_ttft_p99_ms": _ms(_pct(r.steady_ttft_ns, 99) - base_ttft[99]),
            "added_chunk_p50_ms": _ms(_pct(r.steady_latency_ns, 50) - base_lat[50]),
            "added_chunk_p99_ms": _ms(_pct(r.steady_latency_ns, 99) - base_lat[99]),
            "burst_ttft_p99_ms": _ms(_pct(r.burst_ttft_ns, 99)),
            "added_burst_ttft_p99_ms": _ms(_pct(r.burst_ttft_ns, 99) - base_burst),
            "steady_chunks": r.steady_chunks,
            "steady_cpu_s": r.steady_cpu_s,
            "flat_chunks": r.flat_chunks,
            "flat_cpu_s": r.flat_cpu_s,
            "flat_chunks_per_s": r.flat_chunks / r.flat_wall_s if r.flat_wall_s else None,
        }
        if r.target != "direct":
            row["steady_chunks_per_cpu_s"] = r.steady_chunks / r.steady_cpu_s if r.steady_cpu_s else None
            row["flat_chunks_per_cpu_s"] = r.flat_chunks / r.flat_cpu_s if r.flat_cpu_s else None
            row["steady_cpu_ms_per_1k_chunks"] = 1000 * 1000 * r.steady_cpu_s / r.steady_chunks
            row["flat_cpu_ms_per_1k_chunks"] = 1000 * 1000 * r.flat_cpu_s / r.flat_chunks
            if nginx_cpu_per_k:
                row["steady_cpu_vs_nginx"] = (1000 * r.steady_cpu_s / r.steady_chunks) / nginx_cpu_per_k
            if nginx_flat_per_k:
                row["flat_cpu_vs_nginx"] = (1000 * r.flat_cpu_s / r.flat_chunks) / nginx_flat_per_k
            if nginx_burst_added:
                row["burst_added_vs_nginx"] = (_pct(r.burst_ttft_ns, 99) - base_burst) / nginx_burst_added
        rows.append(row)
    return rows


def _print(rows: list[dict], args: argparse.Namespace) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    cols = [
        ("target", "{}"),
        ("added_ttft_p50_ms", "{:.3f}"),
        ("added_ttft_p99_ms", "{:.3f}"),
        ("added_chunk_p50_ms", "{:.3f}"),
        ("added_chunk_p99_ms", "{:.3f}"),
        ("added_burst_ttft_p99_ms", "{:.2f}"),
        ("steady_chunks_per_cpu_s", "{:,.0f}"),
        ("flat_chunks_per_cpu_s", "{:,.0f}"),
        ("steady_cpu_ms_per_1k_chunks", "{:.1f}"),
        ("steady_cpu_vs_nginx", "{:.2f}"),
        ("flat_cpu_vs_nginx", "{:.2f}"),
        ("burst_added_vs_nginx", "{:.2f}"),
    ]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        cells = []
        for c, fmt in cols:
            v = row.get(c)
            cells.append("-" if v is None else fmt.format(v))
        print("| " + " | ".join(cells) + " |")
    direct = rows[0]
    print(
        f"\nmedians of {args.rounds} interleaved round(s); steady: {args.streams} streams x 200 chunks x "
        f"10 ms, {args.seconds:.0f} s; burst: 3 x {args.streams}; flat: 2 x {args.streams} streams x 200 "
        f"chunks unpaced; direct path TTFT p50/p99 {direct['ttft_p50_ms']:.3f}/{direct['ttft_p99_ms']:.3f} "
        f"ms; cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}"
    )


def _run_role(args: argparse.Namespace) -> int:
    """A role process runs until SIGTERM; ``KVWATCH_BENCH_PROFILE=FILE`` dumps cProfile stats."""
    import signal

    _use_uvloop(args.uvloop)
    profile_to = os.environ.get("KVWATCH_BENCH_PROFILE") if args.role != "upstream" else None
    profiler = None
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(ROLES[args.role](args))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(f"{profile_to}.{os.getpid()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--targets",
        default="direct,nginx,kvwatch-uvloop",
        help="comma list: direct, nginx, kvwatch[-uvloop], kvwatchbase[-uvloop], "
        "aiohttp[-uvloop], raw[-uvloop]",
    )
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--seconds", type=float, default=8.0, help="steady phase length per target")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians are reported")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--uvloop-client", action="store_true", default=True)
    p.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--chunks", type=int, default=200, help=argparse.SUPPRESS)
    p.add_argument("--interval", type=float, default=0.01, help=argparse.SUPPRESS)
    p.add_argument("--tail", help=argparse.SUPPRESS)
    p.add_argument(
        "--scenario",
        choices=("streaming", "late-tail"),
        default="streaming",
        help="streaming: steady, burst and flat phases; late-tail: [DONE] 0.5-2 s before the "
        "stream ends, clients reuse connections",
    )
    p.add_argument("--uvloop", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--baseline",
        help="a checkout (e.g. from git worktree or git archive) whose kvwatch the "
        "kvwatchbase[-uvloop] target runs",
    )
    args = p.parse_args(argv)
    if args.baseline:
        os.environ[BASELINE_ENV] = str(Path(args.baseline).resolve())
    if args.role:
        return _run_role(args)
    if args.scenario == "late-tail":
        return orchestrate_late_tail(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
