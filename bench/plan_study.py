"""Does the twin reproduce the founding study's findings? (docs/planning.md, one row per finding)

    flock /tmp/kvwatch-heavy.lock .venv/bin/python -m bench.plan_study [--quick]

8x H200 presets, uncalibrated datasheet roofline with the collective, pipeline and expert terms of
``kvwatch/sim/parallel.py`` at their documented defaults (no constant is tuned to a row). The load
is the study's kind: the reasoning workload (prompts lognormal mean 1,000; outputs exponential mean
6,300, 45 % above 5k), no client patience, every request arriving in the first ``count / rate``
seconds, so the node is saturated and completed requests per GPU-hour measure its capacity.

1. Llama-3.1-8B: DP=8 against TP=8 (and the splits between) per GPU-hour.
2. The DP/TP crossover by model size: for 8B, Qwen3-32B and Llama-3.1-70B, completed per GPU-hour
   of each TP x DP split, and which TP wins.
3. Llama-3.1-405B: TP=8 against PP=8 (and TP=2 x PP=4, TP=4 x PP=2): time to finish the batch.
4. DeepSeek-R1: TP=8, TP=8 with EP, PP=8, TP=2 x PP=4, TP=4 x PP=2 (with and without EP).
"""

from __future__ import annotations

import argparse
import time

from kvwatch.model import DEFAULT_BANDS
from kvwatch.plan.candidate import Candidate, CandidateError
from kvwatch.plan.inputs import Workload
from kvwatch.plan.replay import ReplayResult, replay
from kvwatch.report.summary import ALL
from kvwatch.sim.workload import Patience, WorkloadSpec, generate

SATURATING_RATE = 50.0  # requests per second: the whole batch arrives within a minute or so


def _workload(count: int, seed: int = 16) -> Workload:
    spec = WorkloadSpec.profile(
        "reasoning", rate=SATURATING_RATE, patience=Patience(first_token_s=None), seed=seed
    )
    return Workload("synthetic", (f"reasoning x{count}",), tuple(generate(spec, count=count)), {}, None)


def _run(w: Workload, c: Candidate) -> ReplayResult | str:
    try:
        return replay(w, c, None, bands=DEFAULT_BANDS)
    except CandidateError as exc:
        return "cannot run: " + str(exc).split(": ", 1)[-1].split(";")[0]


def _row(finding: str, c: Candidate, r: ReplayResult | str) -> None:
    if isinstance(r, str):
        print(f"| {finding} | {c.model} | {c.layout()} | {r} | | | | |", flush=True)
        return
    total = next(x for x in r.report.rows_for(ALL) if x.length_band == ALL)
    n = r.node
    print(
        f"| {finding} | {c.model} | {c.layout()} | {n.completed_per_gpu_hour:,.1f} | "
        f"{n.sim_seconds:,.0f} s | "
        f"{total.e2e_p50_seconds:,.0f} s | {n.preemptions:,} | {n.capacity_tokens_per_replica:,} |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    args = parser.parse_args()
    scale = 4 if args.quick else 1
    started = time.perf_counter()
    print(
        "| finding | model | layout | completed/GPU-h | batch done in | e2e p50 | preemptions "
        "| KV tokens/replica |"
    )
    print("|---|---|---|---|---|---|---|---|")
    dense_splits = ((1, 8), (2, 4), (4, 2), (8, 1))
    for finding, model, count in (
        ("1, 2", "llama-3.1-8b", 4000),
        ("2", "qwen3-32b", 2000),
        ("2", "llama-3.1-70b", 1000),
    ):
        w = _workload(count // scale)
        for tp, dp in dense_splits:
            c = Candidate(name=f"{model}-tp{tp}", model=model, tp=tp, dp=dp)
            _row(finding, c, _run(w, c))
    w = _workload(400 // scale)
    for tp, pp in ((8, 1), (4, 2), (2, 4), (1, 8)):
        c = Candidate(name=f"405b-tp{tp}-pp{pp}", model="llama-3.1-405b", tp=tp, pp=pp, dp=1)
        _row("3", c, _run(w, c))
    w = _workload(1000 // scale)
    for tp, pp, ep in ((8, 1, False), (8, 1, True), (4, 2, False), (4, 2, True), (2, 4, True), (1, 8, False)):
        c = Candidate(name=f"r1-tp{tp}-pp{pp}", model="deepseek-r1", tp=tp, pp=pp, dp=1, expert_parallel=ep)
        _row("4", c, _run(w, c))
    print(f"\n{time.perf_counter() - started:.0f} s wall")


if __name__ == "__main__":
    main()
