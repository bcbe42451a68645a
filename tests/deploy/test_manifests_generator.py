"""``kvwatch manifests``: rule files and dashboards become PrometheusRules and dashboard ConfigMaps."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from kvwatch.cli import main as cli
from kvwatch.mixin.k8s import DASHBOARDS_FILE, LEVEL_LABEL, RULES_FILE, ManifestError, generate
from tests.local import require_tool

ROOT = Path(__file__).resolve().parents[2]

RULES = """\
groups:
  - name: kvwatch-kv
    rules:
      - record: kvwatch:kv_usage:max
        expr: max by (replica) (kvwatch_kv_usage_ratio)
      - alert: KvwatchKvCacheNearlyFull
        expr: |
          kvwatch:kv_usage:max > 0.95
          and on (replica) kvwatch_kv_headroom_seconds < 60
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "KV cache of {{ $labels.replica }} is nearly full"
"""
RULE_TEST = """\
rule_files: [kvwatch-kv.rules.yaml]
tests:
  - interval: 1m
    input_series: []
"""
SLO_SPEC = "version: 1\nperiod: 28d\nobjectives: []\n"
DASHBOARD = {"title": "kvwatch / KV cache", "uid": "kvwatch-kv", "panels": [{"type": "timeseries"}]}


@pytest.fixture
def sources(tmp_path: Path) -> tuple[Path, Path]:
    alerts, dashboards = tmp_path / "alerts", tmp_path / "dashboards"
    alerts.mkdir()
    dashboards.mkdir()
    (alerts / "kvwatch-kv.rules.yaml").write_text(RULES)
    (alerts / "kvwatch-kv.rules.test.yaml").write_text(RULE_TEST)
    (alerts / "slo.yaml").write_text(SLO_SPEC)
    (dashboards / "kv-cache.json").write_text(json.dumps(DASHBOARD, indent=2) + "\n")
    return alerts, dashboards


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_each_rule_file_becomes_one_prometheusrule_with_its_groups_unchanged(sources, tmp_path) -> None:
    alerts, dashboards = sources
    [rule] = _docs(generate(alerts, dashboards, root=tmp_path)[RULES_FILE])
    assert rule["kind"] == "PrometheusRule" and rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"] == "kvwatch-kv"
    assert rule["spec"] == yaml.safe_load(RULES)  # multi-line PromQL survives the literal block


def test_only_rule_files_become_rules_not_the_slo_spec_or_promtool_tests(sources, tmp_path) -> None:
    alerts, dashboards = sources
    text = generate(alerts, dashboards, root=tmp_path)[RULES_FILE]
    assert "# source: alerts/kvwatch-kv.rules.yaml" in text
    assert "rules.test.yaml" not in text and "slo.yaml" not in text


@pytest.mark.prometheus
def test_prometheusrule_spec_is_a_rule_file_promtool_accepts(sources, tmp_path) -> None:
    alerts, dashboards = sources
    [rule] = _docs(generate(alerts, dashboards, root=tmp_path)[RULES_FILE])
    back = tmp_path / "back.rules.yaml"
    back.write_text(yaml.safe_dump(rule["spec"]))
    promtool = require_tool("promtool")
    out = subprocess.run(
        [promtool, "check", "rules", str(back)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 rules found" in out.stdout


def test_each_dashboard_becomes_a_configmap_the_grafana_sidecar_picks_up(sources, tmp_path) -> None:
    alerts, dashboards = sources
    [cm] = _docs(generate(alerts, dashboards, root=tmp_path)[DASHBOARDS_FILE])
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "kvwatch-dashboard-kv-cache"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["kv-cache.json"] == (dashboards / "kv-cache.json").read_text()  # byte for byte


def test_missing_source_directories_give_files_without_objects(tmp_path) -> None:
    files = generate(tmp_path / "no-alerts", tmp_path / "no-dashboards", root=tmp_path)
    assert set(files) == {RULES_FILE, DASHBOARDS_FILE}
    assert all(_docs(text) == [] for text in files.values())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "groups:\n  - name: g\n    rules:\n      - alert: A\n"
            "        expr: up == 0\n        severity: page\n",
            r"rules\[0\]: unknown key\(s\) \['severity'\]",
        ),
        (
            "groups:\n  - name: g\n    rules:\n      - alert: A\n        record: b\n        expr: up\n",
            "exactly one of 'alert' and 'record'",
        ),
        (
            "groups:\n  - name: g\n    rules:\n      - alert: A\n"
            "        expr: up\n        labels: {priority: 1}\n",
            r"labels\.priority: the PrometheusRule CRD needs a string",
        ),
        ("groups: []\n", "'groups' must be a non-empty list"),
        ("scrape_configs: []\n", "not a Prometheus rule file"),
        ("groups: [\n", "not valid YAML"),
    ],
)
def test_bad_rule_files_are_refused_naming_the_file_and_the_fix(tmp_path, text, message) -> None:
    (tmp_path / "alerts").mkdir()
    (tmp_path / "alerts" / "bad.rules.yaml").write_text(text)
    with pytest.raises(ManifestError, match=message) as info:
        generate(tmp_path / "alerts", tmp_path / "dashboards", root=tmp_path)
    assert str(info.value).startswith("alerts/bad.rules.yaml")


def test_a_group_defined_in_two_rule_files_is_refused(tmp_path) -> None:
    (tmp_path / "alerts").mkdir()
    (tmp_path / "alerts" / "a.rules.yaml").write_text(RULES)
    (tmp_path / "alerts" / "b.rules.yaml").write_text(RULES)
    with pytest.raises(ManifestError, match=r"'kvwatch-kv' is also defined in alerts/a\.rules\.yaml"):
        generate(tmp_path / "alerts", tmp_path / "dashboards", root=tmp_path)


def test_kvwatchs_rule_files_are_labelled_with_where_they_evaluate(tmp_path) -> None:
    """A ruleSelector on the label picks whole files: node rules for the cluster Prometheus, fleet
    rules for the Prometheus or ThanosRuler that holds every node's series."""
    alerts = ROOT / "alerts"
    rules = _docs(generate(alerts, tmp_path / "no-dashboards", root=ROOT)[RULES_FILE])
    levels = {r["metadata"]["name"]: r["metadata"]["labels"].get(LEVEL_LABEL) for r in rules}
    assert levels == {"kvwatch-node": "node", "kvwatch-fleet": "fleet", "kvwatch-slo": "fleet"}


