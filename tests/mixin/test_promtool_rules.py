"""`promtool test rules` on the hand-written cases, their coverage, and proof that they can fail.

The cases live in tests/mixin/promtool/*.test.yaml (runnable by hand with promtool). Here: every
file passes; every alert kvwatch ships has a case where it fires and one where it must not; and
mutating a rule the way a plausible bug would (a wrong burn factor, no traffic guard, an
un-normalised ``le``, ...) makes the cases fail.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from kvwatch.mixin import alerts, rules
from kvwatch.mixin.rulefile import alert_names
from kvwatch.mixin.rules import FLEET_FILE, NODE_FILE, BurnWindow, Severity, render_rule_files, rule_files
from kvwatch.mixin.slo import load_slo_file

from .helpers import ALERTS, PROMTOOL_TESTS, run_tool, tool

TEST_FILES = sorted(PROMTOOL_TESTS.glob("*.test.yaml"))
_ALERTS_SELECTOR = re.compile(r'ALERTS\{[^}]*alertname="(\w+)"')


def _promtool_test(path: Path) -> tuple[Path, int, str]:
    result = run_tool(tool("promtool"), "test", "rules", path.name, cwd=path.parent, timeout=600)
    return path, result.returncode, result.stdout + result.stderr


def test_every_promtool_case_passes() -> None:
    assert len(TEST_FILES) >= 5
    with ThreadPoolExecutor(max_workers=2) as pool:  # the slow SLO files in parallel, on two cores
        results = list(pool.map(_promtool_test, TEST_FILES))
    failed = [f"{path.name}:\n{output}" for path, rc, output in results if rc != 0]
    assert not failed, "\n".join(failed)


def _cases() -> dict[str, dict[str, int]]:
    """alert name -> {"fires": n, "quiet": n} over every test file."""
    seen: dict[str, dict[str, int]] = {}
    for path in TEST_FILES:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                kind = "fires" if case.get("exp_alerts") else "quiet"
                seen.setdefault(case["alertname"], {"fires": 0, "quiet": 0})[kind] += 1
            for case in test.get("promql_expr_test", []):
                m = _ALERTS_SELECTOR.search(case["expr"])
                if m:
                    kind = "fires" if case.get("exp_samples") else "quiet"
                    seen.setdefault(m.group(1), {"fires": 0, "quiet": 0})[kind] += 1
    return seen


def test_every_shipped_alert_has_a_case_that_fires_and_one_that_must_not() -> None:
    cases = _cases()
    names = alert_names(rule_files(load_slo_file(ALERTS / "slo.yaml")))
    missing = [n for n in names if cases.get(n, {}).get("fires", 0) == 0 or cases[n]["quiet"] == 0]
    assert not missing, f"alerts without a firing and a non-firing promtool case: {missing}"
    assert set(cases) <= set(names), f"cases for alerts that do not exist: {set(cases) - set(names)}"


def test_every_case_file_orders_recording_groups_before_the_alerts_that_read_them() -> None:
    """Without group_eval_order promtool evaluates groups in a random order; an alert evaluated
    before its recording rule sees the previous step's value (or none, at coarse steps): flaky."""
    for path in TEST_FILES:
        doc = yaml.safe_load(path.read_text())
        groups = [
            g["name"]
            for f in doc["rule_files"]
            for g in yaml.safe_load((path.parent / f).read_text())["groups"]
        ]
        assert doc.get("group_eval_order") == groups, path.name


# --------------------------------------------------------------------------------------------
# the cases can fail: mutate the rules, the cases must catch it
# --------------------------------------------------------------------------------------------


def _mutated_run(tmp_path: Path, case_file: str, only: str, slo_path: Path) -> tuple[int, str]:
    """Render rules (with whatever the test monkeypatched) into tmp_path, point a copy of
    ``case_file`` (the tests whose name contains ``only``) at them, run promtool."""
    files = render_rule_files(rule_files(load_slo_file(slo_path)))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    doc = yaml.safe_load((PROMTOOL_TESTS / case_file).read_text())
    doc["rule_files"] = [Path(f).name for f in doc["rule_files"]]
    doc["tests"] = [t for t in doc["tests"] if only in t["name"]]
    assert doc["tests"], f"no test named like {only!r} in {case_file}"
    (tmp_path / case_file).write_text(yaml.safe_dump(doc, sort_keys=False))
    _, rc, output = _promtool_test(tmp_path / case_file)
    return rc, output


SLO_CASES = PROMTOOL_TESTS / "slo.yaml"


