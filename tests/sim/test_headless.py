"""Headless runs: queueing laws, conservation, determinism, routing, fake-GPU coupling (node.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvwatch.sim.engine import SimEngine
from kvwatch.sim.exposition_writer import render_vllm_metrics
from kvwatch.sim.node import SimNode, h200_node, run_headless
from kvwatch.sim.routing import RouterSpec
from kvwatch.sim.workload import Patience, WorkloadSpec, generate

from .helpers import small_config


def tight_engine(**overrides) -> SimEngine:
    """Llama-3.1-8B speed, a 60k-token cache: a reasoning load at 0.3 req/s queues and preempts."""
    cfg = small_config(
        block_size=16,
        num_gpu_blocks_override=3750,
        max_model_len=24000,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        **overrides,
    )
    return SimEngine(cfg)


def test_littles_law_holds_on_the_simulated_queue():
    """L = lambda * W: the time average of requests in the system (sampled from the engine's own
    counts every 0.5 s) against arrivals/time x mean sojourn (from request timestamps). Tolerance 3%:
    the sampling grid is the only approximation over a ~5,000 s run."""
    e = tight_engine()
    spec = WorkloadSpec(rate=0.3, patience=Patience(first_token_s=None), seed=21)
    reqs = list(generate(spec, duration=4000))
    sojourn = []
    e.on_finish = lambda v: sojourn.append(v.finished - v.arrival)
    samples = []
    t, dt, k = 0.0, 0.5, 0
    while k < len(reqs) or e.has_work():
        t += dt
        while k < len(reqs) and reqs[k].arrival <= t:
            r = reqs[k]
            e.advance_to(r.arrival)
            e.submit(r.request_id, r.prompt_tokens, r.max_tokens, r.output_tokens, arrival=r.arrival)
            k += 1
        e.advance_to(t)
        samples.append(e.in_system)
    assert e.preemptions_total > 0 and max(samples) > e.num_running  # it did queue
    horizon = t
    lam = len(reqs) / horizon
    w = sum(sojourn) / len(sojourn)
    l_avg = sum(samples) / len(samples)
    assert len(sojourn) == len(reqs)
    assert l_avg == pytest.approx(lam * w, rel=0.03)


def test_every_request_ends_in_one_outcome_with_impatient_clients():
    engines = [tight_engine() for _ in range(2)]
    spec = WorkloadSpec(rate=0.8, patience=Patience(first_token_s=20.0, total_s=400.0), seed=3)
    report = run_headless(engines, generate(spec, duration=1500), RouterSpec("round_robin"), until=1500)
    assert report.abandoned > 0 and report.preemptions > 0
    assert report.arrived == report.completed + report.truncated + report.aborted + report.in_system
    assert report.aborted == report.abandoned
    for e in engines:
        e.check_invariants()


def test_abandoned_requests_free_their_kv():
    e = tight_engine()
    spec = WorkloadSpec(rate=1.5, patience=Patience(first_token_s=5.0), seed=8)
    report = run_headless([e], generate(spec, duration=600), until=None)
    assert report.abandoned > 0
    assert e.in_system == 0 and e.used_blocks == 0


def test_same_seed_same_run():
    def run(seed: int):
        engines = [tight_engine() for _ in range(2)]
        views = []
        for e in engines:
            e.on_finish = lambda v: views.append((v.request_id, v.first_token, v.finished, v.preemptions))
        spec = WorkloadSpec(rate=0.6, patience=Patience(first_token_s=30.0), seed=seed)
        run_headless(engines, generate(spec, duration=800), RouterSpec("weighted", weights=(1, 2), seed=seed))
        return views, render_vllm_metrics(engines, "m", created=0.0)

    first, second, other = run(5), run(5), run(6)
    assert first == second
    assert first[0] != other[0]


def test_skewed_router_strands_free_kv_on_the_other_replicas():
    engines = [tight_engine() for _ in range(4)]
    spec = WorkloadSpec(rate=0.5, patience=Patience(first_token_s=None), seed=9)
    router = RouterSpec("skewed", hot_replica=0, hot_share=1.0, long_threshold=5000)
    run_headless(engines, generate(spec, duration=1200), router, until=1200)
    hot, cold = engines[0], engines[1:]
    assert hot.num_waiting > 0 and hot.preemptions_total > 0
    assert hot.kv_usage > 0.9
    assert all(e.kv_usage < 0.6 and e.num_waiting == 0 for e in cold)  # free KV the hot one cannot use


def test_least_loaded_router_spreads_the_same_load():
    engines = [tight_engine() for _ in range(4)]
    spec = WorkloadSpec(rate=0.5, patience=Patience(first_token_s=None), seed=9)
    run_headless(engines, generate(spec, duration=1200), RouterSpec("least_loaded"), until=1200)
    assert max(e.in_system for e in engines) - min(e.in_system for e in engines) <= 3


def test_requests_that_do_not_fit_the_context_are_rejected_not_crashing():
    e = SimEngine(small_config(max_model_len=200))
    report = run_headless([e], generate(WorkloadSpec(seed=1), count=20))
    assert report.rejected == 20 and report.arrived == 0


def test_gpu_coupling_reports_nvml_like_memory_and_pcie_traffic():
    cfg = h200_node("llama-3.1-70b", tp=2, max_model_len=32768, kv_offload_bytes=200e9)
    node = SimNode(replace(cfg, engine=replace(cfg.engine, num_gpu_blocks_override=4000)))
    assert node.config.replicas == 4 and node.gpu_replica(5) == (2, 1)
    with pytest.raises(IndexError, match="8 GPUs"):
        node.gpu_replica(8)
    used = node.gpu_memory_used_bytes(0)
    plan = node.engines[0].memory_plan
    assert used == pytest.approx(141e9 * 0.9)  # weights + reserve + the KV pool, allocated at start
    assert plan.weight_bytes_per_gpu == pytest.approx(70.55e9)
    assert node.pcie_bytes(0) == (0.0, 0.0)
    spec = WorkloadSpec(rate=1.0, patience=Patience(first_token_s=None), seed=2)
    node.run_headless(generate(spec, duration=300), RouterSpec("skewed", hot_share=1.0), until=300)
    tx, rx = node.pcie_bytes(0)
    stats = node.engines[0].stats
    assert tx == stats.offload_store_bytes / 2 > 0 and rx == stats.offload_load_bytes / 2 > 0
    assert node.kv_bytes_in_use(0) == node.engines[0].used_blocks * node.engines[0].block_bytes
    assert 0 < node.busy_seconds(0) <= 300 + 1


def test_the_span_of_a_drained_run_is_when_its_work_ended_whatever_the_sample_interval():
    """Samples move idle engines on to the sample's time, and the span was the engines' clocks after
    the drain: kvwatch plan replay's requests per GPU-hour read 748 at --sample-every 0.25, 675 at
    100 and 135 at 1000 for the same 300 requests."""
    reqs = list(generate(WorkloadSpec(rate=0.3, patience=Patience(first_token_s=None), seed=5), count=40))
    spans = set()
    for every in (0.25, 7.0, 1000.0):
        report = run_headless([tight_engine()], reqs, sample_every=every, on_sample=lambda _t: None)
        spans.add(round(report.sim_seconds, 6))
    unsampled = run_headless([tight_engine()], reqs)
    assert spans == {round(unsampled.sim_seconds, 6)}, (spans, unsampled.sim_seconds)
