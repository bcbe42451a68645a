"""The twin against a ledger whose engine is known: a simulated engine of step cost TRUE_COST.

The calibration is fitted on step observations of that engine (not handed TRUE_COST), so the chain
calibrate -> twin -> replay -> per-band figures is checked end to end; the real-engine version of
this check is tests/plan/test_validation_real_vllm.py.
"""

import json
import random

import pytest

from kvwatch.cli import main
from kvwatch.model import DEFAULT_BANDS
from kvwatch.plan.calibration import Calibration, EngineShape, load_calibration
from kvwatch.plan.candidate import CALIBRATED, Candidate
from kvwatch.plan.fit import StepObservation, fit_step_cost
from kvwatch.plan.inputs import read_workload
from kvwatch.plan.replay import replay
from kvwatch.report import build_report
from kvwatch.report.summary import ALL

from .helpers import TRUE_COST, requests, tiny_engine, write_ledger


def _calibration() -> Calibration:
    rng = random.Random(7)
    obs = []
    for _ in range(500):
        p, s = rng.choice([0, rng.randint(1, 2000)]), rng.randint(1, 8)
        kv = s * rng.randint(20, 900) + p
        obs.append(StepObservation(p, s, TRUE_COST.seconds(p, s, kv) * (1 + rng.gauss(0, 0.02)), kv))
    shape = EngineShape(
        model_name="tiny",
        block_size=16,
        num_gpu_blocks=80,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_model_len=1024,
    )
    return Calibration("step_samples", fit_step_cost(obs), shape, window="synthetic")


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "ledger.jsonl"
    truth = write_ledger(path, tiny_engine(), requests())
    assert truth["preemptions"] > 0, "the ground truth must preempt, or preemption is not tested"
    return path, truth


def test_calibrated_twin_reproduces_the_engine_per_band(ledger, tmp_path):
    path, truth = ledger
    cal = _calibration()
    cal.dump(tmp_path / "cal.yaml")
    cal = load_calibration(tmp_path / "cal.yaml")
    twin = replay(
        read_workload([str(path)]),
        Candidate(model=CALIBRATED, dp=1, step_model=CALIBRATED),
        cal,
        bands=DEFAULT_BANDS,
    )
    recorded = {r.length_band: r for r in build_report([str(path)]).rows_for(ALL)}
    assert twin.calibrated
    for row in twin.report.rows_for(ALL):
        rec = recorded[row.length_band]
        assert row.requests == rec.requests
        if not rec.requests:
            continue
        assert row.e2e_p50_seconds == pytest.approx(rec.e2e_p50_seconds, rel=0.15), row.length_band
        assert row.e2e_p99_seconds == pytest.approx(rec.e2e_p99_seconds, rel=0.25), row.length_band
    assert twin.node.preemptions == pytest.approx(truth["preemptions"], rel=0.2)
    assert twin.node.completed == truth["completed"]


def test_an_uncalibrated_twin_of_the_same_ledger_is_labelled_and_differs(ledger):
    path, _ = ledger
    twin = replay(read_workload([str(path)]), Candidate(dp=1), None, bands=DEFAULT_BANDS)
    assert not twin.calibrated and "uncalibrated" in twin.step_model


def test_replay_trace_without_calibration_uses_the_demo_node_and_says_so(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": i * 500, "input_length": 500 + i, "output_length": 50 + 7 * i}) + "\n"
            for i in range(60)
        )
    )
    assert main(["plan", "replay", str(trace), "--html", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "UNCALIBRATED" in out and "8 GPU(s): qwen3-32b" in out
    assert "completed requests per GPU-hour" in out
    assert "<svg" in (tmp_path / "r.html").read_text()


def test_replay_with_calibration_shows_recorded_figures_side_by_side(ledger, tmp_path, capsys):
    path, _ = ledger
    _calibration().dump(tmp_path / "cal.yaml")
    assert main(["plan", "replay", str(path), "--calibration", str(tmp_path / "cal.yaml")]) == 0
    out = capsys.readouterr().out
    assert "step time: calibrated at TP=1 (step_samples" in out
    assert "(recorded, error)" in out


def test_the_calibrated_engine_is_replayed_once_per_replica_the_ledger_recorded(ledger, tmp_path, capsys):
    # --calibration alone built one engine for a ledger two replicas had served: all their traffic on one
    path, _ = ledger
    lines = path.read_text().splitlines()
    two = tmp_path / "two-replicas.jsonl"
    two.write_text(
        "".join(
            json.dumps({**json.loads(line), "replica": str(i % 2)}) + "\n" for i, line in enumerate(lines)
        )
    )
    _calibration().dump(tmp_path / "cal.yaml")
    assert main(["plan", "replay", str(two), "--calibration", str(tmp_path / "cal.yaml")]) == 0
    assert "twin: 2 GPU(s): calibrated, 2xh200" in capsys.readouterr().out
    assert main(["plan", "replay", str(path), "--calibration", str(tmp_path / "cal.yaml")]) == 0
    assert "twin: 1 GPU(s): calibrated, 1xh200" in capsys.readouterr().out


def test_a_request_waiting_for_the_step_it_arrived_in_strands_nothing(tmp_path):
    """The twin counted free KV as stranded whenever a replica had a request waiting at a sample: a
    request that arrived mid-step waits a few ms for the step to end, so a node at 8% KV showed
    stranded capacity. As the agent (derive/stranded.py): only a queue that lasted a sample, or a
    preemption, is pressure."""
    from kvwatch.plan.inputs import Workload
    from kvwatch.sim.workload import WorkloadRequest

    # both replicas always busy (each request decodes ~2 s), so arrivals land mid-step; KV stays low
    light = [WorkloadRequest(f"r{i}", 0.137 * i, 200, 400, 500) for i in range(200)]
    workload = Workload("trace", ("light",), tuple(light), {}, None)
    twin = replay(
        workload, Candidate(model="llama-3.1-8b", dp=2), None, bands=DEFAULT_BANDS, sample_every=0.05
    )
    assert twin.node.peak_kv_usage < 0.05 and twin.node.preemptions == 0
    assert twin.node.stranded_sample_share == 0.0 and twin.node.mean_stranded_tokens == 0.0
    # a queue that lasts beside a replica with room is still stranded capacity
    long = [WorkloadRequest(f"l{i}", 0.5 * i, 200, 6000, 6000) for i in range(40)]
    skewed = Candidate(
        model="llama-3.1-8b", dp=2, router="skewed", max_num_seqs=2, max_num_batched_tokens=8192
    )
    twin = replay(
        Workload("trace", ("long",), tuple(long), {}, None),
        skewed,
        None,
        bands=DEFAULT_BANDS,
        sample_every=0.25,
    )
    assert twin.node.stranded_sample_share > 0.2 and twin.node.mean_stranded_tokens > 100_000
