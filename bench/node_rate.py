"""Node-rate benchmark: how many chunks per second one node's proxy carries, ramped until it breaks.

A busy 8-GPU node runs 8 engines, each streaming one SSE event per generated token per request. Here
8 local SSE upstreams (one process, 8 listening ports: ``proxy_bench``'s upstream, which stamps each
content chunk with its ``perf_counter_ns`` send time) pace their streams like engines: ``--tokens-per-s``
per stream, ``--chunks`` per stream. The client (this process) keeps ``streams`` requests in flight per
upstream, and the step doubles ``streams`` until every proxied target has broken, through:

  direct    the upstreams themselves (the baseline the "added" figures subtract);
  nginx     one nginx, ``worker_processes auto`` (one worker per core), a server block per upstream;
  kvwatch   the agent's proxies: 8 ``start_proxy`` listeners on one event loop (uvloop), with full
            accounting (request stats, in-flight table, usage injection and removal, the ledger).
  kvwatch-Nw  with ``--workers 1,N``: the same agent with ``proxy.workers: N``, N relay worker
            processes on every port (SO_REUSEPORT), the accounting sent back to the agent's process;
            its CPU is the agent's and its workers' together.

Targets are interleaved within each step, so a busy spell on the host hits all of them. A target
breaks at a step when its added per-chunk latency p99 (client receive - upstream send, minus direct's
at the same step) passes ``--max-added-ms`` (5 ms), or a stream loses chunks, or more than 0.1% of
its chunks arrive later than ``--late-ms`` after they were sent. Reported per step and target: chunks
per second delivered, the proxy's CPU per 1,000 chunks (``/proc`` utime + stime, nginx's workers
included) and against nginx's at the same step, and the cores it used (CPU seconds / wall seconds).
The sustainable rate is the highest step a target passed.

  .venv/bin/python bench/node_rate.py                                  # 8 upstreams x 2..64 streams
  .venv/bin/python bench/node_rate.py --start 4 --max-streams 32 --step-seconds 4 --json /tmp/nr.json
  .venv/bin/python bench/node_rate.py --baseline /tmp/base   # also kvwatch from another checkout
  .venv/bin/python bench/node_rate.py --workers 1,2          # in process vs 2 relay workers
  .venv/bin/python bench/node_rate.py --quick                # one 1-second step: does it still work
  sudo .venv/bin/python bench/node_rate.py --workers 1,2 --core-quota 0.1 --max-added-ms 50 \
      --late-ms 1000 --start 4 --max-streams 41 --step-factor 1.4   # scaling on emulated cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# run as a file, like proxy_bench.py (its roles run this script again, with a --baseline checkout's
# kvwatch importable): bench/ is first on sys.path, so its helper modules import by their own names
from _harness import parser
from _harness import percentile as _pct
from proxybench.clients import _children, _cpu_seconds, one_stream
from proxybench.common import ROOT, _use_uvloop, free_port, rotated, run_until_sigterm
from proxybench.cores import CoreQuota
from proxybench.peers import _spawn_nginx
from proxybench.report import _ms
from proxybench.scenarios import _stop
from proxybench.upstreams import _Upstream

ENGINES = 8
LATE_FRACTION = 0.001


# --------------------------------------------------------------------------------------------
# roles (separate processes, so each one's CPU is its own)
# --------------------------------------------------------------------------------------------


async def role_upstreams(args: argparse.Namespace) -> None:
    """8 paced SSE engines on one loop (one listening socket each)."""
    _Upstream.chunks = args.chunks
    _Upstream.interval = 1.0 / args.tokens_per_s
    loop = asyncio.get_running_loop()
    servers = [
        await loop.create_server(_Upstream, "127.0.0.1", int(p), backlog=4096) for p in args.ports.split(",")
    ]
    print("READY", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for server in servers:
            server.close()


async def role_kvwatch(args: argparse.Namespace) -> None:
    """One proxy per upstream in one agent loop, sharing NodeState and the ledger, as the agent runs them."""
    from kvwatch.config import ProxyConfig, ReplicaConfig, parse_host_port
    from kvwatch.model import DEFAULT_BANDS
    from kvwatch.requests.ledger import RequestLedger
    from kvwatch.requests.proxy import Accounting, start_proxy
    from kvwatch.state import NodeState

    state = NodeState("bench", DEFAULT_BANDS)
    ledger_dir = tempfile.mkdtemp(prefix="kvwatch-node-rate-ledger-")
    ledger = RequestLedger(os.path.join(ledger_dir, "requests.jsonl"), DEFAULT_BANDS, counter=state.count)
    ledger.start()

    def sink(record) -> None:
        state.requests.observe(record)
        ledger.write(record)

    accounting = Accounting(DEFAULT_BANDS, state.in_flight, sink, state.count)
    proxies = []
    replicas = [
        ReplicaConfig(
            name=f"gpu{i}",
            metrics_url=f"http://127.0.0.1:{up}/metrics",
            api_url=f"http://127.0.0.1:{up}",
            proxy_listen=parse_host_port(f"127.0.0.1:{listen}"),
            model_name="bench",
        )
        for i, (listen, up) in enumerate(
            zip(args.ports.split(","), args.upstream_ports.split(","), strict=True)
        )
    ]
    workers = args.workers[0]
    if workers > 1:  # proxy.workers: relay processes on every port, accounting back to this one
        from kvwatch.requests.proxy.workers import WorkerGroup

        group = WorkerGroup(
            replicas, ProxyConfig(), frozenset({"bench"}), accounting, workers, learn_models=False
        )
        await group.start()
        proxies.append(group)
    for replica in replicas if workers <= 1 else ():
        proxies.append(
            await start_proxy(replica, ProxyConfig(), frozenset({"bench"}), accounting, learn_models=False)
        )
    print("READY", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for proxy in proxies:
            await proxy.stop()
        ledger.stop()
        shutil.rmtree(ledger_dir, ignore_errors=True)


ROLES = {"upstreams": role_upstreams, "kvwatch": role_kvwatch}


def _run_role(args: argparse.Namespace) -> int:
    _use_uvloop(True)
    run_until_sigterm(lambda: ROLES[args.role](args))
    return 0


def _spawn(role: str, *extra: str, tree: Path = ROOT) -> subprocess.Popen:
    """A role process, importing kvwatch from ``tree`` (this checkout, or ``--baseline``)."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--role", role, *extra],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"{role} did not start: {line!r}")
    return proc


