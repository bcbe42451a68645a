"""Does the twin reproduce the founding study's qualitative results? (docs/planning.md)

    flock /tmp/kvwatch-engine.lock .venv/bin/python bench/plan_study.py [--quick]

On 8x H200 (simulator presets, uncalibrated datasheet roofline), the reasoning workload (outputs
exponential with mean 6,300 tokens, 45 % above 5k; prompts lognormal mean 1,000), one fixed
trace per model at a rate that loads the node, every TP x DP split of the 8 GPUs:

* Qwen3-32B: does TP=2 x DP=4 beat DP=8 on end-to-end time?
* Llama-3.1-8B: is DP=8 best?
* Llama-3.1-405B: does it need high TP?

Prints e2e p50 / p99 (all bands, and the 10k+ bands), preemptions, KV capacity per replica and
completed requests per GPU-hour for each split; a split that cannot run says why.
"""

from __future__ import annotations

import argparse

from kvwatch.model import DEFAULT_BANDS
from kvwatch.plan.candidate import Candidate, CandidateError
from kvwatch.plan.inputs import Workload
from kvwatch.plan.replay import replay
from kvwatch.report.summary import ALL
from kvwatch.sim.workload import Patience, WorkloadSpec, generate

CASES = (  # model, requests per second, requests
    ("qwen3-32b", 1.5, 3000),
    ("llama-3.1-8b", 4.0, 6000),
    ("llama-3.1-405b", 0.3, 600),
)
SPLITS = ((1, 8), (2, 4), (4, 2), (8, 1))


def _workload(rate: float, count: int) -> Workload:
    spec = WorkloadSpec.profile("reasoning", rate=rate, patience=Patience(first_token_s=None), seed=16)
    return Workload("synthetic", (f"reasoning {rate}/s",), tuple(generate(spec, count=count)), {}, None)


def _p(rows, band: str, attr: str):
    vals = [getattr(r, attr) for r in rows if r.length_band == band and r.requests]
    return vals[0] if vals else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    args = parser.parse_args()
    print("| model | rate | split | e2e p50 | e2e p99 | 10k-20k e2e p50 | preemptions | KV tokens/replica | "
          "completed/GPU-h |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, rate, count in CASES:
        w = _workload(rate, count // 4 if args.quick else count)
        for tp, dp in SPLITS:
            c = Candidate(name=f"{model}-tp{tp}-dp{dp}", model=model, tp=tp, dp=dp)
            try:
                r = replay(w, c, None, bands=DEFAULT_BANDS)
            except CandidateError as exc:
                print(f"| {model} | {rate}/s | TP={tp} x DP={dp} | cannot run: {str(exc).split(': ', 1)[-1]} "
                      "| | | | | |")
                continue
            rows = r.report.rows_for(ALL)
            p50, p99 = _p(rows, ALL, "e2e_p50_seconds"), _p(rows, ALL, "e2e_p99_seconds")
            long50 = _p(rows, "10k-20k", "e2e_p50_seconds")
            n = r.node
            print(f"| {model} | {rate}/s | TP={tp} x DP={dp} | {p50:.0f} s | {p99:.0f} s | "
                  f"{'n/a' if long50 is None else f'{long50:.0f} s'} | {n.preemptions:,} | "
                  f"{n.capacity_tokens_per_replica:,} | {n.completed_per_gpu_hour:,.1f} |", flush=True)


if __name__ == "__main__":
    main()
