"""What would make DP beat TP per GPU-hour in the twin? A first-order break-even, not a fit.

    flock /tmp/kvwatch-heavy.lock .venv/bin/python -m bench.plan_study_hostcost [--quick]

The study's load (``plan_study.py``: the reasoning batch at 50 requests/s, saturating) on 8x H200
for Llama-3.1-8B, Qwen3-32B and Llama-3.1-70B, at DP=8 (70B: TP=2 x DP=4, its smallest TP that
fits) and TP=8, timed by the documented roofline. The twin charges a flat 1.5 ms per step whatever
the batch; a real engine also pays host work per sequence per step (scheduling, sampling, output
processing) on its one scheduler process, which DP runs on 8 processes at once. If that cost is
``h`` seconds per sequence per step, each replica's busy time grows by about ``h x`` its generated
tokens (a decoding sequence gains one token per step), so

    capacity(layout, h) = completed / (GPUs x max over replicas (busy + h x generated tokens))

and the break-even ``h*`` is where DP's capacity equals TP=8's. It ignores the feedback of slower
steps on preemption, so it is an estimate of where the crossover lies, not a reproduction.
"""

from __future__ import annotations

import argparse

from kvwatch.plan.candidate import Candidate, engine_config
from kvwatch.sim.engine import SimEngine
from kvwatch.sim.node import run_headless
from kvwatch.sim.routing import RouterSpec
from kvwatch.sim.workload import Patience, WorkloadSpec, generate

RATE = 50.0


def _capacity(model: str, tp: int, dp: int, count: int) -> tuple[int, list[tuple[float, float]]]:
    spec = WorkloadSpec.profile("reasoning", rate=RATE, patience=Patience(first_token_s=None), seed=16)
    engines = [
        SimEngine(engine_config(Candidate(model=model, tp=tp, dp=dp)), name=str(i), keep_finished=0)
        for i in range(dp)
    ]
    report = run_headless(engines, list(generate(spec, count=count)), RouterSpec("least_loaded"))
    return report.completed, [(e.stats.busy_seconds, float(e.stats.generation_tokens)) for e in engines]


def _per_gpu_hour(completed: int, replicas: list[tuple[float, float]], h: float) -> float:
    return completed / (8 * max(busy + h * tokens for busy, tokens in replicas) / 3600.0)


def full_cache_decode(model: str, mean_tokens: float = 3650.0) -> None:
    """Tokens per GPU-second of a decode step whose cache is full (sequences of ``mean_tokens``
    each), DP=8 against TP=8, from the roofline's own constants: why the twin rates them alike."""
    for tp in (1, 8):
        config = engine_config(Candidate(model=model, tp=tp, dp=8 // tp))
        layout = config.step_model()
        tokens = config.num_gpu_blocks * config.block_size
        seqs = tokens / mean_tokens
        step = (
            config.step_overhead_s
            + layout.t_dense_weights
            + tokens * layout.t_kv_per_token
            + layout.comm_fixed
            + seqs * layout.comm_per_token
        )
        print(
            f"{model} TP={tp}: full-cache decode step {step * 1e3:.1f} ms for {seqs:,.0f} sequences, "
            f"{seqs / step / tp:,.0f} tokens per GPU-second"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    args = parser.parse_args()
    scale = 4 if args.quick else 1
    full_cache_decode("llama-3.1-8b")
    print(
        "| model | DP layout | DP completed/GPU-h (h=0) | TP=8 completed/GPU-h (h=0) "
        "| h* (us per seq per step) |"
    )
    print("|---|---|---|---|---|")
    models = (("llama-3.1-8b", 4000, 1), ("qwen3-32b", 2000, 1), ("llama-3.1-70b", 1000, 2))
    for model, count, dp_tp in models:
        dp_done, dp_reps = _capacity(model, dp_tp, 8 // dp_tp, count // scale)
        tp_done, tp_reps = _capacity(model, 8, 1, count // scale)
        lo, hi = 0.0, 1e-3
        if _per_gpu_hour(dp_done, dp_reps, hi) < _per_gpu_hour(tp_done, tp_reps, hi):
            star = "none below 1 ms"
        elif _per_gpu_hour(dp_done, dp_reps, 0.0) >= _per_gpu_hour(tp_done, tp_reps, 0.0):
            star = "0 (DP already wins)"
        else:
            for _ in range(60):  # bisection: DP - TP is increasing in h
                mid = (lo + hi) / 2
                if _per_gpu_hour(dp_done, dp_reps, mid) < _per_gpu_hour(tp_done, tp_reps, mid):
                    lo = mid
                else:
                    hi = mid
            star = f"{hi * 1e6:,.1f}"
        print(
            f"| {model} | TP={dp_tp} x DP={8 // dp_tp} | {_per_gpu_hour(dp_done, dp_reps, 0.0):,.1f} | "
            f"{_per_gpu_hour(tp_done, tp_reps, 0.0):,.1f} | {star} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