# --------------------------------------------------------------------------------------------
# one step: ``streams`` in flight per upstream for ``seconds``
# --------------------------------------------------------------------------------------------


@dataclass
class Step:
    target: str
    streams: int  # in flight per upstream
    chunks: int
    expected: int  # content chunks the finished streams should have carried
    failed: int  # streams that errored or timed out
    wall_s: float
    cpu_s: float
    latencies_ns: list[int]


async def _step(
    ports: list[int], streams: int, seconds: float, chunks_per_stream: int, stream_s: float
) -> tuple[int, int, int, list[int], float]:
    latencies: list[int] = []
    chunks = expected = failed = 0
    deadline = time.monotonic() + seconds

    async def lane(port: int) -> None:
        nonlocal chunks, expected, failed
        while time.monotonic() < deadline:
            try:
                s = await one_stream(port)
            except (OSError, TimeoutError):
                failed += 1
                continue
            latencies.extend(s.latencies_ns)
            chunks += s.chunks
            expected += chunks_per_stream

    start = time.monotonic()
    lanes = []
    total = streams * len(ports)
    for i in range(total):  # spread the first wave over one stream's lifetime, as requests arrive
        lanes.append(asyncio.create_task(lane(ports[i % len(ports)])))
        await asyncio.sleep(stream_s / total)
    await asyncio.gather(*lanes)
    return chunks, expected, failed, latencies, time.monotonic() - start


def measure(target: str, ports: list[int], pids: list[int], streams: int, args: argparse.Namespace) -> Step:
    async def run() -> Step:
        c0 = _cpu_seconds(pids)
        chunks, expected, failed, latencies, wall = await _step(
            ports, streams, args.step_seconds, args.chunks, args.chunks / args.tokens_per_s
        )
        return Step(target, streams, chunks, expected, failed, wall, _cpu_seconds(pids) - c0, latencies)

    return asyncio.run(run())


def _verdict(step: Step, direct: Step, args: argparse.Namespace) -> tuple[float, bool, str]:
    added = _ms(_pct(step.latencies_ns, 99) - _pct(direct.latencies_ns, 99))
    late = sum(1 for v in step.latencies_ns if v > args.late_ms * 1e6)
    if step.failed or step.chunks < step.expected:
        return added, False, f"dropped {step.expected - step.chunks} chunks, {step.failed} streams failed"
    if late > LATE_FRACTION * max(1, step.chunks):
        return added, False, f"{late} chunks later than {args.late_ms:.0f} ms"
    if added > args.max_added_ms:
        return added, False, f"added p99 {added:.2f} ms > {args.max_added_ms:.0f} ms"
    return added, True, "ok"


