"""Every bench's ``--quick`` run still works, so no bench rots unseen (slow: run with ``-m slow``).

A bench runs as its usage line says (``.venv/bin/python -m bench.NAME``, or as a file for the two
in RUN_AS_FILES), from the repository root, with this checkout first on the path. A bench not in
QUICK must be in RUN_AS_FILES with its own quick test, so a new bench cannot slip past both; and no
bench changes ``sys.path`` or imports a test module or a private name of the tests' helpers (benches
share the tests' public helper modules only).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


class Quick(NamedTuple):
    args: tuple[str, ...]  # the quick run's arguments
    ends_with: str  # printed at the end of a run that went all the way through (not on an early exit)
    marks: tuple[pytest.MarkDecorator, ...] = ()


#: bench -> its quick run: all of them 4 min on the shared 2-core machine, a few seconds each but
#: plan_bench and sim_bench (~40 s) and the two that start the real vLLM
QUICK: dict[str, Quick] = {
    "agent_bench.py": Quick(("--quick",), "CPUs"),  # ~7 s
    "cpu_vllm_decode_gaps.py": Quick(("--quick",), '"decode_step_s"'),  # kvwatch's simulated vLLM, ~2 s
    "discovery_bench.py": Quick(("--quick",), "per event"),  # ~1 s
    "exposition_parse.py": Quick(("--quick",), "(synthetic)"),
    "exposition_size.py": Quick(("--quick",), "| full | "),  # ~7 s: the reference node, twice
    "fleet_bench.py": Quick(("--nodes", "1", "--interval", "1", "--window", "3", "--phases", "full"), "|"),
    "http1_bench.py": Quick(("--quick",), "| request head |"),  # this checkout's http1.py against itself
    "kv_signals_accuracy.py": Quick(("--quick",), "cost per scrape"),  # ~1 s
    "live_tokens_demo.py": Quick(("--quick",), "readings by outcome"),  # the demo's node, ~12 s
    "nvml_smoke.py": Quick(("--fake", "2", "--quick"), "GPU 1 "),
    "otlp_loop_lag.py": Quick(("--quick",), "gzip bomb"),  # ~4 s
    # the real CPU vLLM with its OTLP exporter and `vllm bench serve`: ~1.5 min, most of it start-up
    "otlp_offset_bench.py": Quick(("--quick",), '"output_tokens_equal": true', (pytest.mark.real_vllm,)),
    "plan_bench.py": Quick(("--quick",), "projected"),  # ~40 s
    "plan_study.py": Quick(("--quick",), "s wall"),  # ~8 s
    "plan_study_hostcost.py": Quick(("--quick",), "|"),  # ~2 s
    "relay_bench.py": Quick(("--quick",), "| vLLM chat chunk"),  # this checkout against itself, ~5 s
    "report_bench.py": Quick(("--quick",), "machine:"),
    "sim_bench.py": Quick(("--quick",), "max sustained speed factor"),  # ~45 s
    "vllm_plugin_bench.py": Quick(("--quick",), "series per replica", (pytest.mark.real_vllm,)),  # ~25 s
}
#: benches that run as files (``.venv/bin/python bench/NAME.py``), not with ``-m``: their roles run
#: the script again with a ``--baseline`` checkout's kvwatch importable; their quick runs are below
RUN_AS_FILES = {
    "node_rate.py": "its roles (upstreams, agents) run the script itself; quick run below",
    "proxy_bench.py": "its roles (upstream, kvwatch, relays) run the script itself; quick runs below",
}


def _benches() -> set[str]:
    return {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")}


def test_every_bench_is_run_quick_or_says_why_not() -> None:
    assert _benches() == set(QUICK) | set(RUN_AS_FILES), (
        "add the bench to QUICK (or RUN_AS_FILES, with a quick test)"
    )
    assert not set(QUICK) & set(RUN_AS_FILES)


def _test_helper_imports(tree: ast.Module) -> list[str]:
    """``from tests...`` imports of a test module (``test_*``) or of a private name."""
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests":
            module = node.module or ""
            if any(part.startswith("test_") for part in module.split(".")):
                wrong.append(module)
            wrong += [f"{module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            wrong += [a.name for a in node.names if a.name.split(".")[0] == "tests"]
    return wrong


def _changes_sys_path(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
        for node in ast.walk(tree)
    )


def test_benches_import_the_tests_public_helpers_only() -> None:
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        assert not _test_helper_imports(tree), f"{path.name}: {_test_helper_imports(tree)}"
        assert not _changes_sys_path(tree), f"{path.name} changes sys.path: run it with -m instead"


def test_the_import_check_catches_what_the_benches_used_to_do() -> None:
    before = (
        "import sys\nsys.path.insert(0, 'tests')\n"
        "from tests.discovery.fake_apiserver import _conditions\n"
        "from tests.derive.test_against_simulator import derive_each\n"
    )
    tree = ast.parse(before)
    assert _test_helper_imports(tree) == [
        "tests.discovery.fake_apiserver._conditions",
        "tests.derive.test_against_simulator",
    ]
    assert _changes_sys_path(tree)
    assert not _test_helper_imports(ast.parse("from tests.derive.simulated import derive_each\n"))


@pytest.mark.slow
@pytest.mark.parametrize("bench", [pytest.param(name, marks=QUICK[name].marks) for name in sorted(QUICK)])
def test_bench_quick_run_works(bench: str) -> None:
    quick = QUICK[bench]
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{Path(bench).stem}", *quick.args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, f"{bench} --quick failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{bench} --quick printed nothing"
    assert quick.ends_with in proc.stdout, f"{bench} --quick stopped early:\n{proc.stdout[-2000:]}"


def _quick_as_file(bench: str, *args: str) -> subprocess.CompletedProcess[str]:
    """bench/NAME --quick, run as a file with this checkout's kvwatch importable."""
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return subprocess.run(
        [sys.executable, str(BENCH / bench), "--quick", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["streaming", "late-tail"])
def test_proxy_bench_quick_runs_as_a_file(scenario: str) -> None:
    """bench/proxy_bench.py's roles (upstream, kvwatch, relays) run as the script itself, with the
    kvwatch of this checkout or of a ``--baseline`` one: it runs as a file, not with ``-m``."""
    proc = _quick_as_file("proxy_bench.py", "--scenario", scenario)
    assert proc.returncode == 0, f"proxy_bench --quick failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert "| kvwatch-uvloop |" in proc.stdout and "; cores " in proc.stdout, proc.stdout[-2000:]
    if scenario == "late-tail":  # every row says how bunched its arrivals were, and the lengths drawn
        rows = [line for line in proc.stdout.splitlines() if line.startswith(("| direct |", "| kvwatch"))]
        assert len(rows) == 2 and all(re.match(r"\| \S+ \| \d+ \| \d+% \|", r) for r in rows), rows
        assert "upstream: 10-30 chunks" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_proxy_bench_nginx_meter_accounts_every_request() -> None:
    """The ``nginxlua`` target (bench/proxybench/nginx_meter.lua in Debian's nginx with
    libnginx-mod-http-lua) sends what the agent's ChannelReceiver accepts, and its totals agree
    with what the clients counted: the bench checks that before it measures, and exits 1 if not."""
    proc = _quick_as_file("proxy_bench.py", "--targets", "nginx,nginxlua")
    assert proc.returncode == 0, f"proxy_bench nginxlua failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert "# nginxlua accounting matches the clients" in proc.stderr, proc.stderr[-2000:]
    assert "| nginxlua |" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_node_rate_quick_runs_as_a_file() -> None:
    """bench/node_rate.py --quick: one step of direct, nginx, the agent in process and with 2 relay
    workers, on 8 paced upstreams, and no target drops a chunk or fails a stream (its latency verdicts
    are not asserted: a quick step's 160 chunks a target make a p99 that means nothing)."""
    proc = _quick_as_file("node_rate.py")
    assert proc.returncode == 0, f"node_rate --quick failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    for target in ("nginx", "kvwatch", "kvwatch-2w"):
        assert f"| 1 | {target} |" in proc.stdout and f"{target}: sustainable" in proc.stdout, proc.stdout
    assert "dropped" not in proc.stdout, proc.stdout


def test_core_quota_uses_the_shortest_period_the_kernel_allows() -> None:
    """node_rate's emulated cores: the quota is never below the kernel's 1 ms minimum, and the
    period is as short as that allows, so a throttled proxy waits at most period - quota."""
    from bench.proxybench.cores import period_and_quota

    assert period_and_quota(0.1) == (10_000, 1_000)
    assert period_and_quota(0.5) == (2_000, 1_000)
    assert period_and_quota(2.0) == (1_000, 2_000)
    period, quota = period_and_quota(0.15)
    assert quota == 1_000 and abs(quota / period - 0.15) < 1e-3
    with pytest.raises(SystemExit, match="--core-quota"):
        period_and_quota(0.0)
