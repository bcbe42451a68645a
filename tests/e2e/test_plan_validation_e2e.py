"""``kvwatch plan`` against the real CPU vLLM: calibrate on it, replay its real ledgers on the twin.

The error table is printed, and written as JSON and markdown to ``$PLAN_VALIDATION_OUT``
when that is set (docs/planning.md publishes one run). The issue's targets (e2e p50 15 %, p99
25 %, preemptions 20 %, peak KV 10 %) are recorded per row as met or missed. The assertions:
e2e p50 within 2x in sample for the Prometheus calibrations (within 3x out of sample: the other
trace's Prometheus fit and the calibration load, measured at another time), because on this shared
2-core machine the client, kvwatch's proxy, Prometheus and other work take CPU from vLLM
differently from one run to the next (a clean-clone CI run measured +31 % in sample where a quieter
one measured +4 %); a twin that is structurally wrong (a cost term missing, a unit slipped) is off
by factors, which this still catches. Peak KV within 10 % everywhere. The accuracy targets are
published, not asserted.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvwatch.cli import main
from kvwatch.model import LengthBands
from kvwatch.plan.calibration import load_calibration
from kvwatch.plan.candidate import CALIBRATED, Candidate
from kvwatch.plan.inputs import read_workload
from kvwatch.plan.replay import replay
from kvwatch.report import build_report
from tests.local import RealEngine, free_port, wait_vllm_idle

from .plan_validation import (
    BANDS,
    PeakPoll,
    compare,
    drive,
    make_trace,
    peak_kv,
    preemptions,
    split_ledger,
    table,
    unfinished,
)
from .stack import KvwatchRun, Prometheus, wait_until

pytestmark = [pytest.mark.real_vllm, pytest.mark.prometheus, pytest.mark.slow]

TRACE_A = make_trace(seed=161, count=28, rate=1.2, burst=6)
TRACE_B = make_trace(seed=162, count=28, rate=1.2, burst=6)
SHAPE_FLAGS = [
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "2048",
]  # vllm-cpu.sh and vLLM's CPU default


def _run_trace(real_vllm, agent: KvwatchRun, prom: Prometheus, trace, seed: int) -> dict:
    proxy = f"http://{agent.config['replicas'][0]['proxy_listen']}/v1"
    wait_vllm_idle(real_vllm.metrics_url, what="vLLM idle before the trace")
    before, started = preemptions(real_vllm.metrics_url), time.time()
    with PeakPoll(real_vllm.metrics_url) as poll:
        failed = unfinished(trace, drive(proxy, trace, seed))
    assert not failed, "\n".join(
        [
            *failed,
            "kvwatch's log ends:",
            agent.log()[-3000:],
            "vLLM's log ends:",
            real_vllm.log.read_text(errors="replace")[-3000:],
        ]
    )
    wait_vllm_idle(real_vllm.metrics_url, what="vLLM idle after the trace")
    ended = time.time()
    # Prometheus holds the trace's last samples: a scrape at or after the end the queries below read at
    wait_until(
        lambda: prom.query(f'timestamp(up{{job="vllm"}}) >= {ended + 2}'), 30, "a scrape after the trace"
    )
    return {
        "start": started,
        "end": ended,
        "preemptions": preemptions(real_vllm.metrics_url) - before,
        "peak_kv": max(peak_kv(prom.url, started, ended + 2), poll.peak),
    }


def _calibrate_on_prometheus(prom: Prometheus, engine: RealEngine, trace: dict, out: Path) -> None:
    """``kvwatch plan calibrate --prometheus`` over the windows of ``trace`` (its start and end, Unix
    seconds), as a user runs it after a load."""
    since = f"{int(trace['end'] - trace['start']) + 4}s"
    window = ["--since", since, "--until", str(trace["end"] + 2), "--window", "4s"]
    argv = ["plan", "calibrate", "--prometheus", prom.url, *window, "--engine-url", engine.base_url]
    assert main([*argv, *SHAPE_FLAGS, "-o", str(out)]) == 0


def test_twin_calibrated_on_the_real_vllm_replays_its_real_ledgers(real_vllm, tmp_path: Path, capsys):
    host = real_vllm.base_url.removeprefix("http://")
    prom = Prometheus(tmp_path, [host], job="vllm", interval="1s", rule_files=()).start()
    ledger = tmp_path / "ledger.jsonl"
    config = {
        "node": "plan-validation",
        "length_bands": list(BANDS),
        "nvml": {"enabled": False},
        "intervals": {"engine": "1s"},
        "ledger": {"path": str(ledger)},
        "replicas": [
            {
                "name": "vllm-0",
                "backend": "vllm",
                "metrics_url": real_vllm.metrics_url,
                "api_url": real_vllm.base_url,
                "proxy_listen": f"127.0.0.1:{free_port()}",
                "model_name": "tiny",
            }
        ],
    }
    agent = KvwatchRun(config, tmp_path).start()
    cal_load, cal_prom = tmp_path / "cal-load.yaml", tmp_path / "cal-prometheus.yaml"
    cal_prom_b = tmp_path / "cal-prometheus-b.yaml"
    try:
        wait_vllm_idle(real_vllm.metrics_url, what="vLLM idle before calibration")
        assert (
            main(["plan", "calibrate", "--load", real_vllm.base_url, *SHAPE_FLAGS, "-o", str(cal_load)]) == 0
        )
        (kept,) = [n for n in load_calibration(cal_load).notes if n.startswith("decode phases kept: ")]
        assert int(kept.split()[3]) >= 3, kept  # of 9: a load that kept fewer fits the decode from guesses
        a = _run_trace(real_vllm, agent, prom, TRACE_A, seed=1)
        _calibrate_on_prometheus(prom, real_vllm, a, cal_prom)
        b = _run_trace(real_vllm, agent, prom, TRACE_B, seed=2)
        _calibrate_on_prometheus(prom, real_vllm, b, cal_prom_b)
    finally:
        agent.stop()
        prom.stop()
    capsys.readouterr()
    ledger_a, ledger_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    split_ledger(ledger, b["start"], ledger_a, ledger_b)
    bands = LengthBands(BANDS)
    twin = Candidate(name="twin of the CPU vLLM", model=CALIBRATED, dp=1, step_model=CALIBRATED)
    rows, results = [], {}
    for case, cal_path, path, rec in (
        ("A on Prometheus(A) (in sample)", cal_prom, ledger_a, a),
        ("B on Prometheus(A)", cal_prom, ledger_b, b),
        ("B on Prometheus(B) (in sample)", cal_prom_b, ledger_b, b),
        ("B on calibration load", cal_load, ledger_b, b),
    ):
        cal = load_calibration(cal_path)
        result = replay(read_workload([str(path)]), twin, cal, bands=bands, sample_every=1.0)
        results[case] = result
        rows += compare(case, result, build_report([str(path)]), rec["preemptions"], rec["peak_kv"])
    text = table(rows)
    fits = {p.name: load_calibration(p).to_mapping() for p in (cal_load, cal_prom, cal_prom_b)}
    print(text)
    print(json.dumps(fits, indent=1))
    out = os.environ.get("PLAN_VALIDATION_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "plan-validation.md").write_text(text + "\n")
        (Path(out) / "plan-validation.json").write_text(
            json.dumps({"rows": rows, "fits": fits, "recorded": {"a": a, "b": b}}, indent=1)
        )
    with capsys.disabled():
        print("\n" + text)

    assert a["preemptions"] > 0 and b["preemptions"] > 0, "the traces must preempt on the real engine"
    for case, result in results.items():
        assert result.calibrated, case
        assert result.node.completed + result.node.truncated == len(
            read_workload([str(ledger_a if case.startswith("A") else ledger_b)]).requests
        )
    for row in rows:
        if row["band"] == "all" and "(in sample)" not in row["case"]:
            # calibrated minutes before the trace (the calibration load, or trace A's run), on what else
            # the machine ran then: -41 % on a quiet run, +97 % with two CPU hogs beside it, +70 % for
            # B on Prometheus(A) in a clean-clone CI run; a structural error is off by more than 3x.
            # The calibration load had a bound of 10x while its fit could drop the per-step overhead
            # (-78 % in a clean-clone run, docs/planning.md); since its decode step is measured over
            # tokens and weighed as the steps it spans, fourteen runs (five with a CPU-bound process
            # beside them, two clean-clone CI runs) measured -39 % to +65 % (that run: B in sample
            # +30 %, the engine faster during the trace than during the load)
            assert 1 / 3 < 1 + row["e2e_p50"]["error"] < 3, row
        elif row["band"] == "all":
            # the drift of a shared machine between runs is large, and a Prometheus fit has only 7-9
            # four-second windows (r2 0.35 in a full-suite run that measured +72 % in sample where
            # quieter runs measured -16 % to +31 %; docs/planning.md): within a factor of 2
            assert 1 / 2 < 1 + row["e2e_p50"]["error"] < 2, row
        if row["band"] == "node":
            assert abs(row["peak_kv"]["error"]) <= 0.10, row
            # preemption counts (0 to 14 per trace across runs) are recorded, not asserted: vLLM counts a
            # preemption when the request is scheduled again, and one step's order decides a few
