"""Drive kvwatch's simulator headless and record what a scrape would see next to the exact truth.

Each simulated engine is one single-rank vLLM replica (``r0``, ``r1``, ...) of one model. At every
scrape the simulator renders its vLLM ``/metrics`` page and kvwatch's vLLM adapter parses it, as in
production; the requests in the engine become the proxy's in-flight records (prompt estimate = the
exact prompt unless a bias is given). Between scrapes the clock moves in small ticks to find the exact moments
the pool was full (no free block, or a preemption), which is the ground truth for headroom.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvwatch.derive.node import DerivedView, NodeInputs, derive_node
from kvwatch.engines.registry import parse_exposition
from kvwatch.model import InFlightRequest, ReplicaSample
from kvwatch.sim.engine import EngineConfig, SimEngine
from kvwatch.sim.exposition_writer import render_vllm_metrics
from kvwatch.sim.models import MODELS

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float
    replica: int
    prompt: int
    output: int
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Truth:
    """The simulator's exact state of one replica at a scrape."""

    live_tokens: int
    used_blocks: int
    free_tokens: int
    running: int
    waiting: int
    preemptions: int
    recomputed_tokens: int


@dataclass(slots=True)
class Scrape:
    t: float
    samples: list[ReplicaSample]
    in_flight: list[InFlightRequest]
    truth: list[Truth]


@dataclass(slots=True)
class Run:
    until: float
    scrapes: list[Scrape] = field(default_factory=list)
    full_at: list[list[float]] = field(default_factory=list)  # per replica: tick times the pool was full
    preempted_requests: list[int] = field(default_factory=list)  # per replica: requests ever preempted

    def next_full(self, replica: int, t: float) -> float | None:
        """First time at or after ``t`` the replica's pool was full; None if not before the end."""
        return next((f for f in self.full_at[replica] if f >= t), None)


def config(blocks: int, **fields) -> EngineConfig:
    return EngineConfig(
        model=MODELS["llama-3.1-8b"], num_gpu_blocks_override=blocks, max_model_len=32768, **fields
    )


def observe(engine: SimEngine, replica: str, t: float) -> ReplicaSample:
    """What kvwatch reads at time ``t``: the simulator's vLLM page, parsed by the vLLM adapter."""
    page = render_vllm_metrics([engine], MODEL, created=0.0).decode()
    [sample] = parse_exposition(page, replica, backend="vllm", scraped_at=t).samples
    return sample


def in_flight(engine: SimEngine, replica: str, prompt_bias: float) -> list[InFlightRequest]:
    """The proxy's view: every request in the engine, prompt estimated as prompt x (1 + bias)."""
    return [
        InFlightRequest(
            replica=replica,
            model_name=MODEL,
            admission_band="unknown",
            prompt_tokens_estimate=round(v.prompt_tokens * (1 + prompt_bias)),
            generated_tokens=v.generated_tokens,
            started_at=v.arrival,
            max_tokens=v.max_tokens,
        )
        for v in engine.requests()
    ]


def truth(engine: SimEngine) -> Truth:
    return Truth(
        engine.live_tokens,
        engine.used_blocks,
        engine.free_blocks * engine.config.block_size,
        engine.num_running,
        engine.num_waiting,
        engine.preemptions_total,
        engine.recomputed_tokens_total,
    )


def simulate(
    configs: Sequence[EngineConfig],
    arrivals: Sequence[Arrival],
    until: float,
    scrape_every: float = 5.0,
    tick: float = 0.05,
    prompt_bias: float = 0.0,
    scrape_until: float | None = None,
) -> Run:
    """Run to ``until``, scraping every ``scrape_every`` seconds up to ``scrape_until`` (default: the end;
    the rest of the run still records fills and preempted requests)."""
    engines = [SimEngine(c, name="0") for c in configs]
    names = [f"r{i}" for i in range(len(engines))]
    pending = deque(sorted(arrivals, key=lambda a: a.at))
    run = Run(until, full_at=[[] for _ in engines])
    preempted = [0] * len(engines)
    ticks_per_scrape = round(scrape_every / tick)
    serial = 0
    submitted: list[list[str]] = [[] for _ in engines]
    for n in range(1, round(until / tick) + 1):
        t = n * tick
        while pending and pending[0].at <= t:
            a = pending.popleft()
            serial += 1
            engines[a.replica].submit(f"q{serial}", a.prompt, a.max_tokens, a.output, arrival=a.at)
            submitted[a.replica].append(f"q{serial}")
        for i, engine in enumerate(engines):
            engine.advance_to(t)
            if engine.free_blocks == 0 or engine.preemptions_total > preempted[i]:
                run.full_at[i].append(t)
            preempted[i] = engine.preemptions_total
        if n % ticks_per_scrape == 0 and (scrape_until is None or t <= scrape_until):
            run.scrapes.append(
                Scrape(
                    t,
                    [observe(e, name, t) for e, name in zip(engines, names, strict=True)],
                    [
                        r
                        for e, name in zip(engines, names, strict=True)
                        for r in in_flight(e, name, prompt_bias)
                    ],
                    [truth(e) for e in engines],
                )
            )
    run.preempted_requests = [
        sum(1 for rid in ids if engine.request(rid).preemptions)
        for engine, ids in zip(engines, submitted, strict=True)
    ]
    return run


