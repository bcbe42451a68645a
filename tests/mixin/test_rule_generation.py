"""`kvwatch rules`: the generated files, their names and labels, the metric check and --check."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from kvwatch import buckets
from kvwatch.cli import main as cli
from kvwatch.mixin import alerts as alerts_mod
from kvwatch.mixin.promql import referenced_selectors, unknown_names
from kvwatch.mixin.rulefile import SEVERITIES, Alert, Group, Recording, RuleFile, alert_names, name_problems
from kvwatch.mixin.rules import SEVERITIES as BURNS
from kvwatch.mixin.rules import SLO_FILE, burn_alert, render_rule_files, rule_files
from kvwatch.mixin.slo import load_slo_file, slo_from_mapping
from kvwatch.state import HISTOGRAM_FAMILIES, Histogram

from .helpers import ALERTS, PROMTOOL_TESTS, ROOT, run_tool, tool

RULE_FILES = ("kvwatch-recording.rules.yaml", "kvwatch-slo.rules.yaml", "kvwatch-operational.rules.yaml")


def _default_files() -> list[RuleFile]:
    return rule_files(load_slo_file(ALERTS / "slo.yaml"))


def _rules(*args: str | Path) -> int:
    return cli(["rules", "--slo", str(ALERTS / "slo.yaml"), *map(str, args)])


def _loaded(path: Path) -> list[dict]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


# --------------------------------------------------------------------------------------------
# committed files are what the generator writes
# --------------------------------------------------------------------------------------------


def test_committed_alert_rules_are_up_to_date(capsys) -> None:
    assert _rules("--out", ALERTS, "--check") == 0, capsys.readouterr().out


def test_committed_promtool_test_rules_are_up_to_date(capsys) -> None:
    slo = PROMTOOL_TESTS / "slo.yaml"
    out = PROMTOOL_TESTS / "generated"
    rc = cli(["rules", "--slo", str(slo.relative_to(ROOT)), "--out", str(out), "--check"])
    assert rc == 0, capsys.readouterr().out


def test_check_fails_with_a_diff_when_a_committed_file_was_edited(tmp_path, capsys) -> None:
    shutil.copytree(ALERTS, tmp_path / "alerts")
    target = tmp_path / "alerts" / "kvwatch-operational.rules.yaml"
    edited = target.read_text().replace("kvwatch_kv_usage_ratio > 0.95", "kvwatch_kv_usage_ratio > 0.99")
    target.write_text(edited)
    rc = _rules("--out", tmp_path / "alerts", "--check")
    out = capsys.readouterr().out
    assert rc == 1
    assert "-          (kvwatch_kv_usage_ratio > 0.99)" in out
    assert "+          (kvwatch_kv_usage_ratio > 0.95)" in out
    assert "out of date; run: kvwatch rules" in out
    assert "0.99" in target.read_text()  # --check writes nothing


def test_check_fails_when_a_file_is_missing(tmp_path, capsys) -> None:
    out_dir = tmp_path / "alerts"
    assert _rules("--out", out_dir) == 0
    (out_dir / SLO_FILE).unlink()
    assert _rules("--out", out_dir, "--check") == 1
    assert "missing" in capsys.readouterr().out


def test_generation_is_deterministic() -> None:
    assert render_rule_files(_default_files()) == render_rule_files(_default_files())


def test_runbook_base_is_configurable(tmp_path) -> None:
    base = "https://runbooks.example.com/kvwatch"
    assert _rules("--out", tmp_path, "--runbook-base", base) == 0
    urls = [r["annotations"]["runbook_url"]
            for f in RULE_FILES for r in _loaded(tmp_path / f) if "alert" in r]
    assert urls and all(re.fullmatch(re.escape(base) + r"/KVWatch\w+\.md", u) for u in urls)


def test_job_label_of_the_kvwatch_targets_is_configurable(tmp_path) -> None:
    assert _rules("--out", tmp_path, "--job", "gpu-agents") == 0
    text = (tmp_path / "kvwatch-operational.rules.yaml").read_text()
    assert 'absent(up{job="gpu-agents"})' in text and 'job="kvwatch"' not in text


# --------------------------------------------------------------------------------------------
# names, labels, annotations
# --------------------------------------------------------------------------------------------


def test_every_rule_file_passes_promtool_check_rules() -> None:
    for name in RULE_FILES:
        result = run_tool(tool("promtool"), "check", "rules", ALERTS / name)
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_follows_the_mixin_style_guide() -> None:
    for name in RULE_FILES:
        for rule in _loaded(ALERTS / name):
            if "alert" not in rule:
                continue
            assert re.fullmatch(r"KVWatch[A-Z][A-Za-z0-9]+", rule["alert"]), rule["alert"]
            assert rule["labels"]["severity"] in SEVERITIES
            notes = rule["annotations"]
            assert set(notes) == {"summary", "description", "runbook_url"}
            assert notes["summary"].endswith(".") and "{{" not in notes["summary"]  # static headline
            assert "{{" in notes["description"]  # templated
            assert notes["runbook_url"].endswith(f"/docs/runbooks/{rule['alert']}.md")


def test_labels_and_annotations_are_strings_for_the_prometheusrule_crd() -> None:
    for name in RULE_FILES:
        for rule in _loaded(ALERTS / name):
            for key in ("labels", "annotations"):
                assert all(isinstance(v, str) for v in rule.get(key, {}).values()), rule


def test_recording_rule_names_follow_level_metric_operations() -> None:
    for name in RULE_FILES:
        for rule in _loaded(ALERTS / name):
            if "record" in rule:
                assert re.fullmatch(r"kvwatch:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]


def test_group_names_are_unique_across_files() -> None:
    names = [g["name"] for f in RULE_FILES for g in yaml.safe_load((ALERTS / f).read_text())["groups"]]
    assert len(names) == len(set(names))


def test_pages_are_reserved_for_slo_burn_lost_gpus_gpu_errors_and_kvwatch_absent() -> None:
    critical = {r.alert for f in _default_files() for r in f.rules()
                if isinstance(r, Alert) and r.severity == "critical"}
    assert critical == {"KVWatchLatencyBudgetBurn", "KVWatchCompletionBudgetBurn", "KVWatchGPULost",
                        "KVWatchGPUCriticalXID", "KVWatchGPUUncorrectableECC", "KVWatchGPURowRemapFailure",
                        "KVWatchAbsent"}


# --------------------------------------------------------------------------------------------
# the metric-name check
# --------------------------------------------------------------------------------------------


def test_every_shipped_rule_queries_only_exported_recorded_or_allowed_names() -> None:
    assert name_problems(_default_files()) == []


@pytest.mark.parametrize(("expr", "problem"), [
    # a counter without _total: vLLM's published alert on vllm:num_preemptions could never fire
    ("rate(kvwatch_preemptions[5m])", "kvwatch_preemptions is not a kvwatch metric"),
    ("rate(vllm:num_preemptions_total[5m])", "vllm:num_preemptions_total is not a kvwatch metric"),
    ('kvwatch_kv_usage_ratio{modelname="m"}', "has no label 'modelname'"),
    ('kvwatch_request_ttft_seconds_count{le="1.0"}', "has no label 'le'"),
    ("kvwatch:not_recorded:ratio", "kvwatch:not_recorded:ratio is not a kvwatch metric"),
])
def test_the_generator_refuses_a_query_on_a_name_kvwatch_does_not_export(expr, problem) -> None:
    bad = RuleFile("x.rules.yaml", "x", (Group("g", (Recording("kvwatch:x:y", expr),)),))
    problems = name_problems([*_default_files(), bad])
    assert len(problems) == 1 and problem in problems[0]
    assert problems[0].startswith("x.rules.yaml: g: kvwatch:x:y")


@pytest.mark.parametrize("expr", [
    'up{job="kvwatch"} == 0',
    'DCGM_FI_DEV_GPU_TEMP * on (UUID) group_left () '
    'label_replace(kvwatch_gpu_info, "UUID", "$1", "uuid", "(.*)")',
    'ALERTS{alertstate="firing"}',
    'histogram_quantile(0.99, sum by (le) '
    '(rate(kvwatch_request_tpot_seconds_bucket{instance=~"$node"}[5m])))',
])
def test_external_metrics_on_the_allow_list_and_catalog_labels_pass(expr) -> None:
    assert unknown_names(expr) == []


@pytest.mark.parametrize(("expr", "names"), [
    ("sum by (le) (rate(a_bucket{x=\"1\"}[5m])) / on () group_left b", {"a_bucket", "b"}),
    ("a offset 5m + 1e3 * b[5m:1m] unless on (x) c", {"a", "b", "c"}),
    ('label_replace(a, "dst", "$1", "src", "(.*)") > bool 0', {"a"}),
    ('count(up{job=~"$job"} == 0) or vector(0)', {"up"}),
    ("sum(x) by (le) and time() - y > inf", {"x", "y"}),
])
def test_metric_references_are_found_past_strings_groupings_functions_and_keywords(expr, names) -> None:
    assert {n for n, _ in referenced_selectors(expr)} == names


# --------------------------------------------------------------------------------------------
# SLO rules
# --------------------------------------------------------------------------------------------


def test_le_matched_by_the_rules_is_exactly_what_kvwatch_exports_for_each_threshold() -> None:
    slo = load_slo_file(ALERTS / "slo.yaml")
    text = (ALERTS / SLO_FILE).read_text()
    for obj in slo.objectives:
        if not obj.is_latency:
            continue
        hist = Histogram(HISTOGRAM_FAMILIES[obj.family])  # the bounds kvwatch's /metrics uses
        exported = {le for le, _ in hist.cumulative()}
        le = buckets.le_label(obj.threshold)
        assert le in exported  # the series the rule reads exists on kvwatch's /metrics
        assert f'le="{le}"' in text
    assert 'le="1"' not in text and 'le="0.060"' not in text


def test_burn_thresholds_are_factor_times_budget_without_float_noise() -> None:
    obj = slo_from_mapping({"objectives": [{"name": "x", "sli": "tpot", "threshold": 0.06,
                                            "objective": 0.999, "bands": ["5k-10k"]}]}).objectives[0]
    page, ticket = (burn_alert(obj, sev, "28d").expr for sev in BURNS)
    assert "> 0.0144\n" in page and "> 0.006\n" in page
    assert "> 0.003\n" in ticket and "> 0.001\n" in ticket
    assert '* 3600 >= 20' in page and '* 21600 >= 20' in page
    assert '* 86400 >= 20' in ticket and '* 259200 >= 20' in ticket


def test_each_objective_records_every_window_and_its_budget() -> None:
    records = [r for r in _default_files()[1].rules() if isinstance(r, Recording)]
    tpot = [r.record for r in records if dict(r.labels).get("slo") == "tpot-medium"]
    for w in ("5m", "30m", "1h", "2h", "6h", "1d", "3d"):
        assert f"kvwatch:slo_errors:ratio_rate{w}" in tpot and f"kvwatch:slo_requests:rate{w}" in tpot
    assert {"kvwatch:slo_errors:rate5m", "kvwatch:slo_errors:ratio_rate28d",
            "kvwatch:slo_error_budget_remaining:ratio", "kvwatch:slo_objective:ratio"} <= set(tpot)


def test_slo_alerts_are_two_per_objective_and_severity() -> None:
    slo = load_slo_file(ALERTS / "slo.yaml")
    burns = [r for r in _default_files()[1].rules() if isinstance(r, Alert)]
    assert len(burns) == 2 * len(slo.objectives)
    assert {(dict(r.labels)["slo"], r.severity) for r in burns} == {
        (o.name, s) for o in slo.objectives for s in ("critical", "warning")}


def test_operational_alerts_follow_the_slo_files_long_and_short_bands() -> None:
    slo = slo_from_mapping({
        "length_bands": [2000, 8000], "long_bands": ["8k+"], "short_bands": ["0-2k"],
        "objectives": [{"name": "c", "sli": "completion", "objective": 0.99, "bands": "*"}]})
    starving = next(r for r in alerts_mod.operational_rule_file(slo).rules()
                    if r.alert == "KVWatchLongRequestsStarving")
    assert 'length_band="8k+"' in starving.expr and 'length_band="0-2k"' in starving.expr
    assert "0-2k" in starving.description


def test_alert_names_are_listed_once_in_file_order() -> None:
    names = alert_names(_default_files())
    assert names[:2] == ["KVWatchLatencyBudgetBurn", "KVWatchCompletionBudgetBurn"]
    assert len(names) == len(set(names)) == 22
