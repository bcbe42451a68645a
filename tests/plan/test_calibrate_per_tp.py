"""Calibration per layout: one fit per TP degree the source data has, and a candidate whose layout
was never observed is timed by the roofline (a preset) or cannot run (the calibrated engine), and
the output says so."""

import dataclasses
import json
import random

from kvwatch.cli import main
from kvwatch.mixin.slo import load_slo_file
from kvwatch.plan.calibration import load_calibration
from kvwatch.plan.candidate import CALIBRATED, Candidate, engine_config
from kvwatch.plan.compare import render_compare_text, sweep
from kvwatch.plan.inputs import read_workload
from kvwatch.plan.replay import step_model_words
from kvwatch.sim.steptime import StepCost

from .helpers import requests, tiny_engine, write_ledger

TP1 = StepCost(overhead_s=0.004, per_prefill_token_s=20e-6, per_decode_seq_s=0.0015)
# a TP=2 engine: the per-token work halves, the overhead grows by the all-reduces' latency
TP2 = StepCost(overhead_s=0.006, per_prefill_token_s=10e-6, per_decode_seq_s=0.0008)


def _samples(path, with_tp: bool = True) -> None:
    rng = random.Random(11)
    with path.open("w") as fh:
        for tp, cost in ((1, TP1), (2, TP2)):
            for _ in range(300):
                p, s = rng.choice([0, rng.randint(1, 2000)]), rng.randint(1, 8)
                ms = cost.seconds(p, s, 0) * 1e3 * (1 + rng.gauss(0, 0.01))
                line = {
                    "context_tokens": p,
                    "generation_tokens": s,
                    "num_context_reqs": int(p > 0),
                    "num_generation_reqs": s,
                    "elapsed_ms": ms,
                }
                if with_tp:
                    line["tp"] = tp
                fh.write(json.dumps(line) + "\n")


