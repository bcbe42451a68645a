"""OTLP exports an outsider sends vs the agent's event loop: loop lag and /metrics latency.

Runs a real ``Agent`` (OTLP receiver on, heap frozen after start-up as ``kvwatch run`` does) in this
process with a ticker on its loop, and a separate sender process that, phase by phase, POSTs to
the receiver and polls ``/metrics`` every 20 ms, timing each answer. Phases, same run:

- ``idle``: nothing sent (the peer every other phase is compared with);
- ``55k spans``: exports of 55,000 request spans, 15.5 MB of protobuf each (what the issue
  measured stalling the loop 1.1 s): vLLM ``llm_request`` spans with the attributes kvwatch reads;
- ``gzip bomb``: 4 MB of gzip that inflates to 4 GiB (refused at ``otlp.max_decompressed_bytes``).

Per phase: the worst tick by CPU this process spent while it waited (the stall the agent causes
itself; on a shared machine the wall-clock lateness is mostly the scheduler's) and by wall clock,
and the /metrics latency p50/p99/max, each also as a ratio to the idle phase.

  .venv/bin/python -m bench.otlp_loop_lag [--exports 3] [--seconds 4] [--quick]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import textwrap
import time
import zlib
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench._harness import parser as bench_parser
from kvwatch.agent import Agent
from kvwatch.agent.heap import freeze_start_up_heap
from kvwatch.config import Config, HostPort, NvmlConfig, OtlpConfig, ReplicaConfig
from kvwatch.gpu.fake import FakeNvml

ROOT = Path(__file__).resolve().parents[1]
REAL_EXPORT = ROOT / "tests" / "requests" / "fixtures" / "vllm-0.32-otlp-llm-request-spans.bin"
KEPT = (
    "gen_ai.latency.time_to_first_token",
    "gen_ai.latency.e2e",
    "gen_ai.latency.time_in_queue",
    "gen_ai.usage.prompt_tokens",
    "gen_ai.usage.completion_tokens",
    "gen_ai.request.max_tokens",
)

SENDER = textwrap.dedent("""
    import json, sys, threading, time, urllib.request
    metrics_url, otlp_url, phases = sys.argv[1], sys.argv[2], json.loads(sys.stdin.readline())
    out = {}
    for name, seconds, body, encoding, repeat in phases:
        body = bytes.fromhex(body) if body else None
        latencies, stop = [], threading.Event()
        def poll():
            while not stop.is_set():
                started = time.perf_counter()
                with urllib.request.urlopen(metrics_url, timeout=30) as r:
                    r.read()
                latencies.append(time.perf_counter() - started)
                time.sleep(0.02)
        poller = threading.Thread(target=poll)
        print(json.dumps({"phase": name}), flush=True)
        sys.stdin.readline()  # the bench has marked the phase start
        poller.start()
        statuses, until = [], time.monotonic() + seconds
        for _ in range(repeat):
            request = urllib.request.Request(otlp_url, data=body, headers={
                "Content-Type": "application/x-protobuf", "Content-Encoding": encoding})
            try:
                with urllib.request.urlopen(request, timeout=120) as r:
                    statuses.append(r.status)
            except urllib.error.HTTPError as exc:
                statuses.append(exc.code)
        while time.monotonic() < until:
            time.sleep(0.05)
        stop.set()
        poller.join()
        out[name] = {"metrics_s": latencies, "statuses": statuses}
        print(json.dumps({"end": name}), flush=True)
    print(json.dumps({"done": out}), flush=True)
