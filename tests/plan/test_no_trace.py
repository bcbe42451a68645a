"""`kvwatch plan replay` and `kvwatch plan compare` with no ledger or trace: the demo's default
workload on the demo's default node, so one command shows a plan."""

import subprocess
import sys

from kvwatch.plan.inputs import demo_workload_requests
from kvwatch.sim.presets import demo_workload
from kvwatch.sim.workload import generate


def _kvwatch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvwatch", *args], check=False, capture_output=True, text=True, timeout=300
    )


def test_the_default_workload_is_the_demos_first_simulated_hour():
    workload = demo_workload_requests()
    expected = list(generate(demo_workload(0, hours=1), duration=3600.0))
    assert [r.request_id for r in workload.requests] == [r.request_id for r in expected]
    assert 3000 < len(workload.requests) < 5000 and workload.requests[-1].arrival < 3600.0
    # the demo's clients give up after 120 s without a first token: that is replayed too
    assert all(r.first_token_patience == 120.0 for r in workload.requests)
    assert len(demo_workload_requests(limit=50).requests) == 50


def test_replay_with_no_trace_replays_the_demo_workload_on_the_demo_node():
    run = _kvwatch("plan", "replay", "--limit", "400")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "400 requests from demo workload: reasoning at 1/s" in out
    assert "twin: 8 GPU(s): qwen3-32b, 8xh200" in out and "UNCALIBRATED" in out
    # no recorded side: the band table has the twin alone, with the demo's reasoning bands filled
    assert "(recorded, error)" not in out
    assert "10k-20k" in out and "completed requests per GPU-hour" in out


def test_compare_with_no_trace_uses_the_demo_workload_default_slo_and_eight_gpus():
    run = _kvwatch("plan", "compare", "--grid", "small", "--limit", "150", "--jobs", "2", "--top", "3")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "150 requests from demo workload" in out
    assert "48 candidates" in out  # 3 GPU types x 16 layouts of up to 8 GPUs (the demo node's count)
    assert "margin per band" in out