# --------------------------------------------------------------------------------------------
# scenarios (llama-3.1-8b on H200, 16-token blocks; pools shrunk so they fill within minutes)
# --------------------------------------------------------------------------------------------

OUTPUTS = (300, 1200, 2500, 600, 4000, 900, 1800)


def balanced(until: float = 600.0) -> Run:
    """Two replicas, requests alternate between them: moderate outputs, the pools never fill.
    (Arrivals are offset from the 5 s scrape instants, as a real scrape is from arrivals.)"""
    arrivals = [
        Arrival(0.5 * i + 0.013, i % 2, 800, OUTPUTS[(i // 2) % len(OUTPUTS)], 8192)
        for i in range(int(until * 2))
    ]
    return simulate([config(20_000), config(20_000)], arrivals, until)


def imbalanced(until: float = 300.0) -> Run:
    """Two replicas: the router sends long reasoning requests to r0 only; r1 gets short chat."""
    arrivals = [Arrival(2.0 * i, 0, 1000, 12_000, 16_384) for i in range(int(until / 2))]
    arrivals += [Arrival(3.0 * i + 1.0, 1, 500, 400, 1024) for i in range(int(until / 3))]
    return simulate([config(8_000), config(8_000)], arrivals, until)


def bursty(until: float = 900.0, blocks: int = 25_000) -> Run:
    """One replica, a burst of 24 reasoning requests (10k-15.5k output tokens) every 120 s.

    With 25k blocks the pool never fills; with 14k, bursts arrive faster than they finish and it does.
    """
    arrivals = [
        Arrival(120.0 * b + 0.1 * i, 0, 1500, 10_000 + 500 * (i % 12), 16_384)
        for b in range(int(until / 120))
        for i in range(24)
    ]
    return simulate([config(blocks)], arrivals, until)


def long_output_storm(until: float = 1300.0, scrape_until: float | None = 700.0) -> Run:
    """One replica: 32 requests that all want 30k output tokens arrive at once and outgrow the pool.

    The pool first fills at ~478 s; the engine goes on preempting the newest request until ~1244 s, by
    when it has preempted 7 distinct ones. Scraped for the first 700 s only (the rest is the same).
    """
    arrivals = [Arrival(0.0, 0, 1000, 30_000, 30_000) for _ in range(32)]
    return simulate([config(50_000)], arrivals, until, scrape_until=scrape_until)


# --------------------------------------------------------------------------------------------
# the derived signals of a run, and the truth they are compared with (tests and bench/kv_signals_accuracy.py)
# --------------------------------------------------------------------------------------------


def derive_each(run: Run) -> list[DerivedView]:
    """The derived view after every scrape of the run, as the agent would keep it."""
    views, view = [], None
    replicas = {s.replica for s in run.scrapes[0].samples}
    for scrape in run.scrapes:
        inputs = NodeInputs(
            samples=tuple(scrape.samples), in_flight=tuple(scrape.in_flight), proxied=replicas
        )
        view = derive_node(view, inputs, scrape.t)
        views.append(view)
    return views


def headroom_of(view: DerivedView, replica: str) -> float | None:
    """The derived headroom of one replica (None: withheld)."""
    return next(u.headroom.seconds for u in view.units if u.sample.replica == replica)


def fragmentation_of(view: DerivedView, replica: str) -> float | None:
    """The derived fragmentation ratio of one replica (None: withheld)."""
    return next(f.ratio for f in view.fragmentation if f.replica == replica)


def true_fragmentation(truth: Truth) -> float:
    """The share of the used blocks' slots that hold no live token (16-token blocks)."""
    return 1 - truth.live_tokens / (truth.used_blocks * 16) if truth.used_blocks else 0.0


def true_stranded(scrape: Scrape, baseline: Scrape | None) -> float:
    """Free tokens of replicas with no queue and no new preemption while another queues (now and at
    the baseline) or preempts (since the baseline)."""

    def pressured(i: int) -> bool:
        if baseline is None:
            return scrape.truth[i].waiting > 0
        now, before = scrape.truth[i], baseline.truth[i]
        return (now.waiting > 0 and before.waiting > 0) or now.preemptions > before.preemptions

    flags = [pressured(i) for i in range(len(scrape.truth))]
    if not any(flags):
        return 0.0
    idle = [t for t, p in zip(scrape.truth, flags, strict=True) if not p and t.waiting == 0]
    return float(sum(t.free_tokens for t in idle))
