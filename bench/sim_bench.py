"""Simulator cost: per decode step, per request, headless throughput and HTTP speed factor.

    .venv/bin/python -m bench.sim_bench            # everything (~1-2 minutes on a quiet core)
    .venv/bin/python -m bench.sim_bench --quick    # smaller runs

Reports, each against a peer measured in the same run:

1. step cost of the engine's decode loop (O(1) per step: tokens = base + step index) against the
   naive peer that touches every running sequence per step (one Python loop iteration each);
2. headless: the demo workload (8x H200, Qwen3-32B DP=8, skewed router) until 100,000 requests
   have arrived; wall time, cost per step and per request, simulated seconds per wall second;
3. HTTP: the demo node's 8 servers plus the HTTP load generator in this one process (one core) at
   several speeds for a fixed wall time; achieved speed, CPU share, requests and SSE bytes per second.
   The max speed factor is the highest tested speed the node sustains (achieved >= 95% of it).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from kvwatch.sim.engine import EngineConfig, SimEngine
from kvwatch.sim.loadgen import LoadGenConfig, LoadGenerator
from kvwatch.sim.models import model_preset
from kvwatch.sim.node import SimNode
from kvwatch.sim.presets import demo_node, demo_router, demo_workload
from kvwatch.sim.workload import generate

# ---------------------------------------------------------------------------------- 1. step cost


class _NaiveSeq:
    __slots__ = ("target", "tokens")

    def __init__(self, tokens: int, target: int) -> None:
        self.tokens = tokens
        self.target = target


def naive_decode_step(seqs: list[_NaiveSeq], block_size: int) -> int:
    """The peer: one Python iteration per running sequence (grow, block edge, finish check)."""
    new_blocks = 0
    for s in seqs:
        if s.tokens % block_size == 0:
            new_blocks += 1
        s.tokens += 1
        if s.tokens >= s.target:
            s.tokens = 1000  # keep the batch steady
    return new_blocks


def step_cost(batch: int, steps: int) -> tuple[float, float]:
    """Microseconds per decode step: (engine, naive peer) with ``batch`` running sequences."""
    # a cache large enough that the batch never preempts: this measures the decode loop alone
    cfg = EngineConfig(
        model=model_preset("qwen3-32b"),
        max_num_seqs=max(batch, 256),
        max_num_batched_tokens=max(8192, batch),
        max_model_len=40960,
        num_gpu_blocks_override=batch * (1000 + steps + 64) // 16 + 4096,
    )
    e = SimEngine(cfg)
    for i in range(batch):
        e.submit(str(i), 1000, 30000, 30000)
    for _ in range(10_000):
        if e.num_running == batch and not e.last_step.prefill_tokens:
            break
        e.step()
    assert e.num_running == batch and not e.preemptions_total
    t0 = time.perf_counter()
    for _ in range(steps):
        e.step()
    engine_us = (time.perf_counter() - t0) / steps * 1e6
    seqs = [_NaiveSeq(1000 + i, 30000) for i in range(batch)]
    t0 = time.perf_counter()
    for _ in range(steps):
        naive_decode_step(seqs, 16)
    naive_us = (time.perf_counter() - t0) / steps * 1e6
    return engine_us, naive_us


# ---------------------------------------------------------------------------------- 2. headless


def headless(requests: int) -> dict:
    node = SimNode(demo_node())
    spec = demo_workload(seed=1, hours=1000)
    cpu0, t0 = time.process_time(), time.perf_counter()
    report = node.run_headless(generate(spec, count=requests), demo_router(), until=None)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return {
        "requests": requests,
        "wall_s": wall,
        "cpu_s": cpu,
        "steps": report.steps,
        "sim_s": report.sim_seconds,
        "us_per_step": cpu / report.steps * 1e6,
        "us_per_request": cpu / requests * 1e6,
        "sim_s_per_wall_s": report.sim_seconds / wall,
        "preemptions": report.preemptions,
        "outcomes": (report.completed, report.truncated, report.aborted),
    }


# ---------------------------------------------------------------------------------- 3. HTTP


async def http_run(speed: float, wall_s: float, warmup_sim_s: float = 300.0) -> dict:
    """Warm up for ``warmup_sim_s`` simulated seconds (streams build up), then measure ``wall_s``."""
    node = SimNode(demo_node(speed=speed))  # default 20 ms tick: one SSE chunk per stream per tick
    await node.start()
    loop = asyncio.get_running_loop()
    gen = LoadGenerator(
        node.replica_urls,
        model=node.config.model_name,
        router=demo_router(),
        config=LoadGenConfig(speed=speed),
    )
    horizon = warmup_sim_s + 2 * wall_s * speed  # the workload outlasts the measurement
    task = asyncio.create_task(gen.run(generate(demo_workload(seed=2), duration=horizon), drain=False))
    await asyncio.sleep(warmup_sim_s / speed)
    sent0, sim0, cpu0, t0 = gen.report.sent, node.sim_time, time.process_time(), loop.time()
    tokens0 = sum(e.stats.generation_tokens for e in node.engines)
    await asyncio.sleep(wall_s)
    wall = loop.time() - t0
    cpu = time.process_time() - cpu0
    achieved = (node.sim_time - sim0) / wall
    sent = gen.report.sent - sent0
    tokens = sum(e.stats.generation_tokens for e in node.engines) - tokens0
    streams = sum(gen.in_flight)
    errors = gen.report.outcomes["error"]
    task.cancel()
    await gen.close()
    await node.stop()
    return {
        "speed": speed,
        "achieved": achieved,
        "cpu_share": cpu / wall,
        "requests_per_s": sent / wall,
        "open_streams": streams,
        "tokens_per_s": tokens / wall,
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs")
    args = parser.parse_args()

    print("1. decode step cost (us/step), engine vs naive per-sequence peer")
    for batch in (64, 256, 1024):
        engine_us, naive_us = step_cost(batch, 2000 if args.quick else 20000)
        print(
            f"   batch {batch:5d}: engine {engine_us:6.2f} us   naive {naive_us:8.2f} us   "
            f"ratio {naive_us / engine_us:6.1f}x"
        )

    n = 2_000 if args.quick else 100_000
    print(f"2. headless demo workload, {n} requests, 8 replicas")
    h = headless(n)
    print(f"   wall {h['wall_s']:.1f} s (cpu {h['cpu_s']:.1f} s), {h['steps']} steps, {h['sim_s']:.0f} sim s")
    print(
        f"   {h['us_per_step']:.2f} us/step (all costs included), {h['us_per_request']:.0f} us/request, "
        f"{h['sim_s_per_wall_s']:.0f} sim s per wall s, preemptions {h['preemptions']}, "
        f"completed/truncated/aborted {h['outcomes']}"
    )

    print("3. HTTP: 8 servers + load generator in one process (one core)")
    speeds = (50,) if args.quick else (10, 50, 100, 200, 400)
    best = 0.0
    for speed in speeds:
        r = asyncio.run(http_run(speed, wall_s=3 if args.quick else 10))
        ok = r["achieved"] >= 0.95 * speed
        best = speed if ok else best
        print(
            f"   speed {speed:5.0f}x: achieved {r['achieved']:6.1f}x  cpu {r['cpu_share']:4.2f} core  "
            f"{r['requests_per_s']:6.1f} req/s  {r['open_streams']:4d} streams  "
            f"{r['tokens_per_s']:8.0f} tok/s  errors {r['errors']}  {'ok' if ok else 'LAGS'}"
        )
    print(f"   max sustained speed factor (tested): {best:.0f}x")


if __name__ == "__main__":
    main()
