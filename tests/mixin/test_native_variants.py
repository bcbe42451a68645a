"""``kvwatch rules --native`` / ``kvwatch dashboards --native``: the native-histogram variants are
committed and current, read only the native series of the families kvwatch sends natively, and differ
from the classic files in nothing but how they read histograms. (They are evaluated on a real
Prometheus scraping the native exposition in tests/e2e/test_native_histograms_e2e.py: promtool 2.42's
test series notation has no native histograms.)"""

from __future__ import annotations

import json

import pytest
import yaml

from kvwatch.cli import main as cli
from kvwatch.mixin import grafana as g
from kvwatch.mixin.dashboards import boards
from kvwatch.mixin.dashboards.check import name_problems as dashboard_name_problems
from kvwatch.mixin.dashboards.scaffold import Options
from kvwatch.mixin.promql import NATIVE_FAMILIES, referenced_metrics, unknown_names
from kvwatch.mixin.rulefile import name_problems
from kvwatch.mixin.rules import LEVELS, rule_files
from kvwatch.mixin.slo import load_slo_file
from kvwatch.state import PREBINNED_FAMILIES

from .helpers import ALERTS, ROOT, run_tool, tool

NATIVE_ALERTS = ALERTS / "native"
NATIVE_DASHBOARDS = ROOT / "dashboards" / "native"
CLASSIC_SUFFIXES = ("_bucket", "_count", "_sum")


def _classic_reads(expr: str) -> set[str]:
    return {
        n for n in referenced_metrics(expr) for f in NATIVE_FAMILIES for s in CLASSIC_SUFFIXES if n == f + s
    }


def _rules(path) -> list[dict]:
    return [r for group in yaml.safe_load(path.read_text())["groups"] for r in group["rules"]]


@pytest.mark.parametrize(
    "command",
    [
        ["rules", "--slo", str(ALERTS / "slo.yaml"), "--native", "--out", str(NATIVE_ALERTS), "--check"],
        ["dashboards", "--native", "--out", str(NATIVE_DASHBOARDS), "--check"],
    ],
    ids=["rules", "dashboards"],
)
def test_committed_native_variants_are_up_to_date(command, capsys) -> None:
    assert cli(command) == 0, capsys.readouterr().out


def test_native_goes_to_its_own_directory_by_default(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "alerts").mkdir()
    (tmp_path / "alerts" / "slo.yaml").write_text((ALERTS / "slo.yaml").read_text())
    assert cli(["rules", "--native"]) == 0
    assert cli(["dashboards", "--native"]) == 0
    assert sorted(p.name for p in (tmp_path / "alerts" / "native").iterdir()) == sorted(LEVELS)
    assert not list((tmp_path / "alerts").glob("*.rules.yaml"))  # the classic files are not touched
    # only the board that reads histograms, under its own uid (Grafana's provider reads dashboards/
    # recursively: the same uid twice would be a conflict)
    assert [p.name for p in (tmp_path / "dashboards" / "native").iterdir()] == [
        "kvwatch-latency-by-band-native.json"
    ]
    uids = {b.uid for b in boards()} | {b.uid for b in boards(Options(native=True))}
    assert len(uids) == 4
    assert "--native" in (tmp_path / "alerts" / "native" / "kvwatch-slo.rules.yaml").read_text()


@pytest.mark.parametrize("name", sorted(LEVELS))
def test_every_native_rule_file_passes_promtool_check_rules(name) -> None:
    result = run_tool(tool("promtool"), "check", "rules", NATIVE_ALERTS / name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_native_rules_read_no_classic_series_of_a_native_family_and_the_classic_ones_no_native_series():
    native_reads, classic_reads = set(), set()
    for name in LEVELS:
        for rule in _rules(NATIVE_ALERTS / name):
            assert not _classic_reads(rule["expr"]), rule
            native_reads |= referenced_metrics(rule["expr"]) & NATIVE_FAMILIES
        for rule in _rules(ALERTS / name):
            classic_reads |= referenced_metrics(rule["expr"]) & NATIVE_FAMILIES
    assert not classic_reads
    # the SLIs' three latency families and the plugin's preemption counts
    assert native_reads == {
        "kvwatch_request_ttft_seconds",
        "kvwatch_request_tpot_seconds",
        "kvwatch_request_duration_seconds",
        "kvwatch_request_preemptions",
    }


def test_native_and_classic_rule_files_differ_only_in_expressions_that_read_histograms() -> None:
    for name in LEVELS:
        classic, native = _rules(ALERTS / name), _rules(NATIVE_ALERTS / name)
        assert len(classic) == len(native)
        for c, n in zip(classic, native, strict=True):
            assert {k: v for k, v in c.items() if k != "expr"} == {k: v for k, v in n.items() if k != "expr"}
            if c["expr"] != n["expr"]:
                assert _classic_reads(c["expr"]), (c, n)


def test_native_dashboards_read_native_series_except_the_prebinned_gap_histogram() -> None:
    classic_left = set()
    for board in boards(Options(native=True)):
        for panel in board.panels:
            for q in g.queries_of(panel):
                classic_left |= {n for n in referenced_metrics(q.expr) if n.endswith("_bucket")}
                assert not _classic_reads(q.expr), (board.uid, panel["title"], q.expr)
    # what has no native form stays classic: the pre-binned gaps and the plugin's step times
    step = "kvwatch_engine_step_seconds_bucket"
    assert classic_left == {f"{f}_bucket" for f in PREBINNED_FAMILIES} | {step}
    assert not dashboard_name_problems(boards(Options(native=True)), native=True)
    classic = {b.uid: json.dumps(b.json()) for b in boards()}
    assert all(f not in text for f in (f"{n}{{" for n in NATIVE_FAMILIES) for text in classic.values())


def test_the_native_check_refuses_a_classic_bucket_of_a_native_family_and_allows_the_native_series() -> None:
    expr = "histogram_quantile(0.9, sum by (le) (rate(kvwatch_request_ttft_seconds_bucket[5m])))"
    assert unknown_names(expr) == []
    (problem,) = unknown_names(expr, native=True)
    assert "kvwatch_request_ttft_seconds_bucket is a classic series of a native histogram" in problem
    assert unknown_names("histogram_count(rate(kvwatch_request_ttft_seconds[5m]))", native=True) == []
    # a pre-binned family has no native series: its bare name is no kvwatch series
    assert unknown_names("histogram_count(rate(kvwatch_request_inter_chunk_seconds[5m]))")
    files = rule_files(load_slo_file(ALERTS / "slo.yaml"))
    assert name_problems(files, native=True)  # the classic rules read _bucket / _count
    assert not name_problems(files)
