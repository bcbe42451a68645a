"""Cost of kvwatch's /metrics on a full node: 8 replicas x 8 GPUs, every family populated.

Measures, in one run:
  - render time of the exposition (median, p99) and its size / series count,
  - CPU seconds per scrape (render + state updates as the agent would do them),
  - resident memory after N scrapes (default 10,000) while sources keep updating the state,
and the same for a PEER measured in the same run: a conventional prometheus_client exporter holding
the same number of series in long-lived Gauge/Counter/Histogram objects rendered by
``generate_latest`` (what most Python exporters do), plus the RSS of a bare Python process that only
imported prometheus_client. kvwatch renders with its own encoder (``kvwatch/export/encode.py``).

Usage:  .venv/bin/python -m bench.agent_bench [--scrapes 10000] [--render-samples 300] [--quick]
Results are recorded in docs/performance.md ("Node agent /metrics").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench._harness import parser as bench_parser

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "tests/fixtures/engines/captured/vllm-0.13-0.14-v1-lmcache-dynamo-2026-01-2.prom"
REPLICAS = 8
GPUS = 8


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def build_state(extra_config: dict | None = None):
    """A NodeState as the agent holds it on a busy 8 x H200 node; ``extra_config``: more config keys
    (e.g. a metrics profile), read by the config's validator."""
    from kvwatch.agent.derived import update_derived
    from kvwatch.agent.gpu import refresh_gpu_state
    from kvwatch.config import config_from_mapping
    from kvwatch.engines.registry import parse_exposition
    from kvwatch.gpu.fake import FakeNvml
    from kvwatch.gpu.nvml import NvmlCollector
    from kvwatch.model import InFlightRequest, Outcome, RequestRecord
    from kvwatch.state import NodeState

    text = CAPTURE.read_text()
    config = config_from_mapping(
        {
            "replicas": [
                {
                    "name": f"replica-{i}",
                    "metrics_url": f"http://127.0.0.1:{8000 + i}/metrics",
                    "api_url": f"http://127.0.0.1:{8000 + i}",
                    "model_name": "Qwen/Qwen3-0.6B",
                    "gpus": [str(i)],
                }
                for i in range(REPLICAS)
            ],
            **(extra_config or {}),
        }
    )
    replicas = config.replicas
    state = NodeState("bench", config.length_bands)
    fake = FakeNvml(GPUS)
    collector = NvmlCollector(fake)
    collector.start()
    for g in range(GPUS):
        fake.add_process(g, 1000 + g, 100 << 30)
    state.replica_gpus = {r.name: ((str(i), fake.gpu(i).uuid, "config"),) for i, r in enumerate(replicas)}
    state.pid_replica = {1000 + i: r.name for i, r in enumerate(replicas)}

    def scrape_all(now: float) -> None:
        for rep in replicas:
            result = parse_exposition(text, rep.name, "vllm", scraped_at=now)
            target = state.target(rep.name)
            target.backend, target.up, target.samples, target.last_success_ts = (
                result.backend,
                True,
                tuple(result.samples),
                now,
            )
            state.report(f"engine:{rep.name}", True, 0.002, now=now)
        fake.add_pcie_traffic(0, 1 << 20, 1 << 20)
        refresh_gpu_state(collector, state, now)
        update_derived(state, config, now)

    bands = config.length_bands
    edges = (300, 3000, 7000, 15000, 25000)  # one output length per band
    for i in range(4000):
        rep = replicas[i % REPLICAS].name
        out = edges[i % len(edges)]
        gaps = [0] * 23
        gaps[i % 23] = out - 1
        state.requests.observe(
            RequestRecord(
                replica=rep,
                model_name="Qwen/Qwen3-0.6B",
                source="proxy",
                outcome=list(Outcome)[i % 5],
                started_at=1e9,
                prompt_tokens=1000,
                output_tokens=out,
                max_tokens=32000,
                ttft_seconds=0.05 * (i % 40),
                e2e_seconds=30.0 + i % 300,
                gap_bounds=state.requests.bounds["kvwatch_request_inter_chunk_seconds"],
                gap_counts=tuple(gaps),
                gap_sum=0.03 * out,
            )
        )
    for i in range(64):
        state.in_flight.start(
            InFlightRequest(
                replicas[i % REPLICAS].name,
                "Qwen/Qwen3-0.6B",
                bands.names[i % len(bands.names)],
                1000,
                0,
                1e9,
                16000,
            )
        )
    for kind in ("kvwatch_otlp_spans",):
        state.count(kind, "request")
    return state, config, scrape_all


def kvwatch_registry(state, config):
    from kvwatch.export.collector import NodeCollector
    from kvwatch.export.derived import DerivedCollector
    from kvwatch.export.gpus import GpuCollector
    from kvwatch.export.replicas import ReplicaCollector
    from kvwatch.export.requests import RequestCollector
    from kvwatch.export.server import make_registry

    areas = {
        "replicas": ReplicaCollector(state, config),
        "derived": DerivedCollector(state, config),
        "gpus": GpuCollector(state, config),
        "requests": RequestCollector(state, config),
    }
    return make_registry(NodeCollector(state, config, areas))