def test_unmutated_rules_pass_the_cases_the_mutations_use(tmp_path) -> None:
    runs = [
        ("slo-page.test.yaml", "", SLO_CASES),
        ("kv.test.yaml", "", ALERTS / "slo.yaml"),
        ("gpu-self.test.yaml", "XID", ALERTS / "slo.yaml"),
    ]
    for case_file, only, slo in runs:
        sub = tmp_path / case_file
        sub.mkdir()
        rc, output = _mutated_run(sub, case_file, only, slo)
        assert rc == 0, output


def test_a_page_factor_below_14_4_is_caught(tmp_path, monkeypatch) -> None:
    page = Severity("critical", (BurnWindow("1h", "5m", 13.5), BurnWindow("6h", "30m", 6.0)), "2m", "fast")
    monkeypatch.setattr(rules, "SEVERITIES", (page, rules.SEVERITIES[1]))
    rc, output = _mutated_run(tmp_path, "slo-page.test.yaml", "just below 14.4x", SLO_CASES)
    assert rc != 0 and "KVWatchLatencyBudgetBurn" in output


def test_a_missing_traffic_guard_is_caught(tmp_path) -> None:
    slo = tmp_path / "slo.yaml"
    slo.write_text(SLO_CASES.read_text().replace("min_requests: 20", "min_requests: 1"))
    rc, output = _mutated_run(tmp_path, "slo-page.test.yaml", "quiet band", slo)
    assert rc != 0 and "KVWatchLatencyBudgetBurn" in output


def test_an_le_string_kvwatch_does_not_export_is_caught(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(rules, "le_label", lambda bound: f"{bound:.3f}")  # "0.060": matches no series
    rc, output = _mutated_run(tmp_path, "slo-page.test.yaml", "just above 14.4x", SLO_CASES)
    assert rc != 0 and "KVWatchLatencyBudgetBurn" in output


def _with_alert_knobs(tmp_path: Path, slo: Path, section: str) -> Path:
    """A copy of the SLO file ``slo`` with an ``alerts:`` section (YAML text) appended."""
    out = tmp_path / "slo-knobs.yaml"
    out.write_text(slo.read_text() + "\n" + section)
    return out


def test_a_kv_pressure_threshold_off_by_a_little_is_caught(tmp_path) -> None:
    slo = _with_alert_knobs(tmp_path, ALERTS / "slo.yaml", "alerts: {thresholds: {kv_pressure_usage: 0.98}}")
    rc, output = _mutated_run(tmp_path, "kv.test.yaml", "KV cache nearly full", slo)
    assert rc != 0 and "KVWatchKVCachePressure" in output


def test_the_overridden_threshold_case_fails_on_the_default_rules(tmp_path) -> None:
    """overrides.test.yaml passes on rules from an SLO file with knobs set (test_every_promtool_case_passes);
    on rules with the defaults it must fail, so it really tests the override."""
    slo = tmp_path / "slo-defaults.yaml"
    slo.write_text(SLO_CASES.read_text().split("\nalerts:")[0])
    rc, output = _mutated_run(tmp_path, "overrides.test.yaml", "overridden", slo)
    assert rc != 0 and "KVWatchKVCachePressure" in output


def test_missing_the_first_xid_of_a_gpu_is_caught(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(alerts, "counter_rose", lambda series, window: f"increase({series}[{window}]) > 0")
    rc, output = _mutated_run(tmp_path, "gpu-self.test.yaml", "counter first appears", ALERTS / "slo.yaml")
    assert rc != 0 and "KVWatchGPUCriticalXID" in output


def test_starvation_that_ignores_abandonment_is_caught(tmp_path) -> None:
    slo = _with_alert_knobs(
        tmp_path, ALERTS / "slo.yaml", "alerts: {thresholds: {starving_aborted_ratio: 0.5}}"
    )
    rc, output = _mutated_run(tmp_path, "kv.test.yaml", "starvation", slo)
    assert rc != 0 and "KVWatchLongRequestsStarving" in output


@pytest.mark.parametrize(
    ("case", "files"),
    [
        ("kv.test.yaml", [NODE_FILE, FLEET_FILE]),
        ("gpu-self.test.yaml", [NODE_FILE]),
    ],
)
def test_cases_read_the_committed_rule_files(case, files) -> None:
    """The operational cases point at alerts/ itself, so what they test is what ships."""
    doc = yaml.safe_load((PROMTOOL_TESTS / case).read_text())
    assert [(PROMTOOL_TESTS / f).resolve() for f in doc["rule_files"]] == [
        (ALERTS / f).resolve() for f in files
    ]
