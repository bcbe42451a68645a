"""Every bench's ``--quick`` run still works, so no bench rots unseen (slow: run with ``-m slow``).

A bench runs as its README line says (``.venv/bin/python bench/NAME.py``), from the repository root,
with this checkout first on the path. A bench not in QUICK must be in NO_QUICK_YET with the reason,
so a new bench cannot slip past both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

#: bench -> the arguments of its quick run (seconds each on a quiet machine; sim_bench ~40 s shared)
QUICK: dict[str, tuple[str, ...]] = {
    "discovery_bench.py": (),  # ~3 s as it is
    "exposition_parse.py": ("--quick",),
    "fleet_bench.py": ("--nodes", "1", "--interval", "1", "--window", "3", "--phases", "full"),
    "nvml_smoke.py": ("--fake", "2", "--quick"),
    "report_bench.py": ("--quick",),
    "plan_bench.py": ("--quick",),
    "proxy_bench.py": ("--quick",),  # direct, nginx, kvwatch: 8 streams, 1 s, one round
    "sim_bench.py": ("--quick",),
}
#: benches without a quick run yet, and why (each one is a gap, not a decision)
NO_QUICK_YET = {
    "agent_bench.py": "no --quick yet",
    "node_rate.py": "no --quick yet (a ramp of real nginx and proxy runs)",
    "exposition_size.py": "no --quick yet (its --scrapes 20 run takes a minute)",
    "cpu_vllm_decode_gaps.py": "drives a running vLLM (bench/cpu_vllm_tp.sh starts it)",
    "http1_bench.py": "needs --baseline, another checkout's http1.py",
    "kv_signals_accuracy.py": "imports tests/derive/simulated.py",
    "otlp_loop_lag.py": "no --quick yet",
    "otlp_offset_bench.py": "starts the real CPU vLLM",
    "plan_study.py": "no --quick that runs in seconds (a quarter of the study)",
    "plan_study_hostcost.py": "no --quick that runs in seconds (a quarter of the study)",
    "relay_bench.py": "needs --baseline, another checkout's proxy module",
    "vllm_plugin_bench.py": "runs in the real vLLM venv",
}


def test_every_bench_is_run_quick_or_says_why_not() -> None:
    benches = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert benches == set(QUICK) | set(NO_QUICK_YET), "add the bench to QUICK (or NO_QUICK_YET, saying why)"
    assert not set(QUICK) & set(NO_QUICK_YET)


@pytest.mark.slow
@pytest.mark.parametrize("bench", sorted(QUICK))
def test_bench_quick_run_works(bench: str) -> None:
    run_quick(bench, QUICK[bench])


@pytest.mark.slow
def test_proxy_bench_late_tail_quick_run_works() -> None:
    """The proxy bench's other scenario: [DONE] long before the stream ends, reused connections."""
    run_quick("proxy_bench.py", ("--quick", "--scenario", "late-tail"))


def run_quick(bench: str, args: tuple[str, ...]) -> None:
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, str(BENCH / bench), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"{bench} --quick failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{bench} --quick printed nothing"
