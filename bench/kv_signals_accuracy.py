"""Derived KV signals against the simulator's ground truth: the numbers docs/kv-signals.md quotes.

Runs the simulator scenarios of ``tests/derive/simulated.py`` (vLLM page rendered by the simulator,
parsed by kvwatch's vLLM adapter, signals from ``derive_node`` with the default 30 s window and 5 s
scrapes) and prints, per scenario:

- headroom: (predicted - actual) / actual time until the pool is full, for scrapes before it first
  filled, by how far away the fill was; missed warnings (filled within 60 s, predicted > 66 s) and
  early warnings (predicted < 60 s, no fill within the next 120 s);
- fragmentation: proxy estimate - truth (exact prompts), and how often it is withheld (None);
- stranded tokens: largest |derived - truth|;
- over-commitment at the second scrape vs the requests the engine ever preempted;
- recompute estimate / the simulator's recomputed tokens;
- cost: ``derive_node`` per scrape against parsing the engine page (the peer) in the same run.

  .venv/bin/python -m bench.kv_signals_accuracy [--quick]
"""

from __future__ import annotations

import math
import time

from bench._harness import parser
from kvwatch.derive.node import NodeInputs, derive_node
from kvwatch.engines.registry import parse_exposition
from kvwatch.sim.engine import SimEngine
from kvwatch.sim.exposition_writer import render_vllm_metrics
from tests.derive import simulated as sim
from tests.derive.simulated import (
    derive_each,
    fragmentation_of,
    headroom_of,
    true_fragmentation,
    true_stranded,
)

SCENARIOS = {
    "balanced": lambda: sim.balanced(400.0),
    "imbalanced": sim.imbalanced,
    "bursty (25k blocks, never fills)": sim.bursty,
    "bursty (20k blocks, bursts overlap)": lambda: sim.bursty(blocks=20_000),
    "overloaded bursts (14k blocks)": lambda: sim.bursty(blocks=14_000),
    "long-output storm": sim.long_output_storm,
}
#: --quick: two short runs through the same reports (their figures mean nothing)
QUICK_SCENARIOS = {
    "balanced (60 s)": lambda: sim.balanced(60.0),
    "bursty (20k blocks, 120 s)": lambda: sim.bursty(until=120.0, blocks=20_000),
}


def headroom_report(run: sim.Run, views) -> str:
    by_horizon: dict[int, list[float]] = {60: [], 120: [], 300: []}
    missed = early = 0
    for scrape, view in zip(run.scrapes, views, strict=True):
        for i in range(len(scrape.truth)):
            predicted = headroom_of(view, f"r{i}")
            nxt = run.next_full(i, scrape.t)
            first = (run.full_at[i] or [None])[0]
            if predicted is None:
                continue
            actual = math.inf if nxt is None else nxt - scrape.t
            if actual <= 60 and predicted > 66 and (first is None or scrape.t < first):
                missed += 1
            if predicted < 60 and actual > 120 and run.until - scrape.t > 120:
                early += 1
            if first is not None and scrape.t < first:
                for horizon, errors in by_horizon.items():
                    if actual <= horizon:
                        errors.append((predicted - actual) / actual)
    parts = [f"<= {h} s: n={len(e)} [{min(e):+.2f}, {max(e):+.2f}]" for h, e in by_horizon.items() if e]
    return f"  headroom  {'; '.join(parts) or 'pool never filled'}; missed {missed}, early {early}"


def fragmentation_report(run: sim.Run, views) -> str:
    errors, withheld, total = [], 0, 0
    for scrape, view in zip(run.scrapes, views, strict=True):
        for i, truth in enumerate(scrape.truth):
            total += 1
            estimate = fragmentation_of(view, f"r{i}")
            if estimate is None:
                withheld += 1
            else:
                errors.append(estimate - true_fragmentation(truth))
    truths = [true_fragmentation(t) for s in run.scrapes for t in s.truth]
    return (
        f"  fragmentation  |error| <= {max(map(abs, errors)):.1e}; withheld {withheld}/{total}; "
        f"true range {min(truths):.4f}..{max(truths):.4f}"
    )


def stranded_report(run: sim.Run, views) -> str:
    by_time = {s.t: s for s in run.scrapes}
    worst = peak = 0.0
    for scrape, view in zip(run.scrapes, views, strict=True):
        baseline = view.baseline(scrape.samples[0].key)
        truth = true_stranded(scrape, by_time.get(baseline.scraped_at) if baseline else None)
        derived = sum(s.stranded_tokens for s in view.stranded)
        worst, peak = max(worst, abs(derived - truth)), max(peak, derived)
    return f"  stranded  max |error| {worst:.0f} tokens; peak {peak:.0f} tokens"


def recompute_report(run: sim.Run, views) -> str:
    parts = []
    for i, truth in enumerate(run.scrapes[-1].truth):
        unit = next(u for u in views[-1].units if u.sample.replica == f"r{i}")
        if truth.recomputed_tokens:
            parts.append(
                f"r{i} estimate/truth {unit.recomputed_tokens / truth.recomputed_tokens:.2f} "
                f"({truth.preemptions} preemptions)"
            )
    early = views[1].overcommit[0].overcommit.requests if views[1].overcommit else None
    return (
        f"  recompute  {'; '.join(parts) or 'no preemption'}; over-committed at t=10 s: {early}, "
        f"ever preempted: {run.preempted_requests}"
    )


def cost_report(scrapes: int) -> str:
    """derive_node per scrape vs parsing the page it derives from, on a 64-sequence engine."""
    engine = SimEngine(sim.config(50_000))
    for i in range(64):
        engine.submit(f"q{i}", 1000, 20_000, 20_000, arrival=0.0)
    samples, view, parse_s, derive_s = [], None, 0.0, 0.0
    for n in range(1, scrapes + 1):
        engine.advance_to(n * 5.0)
        page = render_vllm_metrics([engine], sim.MODEL, created=0.0).decode()
        started = time.perf_counter()
        samples = parse_exposition(page, "r0", backend="vllm", scraped_at=n * 5.0).samples
        parse_s += time.perf_counter() - started
        started = time.perf_counter()
        view = derive_node(view, NodeInputs(samples=tuple(samples), proxied={"r0"}), n * 5.0)
        derive_s += time.perf_counter() - started
    return (
        f"cost per scrape: derive_node {derive_s / scrapes * 1e6:.0f} us, parsing the page "
        f"{parse_s / scrapes * 1e6:.0f} us (ratio {derive_s / parse_s:.3f})"
    )


def main() -> int:
    quick = parser(__doc__).parse_args().quick
    for name, make in (QUICK_SCENARIOS if quick else SCENARIOS).items():
        started = time.perf_counter()
        run = make()
        views = derive_each(run)
        first_full = [f[0] if f else None for f in run.full_at]
        print(
            f"{name}  ({len(run.scrapes)} scrapes x {len(run.scrapes[0].truth)} replicas, "
            f"first full {first_full}, {time.perf_counter() - started:.1f} s)"
        )
        for line in (
            headroom_report(run, views),
            fragmentation_report(run, views),
            stranded_report(run, views),
            recompute_report(run, views),
        ):
            print(line)
    print(cost_report(20 if quick else 200))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