def test_a_rule_file_kvwatch_does_not_generate_has_no_level(sources, tmp_path) -> None:
    [rule] = _docs(generate(sources[0], sources[1], root=tmp_path)[RULES_FILE])
    assert LEVEL_LABEL not in rule["metadata"]["labels"]


@pytest.mark.parametrize(("text", "message"), [("{", "not valid JSON"), ("[]", "not a Grafana dashboard")])
def test_bad_dashboards_are_refused(tmp_path, text, message) -> None:
    (tmp_path / "dashboards").mkdir()
    (tmp_path / "dashboards" / "x.json").write_text(text)
    with pytest.raises(ManifestError, match=message):
        generate(tmp_path / "alerts", tmp_path / "dashboards", root=tmp_path)


def test_check_fails_on_stale_files_and_passes_after_writing(sources, tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)
    assert cli(["manifests", "--out", "out", "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert not list(out.iterdir())  # --check writes nothing
    assert cli(["manifests", "--out", "out"]) == 0
    assert cli(["manifests", "--out", "out", "--check"]) == 0
    (sources[0] / "kvwatch-kv.rules.yaml").write_text(RULES.replace("0.95", "0.9"))
    assert cli(["manifests", "--out", "out", "--check"]) == 1
    diff = capsys.readouterr().out
    assert "kvwatch:kv_usage:max > 0.95\n" in diff and "+        kvwatch:kv_usage:max > 0.9\n" in diff


def test_bad_sources_make_the_command_fail_with_the_reason(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "alerts").mkdir()
    (tmp_path / "alerts" / "bad.rules.yaml").write_text("groups: []\n")
    (tmp_path / "dashboards").mkdir()
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    assert cli(["manifests", "--out", "out"]) == 1
    assert "alerts/bad.rules.yaml: 'groups' must be a non-empty list" in capsys.readouterr().err


def test_a_misspelled_source_directory_is_refused_not_shipped_empty(sources, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli(["manifests", "--out", "new/out", "--alerts", "alert"]) == 1
    assert "--alerts alert: no such directory" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # nothing written
    assert cli(["manifests", "--out", "new/out"]) == 0  # --out is made, like rules' and dashboards'
    assert (tmp_path / "new" / "out" / RULES_FILE).exists()
