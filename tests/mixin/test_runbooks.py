"""docs/runbooks: one per alert, reachable from its runbook_url, saying what to check and do."""

from __future__ import annotations

import re

import pytest
import yaml

from kvwatch.mixin.alerts import CRITICAL_XIDS
from kvwatch.mixin.dashboards.check import recorded_series
from kvwatch.mixin.promql import catalog_family
from kvwatch.mixin.rulefile import DEFAULT_RUNBOOK_BASE, alert_names
from kvwatch.mixin.rules import rule_files
from kvwatch.mixin.slo import load_slo_file

from .helpers import ALERTS, ROOT

RUNBOOKS = ROOT / "docs" / "runbooks"
NAMES = alert_names(rule_files(load_slo_file(ALERTS / "slo.yaml")))


def _runbook_urls() -> dict[str, str]:
    urls = {}
    for path in ALERTS.glob("kvwatch-*.rules.yaml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    urls[rule["alert"]] = rule["annotations"]["runbook_url"]
    return urls


def test_every_alerts_runbook_url_names_a_file_that_exists() -> None:
    urls = _runbook_urls()
    assert set(urls) == set(NAMES)
    for alert, url in urls.items():
        assert url.startswith(DEFAULT_RUNBOOK_BASE)
        path = ROOT / "docs" / "runbooks" / url.removeprefix(DEFAULT_RUNBOOK_BASE)
        assert path.is_file(), f"{alert}: {url} -> {path} missing"


def test_every_runbook_belongs_to_an_alert() -> None:
    assert {p.stem for p in RUNBOOKS.glob("*.md")} == set(NAMES)


@pytest.mark.parametrize("alert", NAMES)
def test_runbook_says_what_it_means_what_to_check_and_what_to_do(alert) -> None:
    text = (RUNBOOKS / f"{alert}.md").read_text()
    assert text.startswith(f"# {alert}\n")
    for heading in ("## What it means", "## What to check", "## What to do"):
        assert heading in text, f"{alert}: missing {heading!r}"
    assert "**Severity:**" in text


@pytest.mark.parametrize("alert", NAMES)
def test_metrics_a_runbook_tells_you_to_query_exist(alert) -> None:
    text = (RUNBOOKS / f"{alert}.md").read_text()
    recorded = recorded_series()
    for name in set(re.findall(r"\bkvwatch(?:_[a-z0-9]+)+\b|\bkvwatch:[a-z0-9_]+:[a-z0-9_]+\b", text)):
        assert name in recorded or catalog_family(name) is not None, f"{alert}: {name} does not exist"


def test_critical_xid_runbook_explains_every_xid_that_pages() -> None:
    text = (RUNBOOKS / "KVWatchGPUCriticalXID.md").read_text()
    for xid in CRITICAL_XIDS:
        assert re.search(rf"^\| {xid} \|", text, re.MULTILINE), f"XID {xid} not in the runbook table"
