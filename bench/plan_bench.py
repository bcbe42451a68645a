"""``kvwatch plan`` cost: one big replay on one core, and a 24-candidate sweep on two.

    flock /tmp/kvwatch-engine.lock .venv/bin/python -m bench.plan_bench            # both (~2-4 min)
    flock /tmp/kvwatch-engine.lock .venv/bin/python -m bench.plan_bench --quick    # 10x smaller

1. replay: the demo's reasoning workload (1 request/s, 1.5x bursts, Qwen3-32B, 100,000 requests)
   on 8 DP replicas of 8x H200 through ``plan.replay.replay`` (the twin, its KV sampling and the
   per-band summary) against the peer in the same run: the bare simulator, ``sim.node.run_headless``
   on the same requests and engines, with no sampling and no summary. Target: < 60 s on one core.
2. sweep: 24 hardware candidates (H100/H200/B200 x TP x DP of up to 8 GPUs, bf16 and fp8 KV; those
   that cannot run are replaced by the next) over a 10,000-request ledger-sized workload, in 2
   processes (``plan.compare.evaluate_all``), against the same 24 in one process. Target: < 5 min.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from kvwatch.mixin.slo import load_slo_file
from kvwatch.model import DEFAULT_BANDS
from kvwatch.plan.candidate import Candidate, CandidateError, engine_config
from kvwatch.plan.compare import evaluate_all, hardware_grid
from kvwatch.plan.inputs import Workload
from kvwatch.plan.replay import replay
from kvwatch.sim.engine import SimEngine
from kvwatch.sim.node import run_headless
from kvwatch.sim.presets import demo_workload
from kvwatch.sim.routing import RouterSpec
from kvwatch.sim.workload import generate


def workload(count: int) -> Workload:
    reqs = tuple(generate(demo_workload(seed=0, hours=48), count=count))
    return Workload("synthetic", ("demo reasoning workload",), reqs, {}, None)


def bench_replay(count: int) -> None:
    w = workload(count)
    c = Candidate(name="demo node")
    t0, c0 = time.perf_counter(), time.process_time()
    engines = [SimEngine(engine_config(c), name=str(i), keep_finished=0) for i in range(c.dp)]
    run_headless(engines, w.requests, RouterSpec("least_loaded"))
    peer_wall, peer_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    result = replay(w, c, None, bands=DEFAULT_BANDS)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = result.node
    print(
        f"replay {count:,} requests on {c.dp} replicas: {wall:.1f} s wall, {cpu:.1f} s CPU "
        f"({n.sim_seconds:,.0f} simulated s, {n.samples:,} KV samples, {n.preemptions:,} preemptions)"
    )
    print(
        f"  peer (bare run_headless, same requests): {peer_wall:.1f} s wall, {peer_cpu:.1f} s CPU; "
        f"plan's own overhead x{cpu / peer_cpu:.2f}"
    )


def bench_sweep(count: int, candidates: int) -> None:
    w = workload(count)
    grid = []
    for c in hardware_grid(8, "qwen3-32b"):
        try:
            engine_config(c)
        except CandidateError:
            continue
        grid.append(c)
        if len(grid) == candidates:
            break
    t0 = time.perf_counter()
    slo = load_slo_file(Path(__file__).resolve().parents[1] / "alerts" / "slo.yaml")
    two = evaluate_all(grid, w, slo.objectives, slo.bands, None, jobs=2)
    wall2 = time.perf_counter() - t0
    t0 = time.perf_counter()
    evaluate_all(grid[:4], w, slo.objectives, slo.bands, None, jobs=1)
    wall1_4 = time.perf_counter() - t0
    print(
        f"sweep {len(grid)} candidates x {count:,} requests in 2 processes: {wall2:.1f} s wall "
        f"({sum(e.wall_seconds for e in two):.1f} s of replays; {os.cpu_count()} CPUs here)"
    )
    print(
        f"  peer: the first 4 candidates in one process {wall1_4:.1f} s -> "
        f"{wall1_4 / 4 * len(grid):.0f} s projected for {len(grid)} serially"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    scale = 10 if args.quick else 1
    bench_replay(100_000 // scale)
    bench_sweep(10_000 // scale, 24)


if __name__ == "__main__":
    main()