def _spawn_agent(ports: list[int], up_ports: list[int], workers: int, tree: Path = ROOT) -> subprocess.Popen:
    """The kvwatch role: one proxy per upstream, ``workers`` as ``proxy.workers``, kvwatch from ``tree``."""
    listen, upstreams = (",".join(map(str, p)) for p in (ports, up_ports))
    return _spawn(
        "kvwatch", "--ports", listen, "--upstream-ports", upstreams, "--workers", str(workers), tree=tree
    )


def _kvwatch_target(workers: int) -> str:
    """``kvwatch`` in process (proxy.workers 0 or 1), ``kvwatch-2w`` with 2 relay worker processes."""
    return "kvwatch" if workers <= 1 else f"kvwatch-{workers}w"


def orchestrate(args: argparse.Namespace) -> int:
    _use_uvloop(True)
    up_ports = [free_port() for _ in range(ENGINES)]
    nginx_ports = [free_port() for _ in range(ENGINES)]
    kv_ports = [free_port() for _ in range(ENGINES)]
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-node-rate-"))
    upstreams = _spawn(
        "upstreams",
        "--ports",
        ",".join(map(str, up_ports)),
        "--chunks",
        str(args.chunks),
        "--tokens-per-s",
        str(args.tokens_per_s),
    )
    procs: list[subprocess.Popen | None] = [upstreams]
    rows = []
    cores = CoreQuota(args.core_quota) if args.core_quota else None
    try:
        nginx = _spawn_nginx(
            nginx_ports[0],
            up_ports[0],
            workdir / "nginx",
            workers="auto",
            more=list(zip(nginx_ports[1:], up_ports[1:], strict=True)),
        )
        procs.append(nginx)
        kvwatch = _spawn_agent(kv_ports, up_ports, args.workers[0])
        procs.append(kvwatch)
        time.sleep(0.5)  # nginx forks its workers
        targets = {
            "direct": (up_ports, []),
            "nginx": (nginx_ports, _children(nginx.pid)),
            _kvwatch_target(args.workers[0]): (kv_ports, _children(kvwatch.pid)),
        }
        for workers in args.workers[1:]:  # the --workers sweep: each count its own agent, same upstreams
            ports = [free_port() for _ in range(ENGINES)]
            more = _spawn_agent(ports, up_ports, workers)
            procs.append(more)
            targets[_kvwatch_target(workers)] = (ports, _children(more.pid))
        if args.baseline:  # the code before a change, interleaved with it in every step
            base_ports = [free_port() for _ in range(ENGINES)]
            base = _spawn_agent(base_ports, up_ports, 1, tree=Path(args.baseline).resolve())
            procs.append(base)
            targets["kvwatch-baseline"] = (base_ports, _children(base.pid))
        if cores is not None:  # every process of every proxied target on a capped "core" of its own
            for name, (_, pids) in targets.items():
                cores.confine(pids if name != "nginx" else pids[1:])  # nginx's master only forks
        for ports, _ in targets.values():  # warm-up: connections, pools, first-call costs
            asyncio.run(_step(ports, 1, 0.1, args.chunks, 0.2))
        alive = True
        streams = args.start
        print(
            "| streams per upstream | target | chunks/s | added chunk p99 ms | CPU ms per 1k chunks | "
            "CPU per chunk x nginx | cores used | verdict |",
            flush=True,
        )
        print("|---|---|---|---|---|---|---|---|", flush=True)
        step_index = 0
        while alive and streams <= args.max_streams:
            # each step starts one target further along (no target always right after the same
            # other one); the rows keep the targets' order
            measured = {
                name: measure(name, *targets[name], streams, args)
                for name in rotated(list(targets), step_index)
            }
            steps = {name: measured[name] for name in targets}
            step_index += 1
            alive = False
            direct, nginx_step = steps["direct"], steps.get("nginx")
            for name, step in steps.items():
                added, ok, why = _verdict(step, direct, args) if name != "direct" else (0.0, True, "baseline")
                per_k = 1e6 * step.cpu_s / step.chunks if step.chunks and name != "direct" else None
                nginx_per_k = (
                    1e6 * nginx_step.cpu_s / nginx_step.chunks if nginx_step and nginx_step.chunks else None
                )
                row = {
                    "streams_per_upstream": streams,
                    "target": name,
                    "chunks_per_s": step.chunks / step.wall_s,
                    "added_chunk_p99_ms": added if name != "direct" else None,
                    "chunk_p99_ms": _ms(_pct(step.latencies_ns, 99)),
                    "cpu_ms_per_1k_chunks": per_k,
                    "cpu_vs_nginx": per_k / nginx_per_k if per_k and nginx_per_k else None,
                    "cores_used": step.cpu_s / step.wall_s if name != "direct" else None,
                    "ok": ok,
                    "verdict": why,
                    "load": os.getloadavg()[0],
                }
                rows.append(row)
                alive = alive or (ok and name != "direct")

                def f(v: float | None, fmt: str) -> str:
                    return "-" if v is None else fmt.format(v)

                print(
                    f"| {streams} | {name} | {row['chunks_per_s']:,.0f} | "
                    f"{f(row['added_chunk_p99_ms'], '{:+.2f}')} "
                    f"| {f(per_k, '{:.1f}')} | {f(row['cpu_vs_nginx'], '{:.2f}')} | "
                    f"{f(row['cores_used'], '{:.2f}')} | {why} |",
                    flush=True,
                )
            streams = max(streams + 1, round(streams * args.step_factor))
    finally:
        if cores is not None:
            cores.release()
        for proc in procs[::-1]:
            _stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    for name in [t for t in targets if t != "direct"]:
        passed = [r for r in rows if r["target"] == name and r["ok"]]
        best = max(passed, key=lambda r: r["chunks_per_s"]) if passed else None
        said = (
            (
                f"{best['chunks_per_s']:,.0f} chunks/s ({best['streams_per_upstream']} streams per "
                f"upstream), {best['cores_used']:.2f} cores"
            )
            if best
            else "below the first step"
        )
        peak = max((r for r in rows if r["target"] == name), key=lambda r: r["chunks_per_s"], default=None)
        delivered = f"; most delivered {peak['chunks_per_s']:,.0f} chunks/s" if peak else ""
        print(f"{name}: sustainable {said}{delivered}")
    print(
        f"{ENGINES} upstreams x streams x {args.tokens_per_s:.0f} tokens/s, {args.chunks} chunks per "
        f"stream, {args.step_seconds:.0f} s per step; "
        f"cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}"
        + (f"; every proxy process capped at {args.core_quota:g} CPU" if args.core_quota else "")
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument(
        "--tokens-per-s", type=float, default=50.0, help="each stream's pace (an engine's decode rate)"
    )
    p.add_argument("--chunks", type=int, default=100, help="content chunks per stream")
    p.add_argument("--start", type=int, default=2, help="streams in flight per upstream at the first step")
    p.add_argument("--max-streams", type=int, default=64, help="the ramp stops after this step")
    p.add_argument(
        "--step-factor", type=float, default=2.0, help="streams grow by this factor from one step to the next"
    )
    p.add_argument(
        "--core-quota",
        type=float,
        help="emulated cores: run every process of the proxied targets (the agent, each relay worker, "
        "each nginx worker) in a cgroup of its own capped at this fraction of a CPU, e.g. 0.15, so "
        "the proxies saturate before the load generator does (root; proxybench/cores.py)",
    )
    p.add_argument("--step-seconds", type=float, default=4.0, help="how long each target runs per step")
    p.add_argument(
        "--max-added-ms", type=float, default=5.0, help="added per-chunk latency p99 that breaks it"
    )
    p.add_argument("--late-ms", type=float, default=100.0, help="a chunk this late after it was sent is late")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--baseline", help="another checkout whose kvwatch runs as the target kvwatch-baseline")
    p.add_argument(
        "--workers",
        default="1",
        help="proxy.workers values to sweep, comma-separated (1: in process; 2: two relay worker "
        "processes), each its own agent in the same run, e.g. 1,2",
    )
    p.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    p.add_argument("--ports", help=argparse.SUPPRESS)
    p.add_argument("--upstream-ports", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.workers = [int(w) for w in str(args.workers).split(",")]
    except ValueError:
        p.error(f"--workers: expected counts like 1,2, got {args.workers!r}")
    if args.quick and not args.role:  # one short step of every target, in process and 2 workers
        args.start = args.max_streams = 1
        args.step_seconds, args.chunks, args.tokens_per_s, args.workers = 1.0, 20, 100.0, [1, 2]
    if args.role:
        return _run_role(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