def peer_registry(series_by_kind: dict[str, int]):
    """The conventional exporter: the same number of series in long-lived metric objects."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    gauge = Gauge("peer_gauge", "g", ["i"], registry=registry)
    counter = Counter("peer_counter", "c", ["i"], registry=registry)
    hist = Histogram("peer_hist", "h", ["i"], registry=registry, buckets=[0.1 * k for k in range(1, 22)])
    for i in range(series_by_kind["gauge"]):
        gauge.labels(str(i)).set(i)
    for i in range(series_by_kind["counter"]):
        counter.labels(str(i)).inc(i)
    for i in range(series_by_kind["histogram"]):
        hist.labels(str(i)).observe(i % 3)
    return registry


def series_kinds(text: bytes) -> dict[str, int]:
    kinds: dict[str, int] = {"gauge": 0, "counter": 0, "histogram": 0}
    current = "gauge"
    for line in text.decode().splitlines():
        if line.startswith("# TYPE "):
            kind = line.split()[3]
            current = kind if kind in kinds else "gauge"
        elif line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if current == "histogram":
                if name.endswith("_count"):
                    kinds["histogram"] += 1
            elif not name.endswith("_created"):
                kinds[current] += 1
    return kinds


def time_renders(render, samples: int) -> list[float]:
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        render()
        times.append(time.perf_counter() - t0)
    return times


def bare_python_rss() -> int:
    code = (
        "import prometheus_client, pathlib;"
        "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines() "
        "if l.startswith('VmRSS')][0].split()[1])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip()) * 1024


def soak(scrapes: int) -> dict:
    """Run in a fresh process: N scrapes with the state refreshed every 5 scrapes (a 1 s engine
    interval against a 5 s Prometheus scrape would refresh more; this keeps the bench short)."""
    from kvwatch.export.encode import TextEncoder

    state, config, scrape_all = build_state()
    registry = kvwatch_registry(state, config)
    encoder = TextEncoder()
    now = time.time()
    scrape_all(now)
    encoder.encode(registry)
    gc.collect()
    rss_start = rss_bytes()
    cpu0 = time.process_time()
    rss_marks = []
    for i in range(scrapes):
        if i % 5 == 0:
            now += 5
            scrape_all(now)
        encoder.encode(registry)
        if i % max(1, scrapes // 10) == 0:
            rss_marks.append(rss_bytes())
    cpu = time.process_time() - cpu0
    gc.collect()
    return {
        "rss_start": rss_start,
        "rss_end": rss_bytes(),
        "rss_marks": rss_marks,
        "cpu_per_scrape_incl_updates": cpu / scrapes,
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--scrapes", type=int, default=10_000)
    parser.add_argument("--render-samples", type=int, default=300)
    parser.add_argument("--soak-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.scrapes, args.render_samples = 50, 5
    if args.soak_child:
        print(json.dumps(soak(args.scrapes)))
        return

    from prometheus_client import generate_latest

    from kvwatch.export.encode import TextEncoder

    state, config, scrape_all = build_state()
    scrape_all(time.time())
    registry = kvwatch_registry(state, config)
    encoder = TextEncoder()
    body = encoder.encode(registry)
    kinds = series_kinds(body)
    peer = peer_registry(kinds)
    peer_body = generate_latest(peer)

    cpu0 = time.process_time()
    ours = time_renders(lambda: encoder.encode(registry), args.render_samples)
    cpu_ours = (time.process_time() - cpu0) / args.render_samples
    cpu0 = time.process_time()
    theirs = time_renders(lambda: generate_latest(peer), args.render_samples)
    cpu_peer = (time.process_time() - cpu0) / args.render_samples

    child = subprocess.run(
        [sys.executable, "-m", "bench.agent_bench", "--soak-child", "--scrapes", str(args.scrapes)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    soaked = json.loads(child.stdout)
    bare = bare_python_rss()

    def ms(values, q):
        values = sorted(values)
        return 1000 * values[min(len(values) - 1, int(q * len(values)))]

    print(f"exposition: {len(body) / 1024:.0f} KiB, series: {kinds} (peer {len(peer_body) / 1024:.0f} KiB)")
    print(
        f"render median: kvwatch {ms(ours, 0.5):.2f} ms, peer {ms(theirs, 0.5):.2f} ms, "
        f"ratio {statistics.median(ours) / statistics.median(theirs):.2f}x"
    )
    print(f"render p99:    kvwatch {ms(ours, 0.99):.2f} ms, peer {ms(theirs, 0.99):.2f} ms")
    print(f"CPU per scrape (render only): kvwatch {cpu_ours * 1000:.2f} ms, peer {cpu_peer * 1000:.2f} ms")
    print(f"CPU per scrape incl. state updates (soak): {soaked['cpu_per_scrape_incl_updates'] * 1000:.2f} ms")
    mib = 1 / (1 << 20)
    print(
        f"RSS: bare python+prometheus_client {bare * mib:.1f} MiB; kvwatch after setup "
        f"{soaked['rss_start'] * mib:.1f} MiB, "
        f"after {args.scrapes} scrapes {soaked['rss_end'] * mib:.1f} MiB "
        f"(marks: {', '.join(f'{m * mib:.1f}' for m in soaked['rss_marks'])})"
    )
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