""")


def spans_export(spans: int) -> bytes:
    """``spans`` copies of a real vLLM 0.32 ``llm_request`` span, trimmed to what kvwatch reads."""
    real = ExportTraceServiceRequest()
    real.ParseFromString(REAL_EXPORT.read_bytes())
    span = real.resource_spans[0].scope_spans[0].spans[0]
    kept = [kv for kv in span.attributes if kv.key in KEPT]
    del span.attributes[:]
    span.attributes.extend(kept)
    scope = real.resource_spans[0].scope_spans[0]
    del scope.spans[:]
    scope.spans.extend([span] * spans)
    return real.SerializeToString()


def gzip_bomb(compressed_bytes: int) -> bytes:
    """Fully flushed 1 MiB blocks of zeros compress to the same bytes: 4 MB of them is 4 GiB."""
    zeros = bytes(1 << 20)
    deflater = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    head = deflater.compress(zeros) + deflater.flush(zlib.Z_FULL_FLUSH)
    block = deflater.compress(zeros) + deflater.flush(zlib.Z_FULL_FLUSH)
    return head + block * (compressed_bytes // len(block)) + deflater.flush()


async def _ticker(ticks: list[tuple[float, float]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.sleep(0.005)
        ticks.append((time.process_time() - cpu, time.perf_counter() - started - 0.005))


async def _line(stream: asyncio.StreamReader) -> dict:
    return json.loads(await stream.readline())


async def run(exports: int, seconds: float, spans: int, bomb_bytes: int) -> dict[str, dict]:
    replica = ReplicaConfig("r0", "http://127.0.0.1:9/metrics", model_name="tiny")  # never up: no scrape cost
    config = Config(
        replicas=(replica,),
        listen=HostPort("127.0.0.1", 0),
        nvml=NvmlConfig(fake_gpus=0),
        otlp=OtlpConfig(listen=HostPort("127.0.0.1", 0), replica="r0"),
    )
    body = spans_export(spans)
    print(
        f"{spans:,}-span export: {len(body) / 1e6:.1f} MB; gzip bomb: {bomb_bytes / 1e6:.1f} MB -> "
        f"{bomb_bytes / 4e6:.1f} GiB",
        file=sys.stderr,
    )
    phases = [
        ("idle", seconds, "", "identity", 0),
        (f"{spans // 1000}k spans", seconds, body.hex(), "identity", exports),
        ("gzip bomb", seconds, gzip_bomb(bomb_bytes).hex(), "gzip", exports),
    ]
    agent = Agent(config, nvml=FakeNvml(1))
    await agent.start()
    freeze_start_up_heap()
    sender = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SENDER,
        f"http://127.0.0.1:{agent.port}/metrics",
        f"http://127.0.0.1:{agent.otlp_port}/v1/traces",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        limit=1 << 26,
    )
    assert sender.stdin is not None and sender.stdout is not None
    sender.stdin.write(json.dumps(phases).encode() + b"\n")
    ticks: dict[str, list[tuple[float, float]]] = {}
    try:
        for _ in phases:
            name = (await _line(sender.stdout))["phase"]
            ticks[name], stop = [], asyncio.Event()
            ticker = asyncio.create_task(_ticker(ticks[name], stop))
            sender.stdin.write(b"go\n")
            assert (await _line(sender.stdout))["end"] == name
            stop.set()
            await ticker
        done = await _line(sender.stdout)
    finally:
        await sender.wait()
        await agent.stop()
    results = {}
    for name, answered in done["done"].items():
        cpu = max(c for c, _ in ticks[name])
        late = max(w for _, w in ticks[name])
        metrics = sorted(answered["metrics_s"])
        results[name] = {
            "worst_tick_cpu_ms": cpu * 1000,
            "worst_tick_late_ms": late * 1000,
            "metrics_p50_ms": statistics.median(metrics) * 1000,
            "metrics_p99_ms": metrics[int(0.99 * (len(metrics) - 1))] * 1000,
            "metrics_max_ms": metrics[-1] * 1000,
            "statuses": answered["statuses"],
            "ticks": len(ticks[name]),
        }
    return results


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--exports", type=int, default=3, help="exports sent per phase (default 3)")
    parser.add_argument("--seconds", type=float, default=4.0, help="minimum seconds per phase (default 4)")
    args = parser.parse_args()
    spans, bomb = (2_000, 400_000) if args.quick else (55_000, 4_000_000)
    if args.quick:
        args.exports, args.seconds = 1, 0.5
    results = asyncio.run(run(args.exports, args.seconds, spans, bomb))
    idle = results["idle"]
    print(
        f"{'phase':<10} {'tick CPU ms':>12} {'x idle':>7} {'tick late ms':>13} {'/metrics p50':>13} "
        f"{'p99':>7} {'max':>7} {'x idle(max)':>11}  answers"
    )
    for name, r in results.items():
        cpu_ratio = r["worst_tick_cpu_ms"] / idle["worst_tick_cpu_ms"]
        print(
            f"{name:<10} {r['worst_tick_cpu_ms']:>12.1f} {cpu_ratio:>7.1f} "
            f"{r['worst_tick_late_ms']:>13.0f} {r['metrics_p50_ms']:>13.1f} {r['metrics_p99_ms']:>7.1f} "
            f"{r['metrics_max_ms']:>7.1f} {r['metrics_max_ms'] / idle['metrics_max_ms']:>11.1f}  "
            f"{r['statuses']}"
        )


if __name__ == "__main__":
    main()
