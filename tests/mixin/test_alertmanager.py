"""deploy/alertmanager/alertmanager.yml: valid for amtool, routes by severity, keeps secrets in
files, and its inhibitions work in a real Alertmanager."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import yaml

from kvwatch.mixin.rulefile import alert_names
from kvwatch.mixin.rules import rule_files
from kvwatch.mixin.slo import load_slo_file
from tests.local import free_port, wait_until

from .helpers import ALERTS, ROOT, run_tool, tool

CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"


def test_amtool_check_config_passes() -> None:
    result = run_tool(tool("amtool"), "check-config", CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["severity=critical", "alertname=KVWatchLatencyBudgetBurn"], "page"),
        (["severity=warning", "alertname=KVWatchKVCachePressure"], "ticket"),
        (["severity=info", "alertname=Something"], "webhook"),
        (["alertname=NoSeverity"], "webhook"),
    ],
)
def test_routes_by_severity(labels, receiver) -> None:
    result = run_tool(tool("amtool"), "config", "routes", "test", f"--config.file={CONFIG}", *labels)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == receiver


def test_pages_go_to_pagerduty_slack_and_the_webhook_tickets_to_slack_and_the_webhook() -> None:
    receivers = {r["name"]: r for r in yaml.safe_load(CONFIG.read_text())["receivers"]}
    assert {"pagerduty_configs", "slack_configs", "webhook_configs"} <= set(receivers["page"])
    assert {"slack_configs", "webhook_configs"} <= set(receivers["ticket"])
    assert "pagerduty_configs" not in receivers["ticket"]


def test_no_secret_is_written_in_the_config() -> None:
    doc = yaml.safe_load(CONFIG.read_text())
    text = json.dumps(doc)
    for key in ("routing_key", "service_key", "api_url", "credentials", "password", "bearer_token"):
        assert f'"{key}"' not in text, key  # only the *_file variants
    assert "/etc/alertmanager/secrets/" in text
    assert not re.search(r"hooks\.slack\.com/services/\w", CONFIG.read_text())


def test_inhibit_rules_name_alerts_kvwatch_ships() -> None:
    shipped = set(alert_names(rule_files(load_slo_file(ALERTS / "slo.yaml"))))
    doc = yaml.safe_load(CONFIG.read_text())
    for rule in doc["inhibit_rules"]:
        for m in rule["source_matchers"]:
            name = re.fullmatch(r'alertname="(\w+)"', m)
            if name:
                assert name.group(1) in shipped


# --------------------------------------------------------------------------------------------
# a real Alertmanager
# --------------------------------------------------------------------------------------------


@pytest.fixture
def alertmanager(tmp_path) -> Iterator[str]:
    """The example config's route and inhibit rules with one local webhook receiver (nothing leaves
    the machine), served by the Debian prometheus-alertmanager."""
    doc = yaml.safe_load(CONFIG.read_text())
    sink = {"url": f"http://127.0.0.1:{free_port()}/", "send_resolved": False}
    doc["receivers"] = [{"name": r["name"], "webhook_configs": [sink]} for r in doc["receivers"]]
    (tmp_path / "am.yml").write_text(yaml.safe_dump(doc))
    port = free_port()
    proc = subprocess.Popen(
        [
            tool("prometheus-alertmanager"),
            f"--config.file={tmp_path / 'am.yml'}",
            f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"alertmanager exited ({proc.returncode}) while starting")
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2):
                return True

        wait_until(ready, 30, "alertmanager to start", interval_s=0.2, retry_on=(OSError,))
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _post(url: str, alerts: list[dict[str, str]]) -> None:
    now = datetime.now(UTC)
    body = [
        {"labels": labels, "startsAt": now.isoformat(), "endsAt": (now + timedelta(hours=1)).isoformat()}
        for labels in alerts
    ]
    request = urllib.request.Request(
        f"{url}/api/v2/alerts",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def _inhibited(url: str, expected: int) -> dict[tuple[str, str], bool]:
    """(alertname, distinguishing label) -> inhibited, once ``expected`` alerts are in."""

    def state() -> dict[tuple[str, str], bool]:
        with urllib.request.urlopen(f"{url}/api/v2/alerts", timeout=10) as response:
            alerts = json.loads(response.read())
        now = {
            (a["labels"]["alertname"], a["labels"].get("key", "")): bool(a["status"]["inhibitedBy"])
            for a in alerts
        }
        return now if len(now) >= expected and any(now.values()) else {}

    return wait_until(state, 30, f"{expected} alerts in Alertmanager, one inhibited", interval_s=0.3)


@pytest.mark.prometheus
def test_inhibitions_in_a_real_alertmanager(alertmanager) -> None:
    _post(
        alertmanager,
        [
            # kvwatch down on node a: node a's KV alert is a symptom, node b's is not
            {"alertname": "KVWatchDown", "severity": "warning", "instance": "a:9477", "job": "kvwatch"},
            {
                "alertname": "KVWatchKVCachePressure",
                "severity": "warning",
                "instance": "a:9477",
                "replica": "r0",
                "key": "node-a",
            },
            {
                "alertname": "KVWatchKVCachePressure",
                "severity": "warning",
                "instance": "b:9477",
                "replica": "r0",
                "key": "node-b",
            },
            # a lost GPU hides its own XID alert, not another GPU's
            {"alertname": "KVWatchGPULost", "severity": "critical", "instance": "c:9477", "uuid": "GPU-1"},
            {
                "alertname": "KVWatchGPUCriticalXID",
                "severity": "critical",
                "instance": "c:9477",
                "uuid": "GPU-1",
                "xid": "79",
                "key": "lost-gpu",
            },
            {
                "alertname": "KVWatchGPUCriticalXID",
                "severity": "critical",
                "instance": "c:9477",
                "uuid": "GPU-2",
                "xid": "48",
                "key": "other-gpu",
            },
            # the page hides the ticket of the same SLO and band, not of another band
            {
                "alertname": "KVWatchLatencyBudgetBurn",
                "severity": "critical",
                "slo": "tpot-long",
                "model_name": "m",
                "length_band": "20k+",
                "key": "page",
            },
            {
                "alertname": "KVWatchLatencyBudgetBurn",
                "severity": "warning",
                "slo": "tpot-long",
                "model_name": "m",
                "length_band": "20k+",
                "key": "ticket-same-band",
            },
            {
                "alertname": "KVWatchLatencyBudgetBurn",
                "severity": "warning",
                "slo": "tpot-long",
                "model_name": "m",
                "length_band": "10k-20k",
                "key": "ticket-other-band",
            },
        ],
    )
    state = _inhibited(alertmanager, expected=9)
    assert state[("KVWatchKVCachePressure", "node-a")] is True
    assert state[("KVWatchKVCachePressure", "node-b")] is False
    assert state[("KVWatchGPUCriticalXID", "lost-gpu")] is True
    assert state[("KVWatchGPUCriticalXID", "other-gpu")] is False
    assert state[("KVWatchLatencyBudgetBurn", "ticket-same-band")] is True
    assert state[("KVWatchLatencyBudgetBurn", "ticket-other-band")] is False
    assert state[("KVWatchLatencyBudgetBurn", "page")] is False
    assert state[("KVWatchDown", "")] is False