def _calibrate(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    _samples(steps)
    out = tmp_path / "cal.yaml"
    assert main(["plan", "calibrate", "--step-samples", str(steps), "-o", str(out)]) == 0
    return load_calibration(out), capsys.readouterr().out


def test_calibrate_keeps_a_fit_per_tp_degree(tmp_path, capsys):
    cal, out = _calibrate(tmp_path, capsys)
    assert cal.engine.tensor_parallel_size == 1 and cal.observed_tp == (1, 2)
    for tp, truth in ((1, TP1), (2, TP2)):
        fit = cal.fit_for(tp)
        assert fit is not None and fit.quality.observations == 300
        assert abs(fit.cost.per_decode_seq_s - truth.per_decode_seq_s) / truth.per_decode_seq_s < 0.05
        assert abs(fit.cost.overhead_s - truth.overhead_s) / truth.overhead_s < 0.1
    assert cal.fit_for(4) is None and cal.fit_for(2, pp=2) is None
    assert "TP=1:" in out and "TP=2:" in out


def test_data_without_a_tp_degree_is_one_fit_taken_as_tp1_or_the_given_tp(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    _samples(steps, with_tp=False)
    out = tmp_path / "cal.yaml"
    assert main(["plan", "calibrate", "--step-samples", str(steps), "--tp", "2", "-o", str(out)]) == 0
    cal = load_calibration(out)
    assert cal.observed_tp == (2,) and not cal.tp_fits and cal.fit_for(1) is None


def test_a_layout_never_observed_is_timed_by_the_roofline_and_says_so(tmp_path, capsys):
    cal, _ = _calibrate(tmp_path, capsys)
    seen = Candidate(name="tp2", model="llama-3.1-8b", tp=2, dp=4, step_model=CALIBRATED)
    unseen = Candidate(name="tp4", model="llama-3.1-8b", tp=4, dp=2, step_model=CALIBRATED)
    assert engine_config(seen, cal).step_cost == cal.fit_for(2).cost
    assert engine_config(unseen, cal).step_cost is None  # the roofline times it
    words, calibrated = step_model_words(unseen, cal)
    assert not calibrated and "never observed" in words and "TP=1, TP=2" in words
    assert step_model_words(seen, cal)[1]


def test_compare_names_how_each_candidate_was_timed(tmp_path, capsys):
    cal, _ = _calibrate(tmp_path, capsys)
    # the engine's shape, as --engine-url would have read it
    cal = dataclasses.replace(
        cal,
        engine=dataclasses.replace(
            cal.engine, block_size=16, num_gpu_blocks=80, max_model_len=1024, max_num_batched_tokens=2048
        ),
    )
    ledger = tmp_path / "ledger.jsonl"
    write_ledger(ledger, tiny_engine(), requests(60))
    workload = read_workload([str(ledger)])
    slo = load_slo_file("alerts/slo.yaml")
    # the calibrated engine itself: TP=1 and TP=2 use their fits; TP=4 and PP cannot run (no roofline)
    out = sweep(workload, slo.objectives, slo.bands, 4, CALIBRATED, grid="small", calibration=cal, jobs=1)
    by_layout = {(e.candidate.gpu, e.candidate.tp, e.candidate.pp): e for e in out}
    assert by_layout[("h200", 2, 1)].timed_by == "fit TP=2" and by_layout[("h200", 2, 1)].error is None
    assert by_layout[("h200", 1, 1)].timed_by == "fit TP=1"
    assert "never observed" in by_layout[("h200", 4, 1)].error
    assert "never observed" in by_layout[("h200", 2, 2)].error
    # its blocks and step times are the calibration's on any GPU type: one type, not three priced apart
    assert {e.candidate.gpu for e in out} == {"h200"}
    text = render_compare_text(out, workload, 40, {}, cal, 4)
    # the layouts it never saw cannot run, and are listed so; the header does not call them roofline-timed
    assert (
        "cannot run" in text and "their layout was never observed" not in text and "for the other" not in text
    )
    # a preset measured on H200: its unobserved layouts fall back to the roofline, and the text says so
    out = sweep(
        workload,
        slo.objectives,
        slo.bands,
        4,
        "llama-3.1-8b",
        grid="small",
        calibration=cal,
        jobs=1,
        calibrated_on="h200",
    )
    by_layout = {(e.candidate.gpu, e.candidate.tp, e.candidate.pp): e for e in out}
    assert by_layout[("h200", 4, 1)].timed_by == "roofline (never observed)"
    assert by_layout[("h200", 2, 1)].timed_by == "fit TP=2"
    assert by_layout[("b200", 2, 1)].timed_by == "roofline"
    text = render_compare_text(out, workload, 40, {}, cal, 4)
    assert "their layout was never observed" in text and "roofline (never observed)" in text
    assert "the UNCALIBRATED datasheet roofline for the other" in text


def test_the_calibrated_engine_is_swept_on_the_gpu_type_it_was_measured_on():
    from kvwatch.plan.compare import hardware_grid

    assert {c.gpu for c in hardware_grid(4, CALIBRATED, ("auto",))} == {"h200"}
    assert {c.gpu for c in hardware_grid(4, CALIBRATED, ("auto",), calibrated_on="h100")} == {"h100"}
    assert {c.gpu for c in hardware_grid(4, "llama-3.1-8b", ("auto",))} == {"h100", "h200", "b200"}


def test_a_prometheus_series_without_a_usable_tp_label_is_refused_by_name():
    from kvwatch.plan.prometheus import _tp_of
    from kvwatch.plan.sources import SourceError

    assert _tp_of("2", "tp", ("node1:8000", "0", "2")) == 2
    assert _tp_of(None, None, ("node1:8000", "0", None)) is None  # no --tp-label: the degree is unknown
    for bad in (None, "two", "0"):
        try:
            _tp_of(bad, "tp", ("node1:8000", "0", bad))
        except SourceError as exc:
            assert "instance='node1:8000'" in str(exc) and f"tp={bad!r}" in str(exc)
        else:
            raise AssertionError(f"tp={bad!r} was accepted")


def test_replay_of_a_calibration_measured_at_tp2_is_the_tp2_engine(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    _samples(steps, with_tp=False)
    cal = tmp_path / "cal.yaml"
    assert main(["plan", "calibrate", "--step-samples", str(steps), "--tp", "2", "-o", str(cal)]) == 0
    loaded = load_calibration(cal)
    shaped = dataclasses.replace(
        loaded,
        engine=dataclasses.replace(
            loaded.engine, block_size=16, num_gpu_blocks=80, max_model_len=1024, max_num_batched_tokens=2048
        ),
    )
    shaped.dump(cal)
    ledger = tmp_path / "ledger.jsonl"
    write_ledger(ledger, tiny_engine(), requests(30))
    capsys.readouterr()
    assert main(["plan", "replay", str(ledger), "--calibration", str(cal)]) == 0
    assert "step time: calibrated at TP=2" in capsys.readouterr().out
