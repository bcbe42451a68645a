"""Replay a workload on a twin: simulated replicas of a candidate, at the recorded arrival times.

The simulator (``sim/``) does the work: each replica is a ``SimEngine`` (vLLM V1 scheduling, paged
KV, preemption by recompute, the CPU tier), fed by ``sim.node.run_headless`` through a router. This
module only builds the twin, watches it (every ``sample_every`` simulated seconds: KV use per
replica, queues, stranded capacity) and turns every finished request into the same request table
``kvwatch report`` summarises, so the twin's band figures and the recorded ones are computed by
one piece of code (``report.summary.summarize``).

Node figures and their definitions:

* preemptions and recomputed tokens: the engines' counters (exact in the twin);
* KV use: used blocks / blocks, node-wide and per replica, sampled every ``sample_every`` seconds
  (peak and time mean over the replay, drain included);
* stranded capacity: at a sample where some replica queues, the free KV tokens of the replicas
  that do not (memory data parallelism cannot pool); time mean and the share of samples with any;
* completed requests per GPU-hour: requests that finished with ``stop`` / (GPUs x replay hours);
* CPU tier: bytes stored and loaded over PCIe, tokens loaded back (recompute avoided) per byte moved,
  and how long steps waited for uplinks busy with other transfers (shared switches, saturation).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwatch.derive.stranded import SampleKey, stranded_capacity
from kvwatch.jsonsafe import finite
from kvwatch.model import OUTCOMES, LengthBands, Outcome, ReplicaSample, RequestRecord
from kvwatch.plan.calibration import Calibration
from kvwatch.plan.candidate import Candidate, engine_config, observed_fit, unobserved_layout
from kvwatch.plan.inputs import PlanInputError, Workload
from kvwatch.report.load import Loaded
from kvwatch.report.summary import Report, summarize
from kvwatch.sim.engine import RequestView, SimEngine
from kvwatch.sim.hostlink import node_host_paths
from kvwatch.sim.node import run_headless
from kvwatch.sim.routing import Router, RouterSpec
from kvwatch.sim.workload import WorkloadRequest

_OUTCOME = {"stop": Outcome.COMPLETED, "length": Outcome.TRUNCATED, "abort": Outcome.ABORTED}
TWIN_MODEL = "twin"  # the one model the twin serves, as the stranded-capacity rule groups replicas


@dataclass(frozen=True, slots=True)
class NodeFigures:
    gpus: int
    replicas: int
    capacity_tokens_per_replica: int
    sim_seconds: float
    requests: int
    completed: int
    truncated: int
    aborted: int
    rejected: int  # did not fit max_model_len
    preemptions: int
    recomputed_tokens: int
    peak_kv_usage: float  # node-wide used / capacity, highest sample
    peak_replica_kv_usage: float  # the fullest replica at its fullest sample
    mean_kv_usage: float
    mean_stranded_tokens: float
    stranded_sample_share: float  # samples where some replica queued while another had free KV
    sample_every_s: float
    samples: int
    offload_bytes: float  # stored to + loaded from the CPU tier
    offload_tokens_loaded: int = 0  # KV tokens loaded back from the CPU tier: recompute avoided
    offload_queue_seconds: float = 0.0  # steps' wait for busy (shared) uplinks beyond their own transfer
    offload_transfer_seconds: float = 0.0  # the transfers alone, at the measured host bandwidth

    @property
    def recompute_avoided_per_byte(self) -> float | None:
        """Tokens loaded back instead of recomputed, per byte moved over PCIe (store + load)."""
        return self.offload_tokens_loaded / self.offload_bytes if self.offload_bytes else None

    @property
    def completed_per_gpu_hour(self) -> float | None:
        hours = self.sim_seconds / 3600.0
        return self.completed / (self.gpus * hours) if hours > 0 else None


@dataclass(frozen=True, slots=True)
class ReplayResult:
    candidate: Candidate
    step_model: str  # what timed the steps, in words
    calibrated: bool
    report: Report  # the twin's figures per band, computed as kvwatch report computes them
    node: NodeFigures
    wall_seconds: float
    usage_timeline: tuple[tuple[float, float], ...]  # (sim seconds, node KV usage), thinned
    notes: tuple[str, ...] = field(default=())
    requests: Any = None  # the twin's request table (report.load.COLUMNS), for SLO attainment


class LongPoolRouter(Router):
    """Admission policy ``long_pool``: requests whose ``max_tokens`` exceeds the threshold (what a
    router can see before the answer) go to a separate pool of replicas; least loaded within a pool."""

    def __init__(self, replicas: int, long_share: float, threshold: int) -> None:
        super().__init__(RouterSpec("least_loaded"), replicas)
        self.long = max(1, min(replicas - 1, round(replicas * long_share)))
        self.threshold = threshold
        self._turn = [0, 0]

    def route(self, request: WorkloadRequest, loads: Sequence[int]) -> int:
        is_long = request.max_tokens is None or request.max_tokens > self.threshold
        lo, hi = (self.replicas - self.long, self.replicas) if is_long else (0, self.replicas - self.long)
        k = hi - lo
        start = self._turn[is_long] % k
        self._turn[is_long] += 1
        order = [lo + (start + j) % k for j in range(k)]
        return min(order, key=lambda i: loads[i])


ROOFLINE_WORDS = (
    "uncalibrated: datasheet roofline (HBM bandwidth x 0.8, dense FLOPS x 0.5, 1.5 ms per step); "
    "not validated on this hardware"
)


def step_model_words(c: Candidate, cal: Calibration | None) -> tuple[str, bool]:
    fit = observed_fit(c, cal)
    if fit is not None:
        assert cal is not None
        q = fit.quality
        r2 = "n/a" if q.r2 is None else f"{q.r2:.3f}"
        return (
            f"calibrated at TP={c.tp} ({cal.source}, {q.observations} observations, R2 {r2}, "
            f"|residual| p50 {q.residual_p50:.1%})"
        ), True
    if unobserved_layout(c, cal):
        assert cal is not None
        observed = ", ".join(f"TP={tp}" for tp in cal.observed_tp)
        return (
            f"layout {c.layout()} never observed in the calibration (observed: {observed}, one stage): "
            f"its time is the roofline's; {ROOFLINE_WORDS}"
        ), False
    return ROOFLINE_WORDS, False


def output_budget(workload: Workload, quantile: float) -> int:
    outputs = np.array([min(r.output_tokens, r.max_tokens or r.output_tokens) for r in workload.requests])
    return max(1, int(np.quantile(outputs, quantile)))


def _default_sample_every(span: float) -> float:
    return float(min(60.0, max(0.25, span / 2000.0)))


def check_sample_every(seconds: float) -> float:
    """The KV sampling step, refused unless a finite number > 0: the simulator samples until the
    replay drains by adding the step, so 0, a negative step or NaN would never get there."""
    if finite(seconds) is None or seconds <= 0:
        raise PlanInputError(
            f"--sample-every must be a finite number of simulated seconds > 0, got {seconds:g}"
        )
    return float(seconds)


def replay(
    workload: Workload,
    candidate: Candidate,
    calibration: Calibration | None = None,
    *,
    bands: LengthBands,
    sample_every: float | None = None,
) -> ReplayResult:
    """Run the workload on the candidate's twin (module doc)."""
    every = (
        _default_sample_every(workload.span_seconds)
        if sample_every is None
        else check_sample_every(sample_every)
    )
    budget = (
        output_budget(workload, candidate.admission_quantile)
        if candidate.admission == "quantile_budget"
        else None
    )
    config = engine_config(candidate, calibration, output_budget=budget)
    # the replicas share the node's PCIe uplinks where GPUs share a switch (``sim/hostlink.py``)
    paths = node_host_paths(candidate.dp, config.gpus, config.switch_gpus, config.gpu.host_bandwidth)
    engines = [
        SimEngine(config, name=str(i), keep_finished=0, host_path=paths[i]) for i in range(candidate.dp)
    ]
    finished: list[tuple[int, RequestView]] = []
    for i, e in enumerate(engines):
        e.on_finish = lambda view, i=i: finished.append((i, view))
    if candidate.admission == "long_pool":
        router: Router = LongPoolRouter(candidate.dp, candidate.long_pool_share, candidate.long_threshold)
    else:
        router = Router(RouterSpec(candidate.router), candidate.dp)

    cap_blocks = engines[0].capacity_blocks
    block = config.block_size
    usage: list[float] = []
    replica_peak = [0.0]
    stranded: list[float] = []

    previous: dict[SampleKey, ReplicaSample] = {}

    def sample(t: float) -> None:
        used = [e.used_blocks for e in engines]
        usage.append(sum(used) / (cap_blocks * len(engines)))
        replica_peak[0] = max(replica_peak[0], max(used) / cap_blocks)
        # as the agent computes it (derive/stranded.py): a request caught between arrival and the end
        # of the step it arrived in is not a queue, one that lasted a sample interval is
        current = [
            ReplicaSample(
                e.name,
                "vllm",
                t,
                model_name=TWIN_MODEL,
                kv_capacity_tokens=float(cap_blocks * block),
                kv_used_tokens=float(e.used_blocks * block),
                requests_waiting=float(e.num_waiting),
                preemptions_total=float(e.preemptions_total),
            )
            for e in engines
        ]
        stranded.append(stranded_capacity(current, previous)[TWIN_MODEL].stranded_tokens)
        previous.update((s.key, s) for s in current)

    started = time.perf_counter()
    report = run_headless(engines, workload.requests, router, sample_every=every, on_sample=sample)
    wall = time.perf_counter() - started

    loaded = _request_table(finished, workload, candidate)
    twin = summarize(loaded, bands, "as the recorded figures")
    arr = np.array(usage) if usage else np.zeros(1)
    node = NodeFigures(
        gpus=candidate.gpus,
        replicas=candidate.dp,
        capacity_tokens_per_replica=cap_blocks * block,
        sim_seconds=report.sim_seconds,
        requests=len(workload.requests),
        completed=report.completed,
        truncated=report.truncated,
        aborted=report.aborted,
        rejected=report.rejected,
        preemptions=report.preemptions,
        recomputed_tokens=sum(e.recomputed_tokens_total for e in engines),
        peak_kv_usage=float(arr.max()),
        peak_replica_kv_usage=replica_peak[0],
        mean_kv_usage=float(arr.mean()),
        mean_stranded_tokens=float(np.mean(stranded)) if stranded else 0.0,
        stranded_sample_share=float(np.mean(np.array(stranded) > 0)) if stranded else 0.0,
        sample_every_s=every,
        samples=len(usage),
        offload_bytes=sum(e.stats.offload_store_bytes + e.stats.offload_load_bytes for e in engines),
        offload_tokens_loaded=sum(e.stats.external_hits for e in engines),
        offload_queue_seconds=sum(e.stats.offload_queue_seconds for e in engines),
        offload_transfer_seconds=sum(
            e.stats.offload_store_seconds + e.stats.offload_load_seconds for e in engines
        ),
    )
    words, calibrated = step_model_words(candidate, calibration)
    stride = max(1, len(usage) // 400)
    timeline = tuple((every * (k + 1), usage[k]) for k in range(0, len(usage), stride))
    notes = []
    if budget is not None:
        notes.append(
            f"quantile_budget admission reserves prompt + min(max_tokens, {budget:,}) tokens "
            f"(output p{candidate.admission_quantile * 100:g} of the workload), "
            f"{candidate.admission_headroom:.0%} of the pool kept as shared headroom"
        )
    return ReplayResult(candidate, words, calibrated, twin, node, wall, timeline, tuple(notes), loaded.frame)


def _request_table(
    finished: list[tuple[int, RequestView]], workload: Workload, candidate: Candidate
) -> Loaded:
    """Every request the twin ended, in ``report.load.COLUMNS``; TPOT by ``RequestRecord``'s rule."""
    import pandas as pd

    n = len(finished)
    base = workload.start_unix or 0.0
    cols: dict[str, list] = {
        k: []
        for k in (
            "replica",
            "outcome",
            "started_at",
            "prompt_tokens",
            "output_tokens",
            "ttft_seconds",
            "e2e_seconds",
            "tpot_seconds",
        )
    }
    name = candidate.model
    for i, v in finished:
        ttft = None if v.first_token is None else v.first_token - v.arrival
        e2e = (v.finished or v.arrival) - v.arrival
        outcome = _OUTCOME.get(v.finish_reason or "abort", Outcome.ABORTED)
        record = RequestRecord(
            replica=str(i),
            model_name=name,
            source="twin",
            outcome=outcome,
            started_at=base + v.arrival,
            prompt_tokens=v.prompt_tokens,
            output_tokens=v.generated_tokens,
            max_tokens=v.max_tokens,
            ttft_seconds=ttft,
            e2e_seconds=e2e,
        )
        cols["replica"].append(record.replica)
        cols["outcome"].append(record.outcome.value)
        cols["started_at"].append(record.started_at)
        cols["prompt_tokens"].append(float(v.prompt_tokens))
        cols["output_tokens"].append(float(v.generated_tokens))
        cols["ttft_seconds"].append(np.nan if ttft is None else ttft)
        cols["e2e_seconds"].append(e2e)
        tpot = record.tpot_seconds
        cols["tpot_seconds"].append(np.nan if tpot is None else tpot)
    frame = pd.DataFrame(
        {
            "replica": pd.Categorical(cols["replica"]),
            "model_name": pd.Categorical([name] * n),
            "outcome": pd.Categorical(cols["outcome"], categories=OUTCOMES),
            "started_at": np.array(cols["started_at"], dtype=float),
            "prompt_tokens": np.array(cols["prompt_tokens"], dtype=float),
            "output_tokens": np.array(cols["output_tokens"], dtype=float),
            "output_tokens_estimated": np.zeros(n),
            "ttft_seconds": np.array(cols["ttft_seconds"], dtype=float),
            "e2e_seconds": np.array(cols["e2e_seconds"], dtype=float),
            "tpot_seconds": np.array(cols["tpot_seconds"], dtype=float),
        }
    )
    return Loaded("twin", frame)
