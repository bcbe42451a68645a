"""Orchestration: start the upstream and each target, run the phases (steady, burst, flat) or the
late-tail scenario, interleaved over rounds."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _harness import percentile as _pct
from proxybench.clients import (
    _STAMP,
    _children,
    _cpu_seconds,
    burst,
    chat_request,
    crowded_share,
    one_stream,
    reused_connections,
    steady,
)
from proxybench.common import BASELINE_ENV, ROOT, SCRIPT, _use_uvloop, free_port, pair, rotated
from proxybench.peers import _spawn_nginx
from proxybench.report import Result, _median, _ms, _print, _rows

#: late-tail: two requests sent closer than this arrive together (the crowding column)
CROWDED_NS = 1_000_000


def _spawn(
    role: str, port: int, upstream_port: int, extra: Sequence[str] = (), uvloop: bool = False
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(SCRIPT),
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
    port = free_port()
    if name == "nginx":
        proc = _spawn_nginx(port, up_port, workdir / f"nginx-{up_port}")
    elif name == "nginxlua":
        return _start_nginx_meter(port, up_port, workdir / f"nginxlua-{port}")
    else:
        role, _, loop = name.partition("-")
        proc = _spawn(role, port, up_port, uvloop=loop == "uvloop")
    return port, proc, _children(proc.pid)


class _Pair:
    """nginx and the meter role it sends to, stopped together (nginx first: its last messages
    reach the meter, which then writes what it applied)."""

    def __init__(self, nginx: subprocess.Popen, meter: subprocess.Popen, socket_path: str) -> None:
        self.nginx, self.meter, self.socket_path = nginx, meter, socket_path

    def terminate(self) -> None:
        self.nginx.send_signal(signal.SIGQUIT)  # graceful: open requests end, last messages flushed
        try:
            self.nginx.wait(10)
        except subprocess.TimeoutExpired:
            self.nginx.kill()
        time.sleep(0.2)
        self.meter.terminate()

    def wait(self, timeout: float) -> None:
        self.meter.wait(timeout)

    def applied(self) -> dict:
        """What the meter applied, once stopped (its summary file)."""
        return json.loads(Path(self.socket_path + ".json").read_text())

    def kill(self) -> None:
        self.nginx.kill()
        self.meter.kill()


def _start_nginx_meter(port: int, up_port: int, workdir: Path) -> tuple[int, subprocess.Popen, list[int]]:
    """Target ``nginxlua``: nginx running nginx_meter.lua, and the meter role it reports to; the CPU
    of both counts (the meter does the agent's share, as the kvwatch role does in its process)."""
    workdir.mkdir(parents=True, exist_ok=True)
    socket_path = str(workdir / "meter.sock")
    meter = _spawn("meter", free_port(), 0, ["--socket", socket_path], uvloop=True)
    nginx = _spawn_nginx(port, up_port, workdir, meter_socket=socket_path)
    pair = _Pair(nginx, meter, socket_path)
    return port, pair, [meter.pid, *_children(nginx.pid)]  # type: ignore[return-value]


async def _raw_stream(port: int, path: str, events: int | None) -> bytes:
    """One request's response as it came: the client hangs up after ``events`` SSE events, or
    (None) reads until the connection ends (``connection: close``, or an upstream told by ``path``
    to break)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(chat_request(port, path))
    seen = b""
    while events is None or seen.count(b"\n\n") < events:
        data = await reader.read(65536)
        if not data:
            break
        seen += data
    writer.close()
    return seen


def check_meter(up_port: int, workdir: Path, streams: int, cut: int = 2) -> bool:
    """The ``nginxlua`` target's accounting against the clients': ``streams`` requests read to the
    end, ``cut`` whose client leaves after a few events and ``cut`` whose upstream breaks, then the
    meter's totals once nginx has stopped. Every request one record: completed with the content
    chunks its client counted and its tokens from the usage the module asked for (a client reading
    the raw stream sees no usage chunk), aborted, or error; each with a gap per chunk after the
    first and a TTFT within the e2e; no datagram refused, nothing left in flight."""
    port, pair, _pids = _start_nginx_meter(free_port(), up_port, workdir / "nginxlua-check")
    path = "/v1/chat/completions"

    async def run() -> tuple[list[int], bytes]:
        done = await asyncio.gather(
            *(one_stream(port) for _ in range(streams)),
            *(_raw_stream(port, path, 4) for _ in range(cut)),
            *(_raw_stream(port, path + "?break=5", None) for _ in range(cut)),
        )
        return [s.chunks for s in done[:streams]], await _raw_stream(port, path, None)

    try:
        counted, raw = asyncio.run(run())
    finally:
        _stop(pair)  # type: ignore[arg-type]
    applied = pair.applied()  # type: ignore[attr-defined]
    expected = {
        "records": streams + 1 + 2 * cut,
        "whole": streams + 1 + 2 * cut,
        "chunks": sum(counted) + len(_STAMP.findall(raw)),
        "estimated": 2 * cut,
        "usage_seen": False,
        "outcomes": {"completed": streams + 1, **({"aborted": cut, "error": cut} if cut else {})},
        "refused": 0,
        "in_flight_left": 0,
    }
    got = {key: applied.get(key) for key in expected} | {"usage_seen": b'"usage"' in raw}
    ok = got == expected
    print(f"# nginxlua accounting {'matches' if ok else 'DIFFERS from'} the clients: {got}", file=sys.stderr)
    return ok


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
    up_port = free_port()
    upstream = _spawn(
        "upstream",
        up_port,
        0,
        ["--chunk-range", args.stream_chunks, "--interval", "0.01", "--tail", "0.5,2.0"],
        uvloop=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-bench-"))
    pace = pair(args.pace, float) if args.pace else None
    ttfts: dict[str, list[int]] = {name: [] for name in targets}
    crowded: dict[str, list[float]] = {name: [] for name in targets}
    try:
        for n in range(args.rounds):
            for name in rotated(targets, n):
                port, proc, _pids = _start_target(name, up_port, workdir)
                try:
                    streams = asyncio.run(reused_connections(port, args.clients, args.requests, pace))
                    ttfts[name] += [s.ttft_ns for s in streams if s.ttft_ns is not None]
                    crowded[name].append(crowded_share([s.sent_ns for s in streams], CROWDED_NS))
                finally:
                    _stop(proc)
                print(f"# round {n + 1}: {name} done", file=sys.stderr, flush=True)
    finally:
        _stop(upstream)
        shutil.rmtree(workdir, ignore_errors=True)
    base = {q: _pct(ttfts["direct"], q) for q in (50, 99)}
    nginx = {q: _pct(ttfts["nginx"], q) for q in (50, 99)} if "nginx" in ttfts else None
    print(
        "| target | requests | sent within 1 ms of another | TTFT p50 ms | TTFT p99 ms | added p50 ms | "
        "added p99 ms | p99 vs nginx ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for name, values in ttfts.items():
        row = {
            "target": name,
            "requests": len(values),
            "crowded_share": _median(crowded[name]),
            "ttft_p50_ms": _ms(_pct(values, 50)),
            "ttft_p99_ms": _ms(_pct(values, 99)),
            "added_ttft_p50_ms": _ms(_pct(values, 50) - base[50]),
            "added_ttft_p99_ms": _ms(_pct(values, 99) - base[99]),
            "p99_vs_nginx_ms": _ms(_pct(values, 99) - nginx[99]) if nginx else None,
        }
        rows.append(row)
        vs_nginx = "-" if row["p99_vs_nginx_ms"] is None else f"{row['p99_vs_nginx_ms']:+.3f}"
        print(
            f"| {name} | {len(values)} | {row['crowded_share']:.0%} | {row['ttft_p50_ms']:.3f} | "
            f"{row['ttft_p99_ms']:.3f} | "
            f"{row['added_ttft_p50_ms']:+.3f} | {row['added_ttft_p99_ms']:+.3f} | {vs_nginx} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(
        f"\n{args.rounds} round(s) x {args.clients} clients x {args.requests} sequential requests on one "
        f"keep-alive connection each (TTFT of the {args.requests - 1} on a reused connection"
        f"{'' if pace is None else f'; one every {pace[0]:g}-{pace[1]:g} s'}); "
        f"upstream: {args.stream_chunks.replace(',', '-')} chunks x 10 ms, [DONE], then 0.5-2 s before "
        f"the last-chunk marker; cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}"
    )
    return 0


def orchestrate(args: argparse.Namespace) -> int:
    targets = args.targets.split(",")
    if "direct" not in targets:
        targets.insert(0, "direct")
    if args.uvloop_client:
        _use_uvloop(True)
    paced_port, flat_port = free_port(), free_port()
    chunks = str(args.chunks)
    paced = _spawn("upstream", paced_port, 0, ["--chunks", chunks, "--interval", "0.01"], uvloop=True)
    flat = _spawn("upstream", flat_port, 0, ["--chunks", chunks, "--interval", "0"], uvloop=True)
    rounds: list[list[Result]] = []
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-bench-"))
    try:
        if "nginxlua" in targets and not check_meter(paced_port, workdir, args.streams):
            return 1
        for n in range(args.rounds):  # targets interleaved, so a busy spell on the host hits all
            by_target: dict[str, Result] = {}
            for name in rotated(targets, n):
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
                by_target[name] = r
                print(f"# round {n + 1}: {name} done", file=sys.stderr, flush=True)
            rounds.append([by_target[name] for name in targets])  # direct first, as _rows reads them
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
