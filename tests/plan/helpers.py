"""A ledger written by a simulated engine of known step cost: the ground truth plan tests replay."""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvwatch.model import DEFAULT_BANDS, Outcome, RequestRecord
from kvwatch.requests.ledger import ledger_line
from kvwatch.sim.engine import EngineConfig, SimEngine
from kvwatch.sim.models import ModelSpec
from kvwatch.sim.node import run_headless
from kvwatch.sim.steptime import StepCost
from kvwatch.sim.workload import WorkloadRequest

TRUE_COST = StepCost(
    overhead_s=0.004, per_prefill_token_s=20e-6, per_decode_seq_s=0.0015, per_kv_token_s=2e-7
)
TINY = ModelSpec(
    key="tiny",
    served_name="tiny",
    layers=1,
    kv_heads=1,
    head_dim=1,
    params=1.0,
    active_params=1.0,
    weight_bytes=1.0,
    max_model_len=2048,
)
_OUTCOMES = {"stop": Outcome.COMPLETED, "length": Outcome.TRUNCATED, "abort": Outcome.ABORTED}


def tiny_engine(cost: StepCost = TRUE_COST, blocks: int = 80) -> EngineConfig:
    return EngineConfig(
        model=TINY,
        block_size=16,
        num_gpu_blocks_override=blocks,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_model_len=1024,
        step_cost=cost,
    )


def requests(n: int = 120, seed: int = 3, rate: float = 4.0) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(WorkloadRequest(f"r{i}", t, rng.randint(20, 600), rng.randint(2, 300), 400))
    return out


def write_ledger(path: Path, config: EngineConfig, reqs: list[WorkloadRequest], start: float = 1.7e9) -> dict:
    """Run ``reqs`` on one engine of ``config``; write its ledger; return the engine's counters."""
    engine = SimEngine(config, keep_finished=0)
    views = []
    engine.on_finish = views.append
    report = run_headless([engine], reqs)
    with path.open("w") as fh:
        for v in sorted(views, key=lambda v: v.arrival):
            record = RequestRecord(
                replica="0",
                model_name="tiny",
                source="proxy",
                outcome=_OUTCOMES[v.finish_reason],
                started_at=start + v.arrival,
                prompt_tokens=v.prompt_tokens,
                output_tokens=v.generated_tokens,
                max_tokens=v.max_tokens,
                ttft_seconds=v.first_token - v.arrival,
                e2e_seconds=v.finished - v.arrival,
                finish_reason=v.finish_reason,
            )
            fh.write(json.dumps(ledger_line(record, DEFAULT_BANDS)) + "\n")
    return {"preemptions": report.preemptions, "completed": report.completed}
