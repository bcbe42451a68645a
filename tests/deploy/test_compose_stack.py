"""deploy/compose: kvwatch demo + Prometheus + Alertmanager + Grafana, wired to the repository's files.

Docker cannot run here, so the stack is checked piece by piece: the Prometheus config with the real
``promtool``, the Alertmanager config with ``amtool``, and every path, host name and port that one
service uses to find another.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from kvwatch.mixin.k8s import RULE_FILE_PATTERNS
from tests.local import require_tool

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text(encoding="utf-8"))
SERVICES: dict[str, Any] = COMPOSE["services"]
PROMETHEUS = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text(encoding="utf-8"))
PROVISIONING = COMPOSE_DIR / "grafana" / "provisioning"


def _mounts(service: str) -> dict[str, Path]:
    """Container path -> host path for the service's bind mounts (named volumes left out)."""
    out = {}
    for volume in SERVICES[service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = (COMPOSE_DIR / source).resolve()
    return out


def _host_path(service: str, container_path: str) -> Path:
    """Where a path inside the container comes from on the host, through the bind mounts."""
    path = PurePosixPath(container_path)
    for target, source in _mounts(service).items():
        if path == PurePosixPath(target) or PurePosixPath(target) in path.parents:
            return source / path.relative_to(target)
    raise AssertionError(f"{service}: nothing mounted at {container_path}")


def _flag(service: str, name: str) -> str:
    return next(a.split("=", 1)[1] for a in SERVICES[service]["command"] if a.startswith(f"--{name}="))


def _job(name: str) -> dict[str, Any]:
    return next(j for j in PROMETHEUS["scrape_configs"] if j["job_name"] == name)


def test_stack_has_the_four_services() -> None:
    assert set(SERVICES) == {"kvwatch", "prometheus", "alertmanager", "grafana"}


@pytest.mark.parametrize("service", ["kvwatch", "prometheus", "alertmanager", "grafana"])
def test_every_bind_mount_source_exists_in_the_repository(service: str) -> None:
    for target, source in _mounts(service).items():
        assert source.exists(), f"{service}: {source} (mounted at {target}) is missing"
        assert ROOT in source.parents, f"{service}: {source} is outside the repository"


@pytest.mark.parametrize("service", ["prometheus", "alertmanager", "grafana"])
def test_third_party_images_are_pinned_to_a_release(service: str) -> None:
    image = SERVICES[service]["image"]
    assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), image


def test_ports_are_published_on_loopback_only() -> None:
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name}: {port}"


def test_kvwatch_runs_the_demo_hardened_and_prometheus_scrapes_its_port() -> None:
    from kvwatch.mixin.alerts import DEFAULT_JOB

    kvwatch = SERVICES["kvwatch"]
    assert kvwatch["command"][:2] == ["demo", "--listen"]
    port = kvwatch["command"][2].rsplit(":", 1)[1]
    assert _job(DEFAULT_JOB)["static_configs"][0]["targets"] == [f"kvwatch:{port}"]
    assert kvwatch["read_only"] is True and kvwatch["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in kvwatch["security_opt"]
    assert not kvwatch["user"].startswith("0")
    assert (COMPOSE_DIR / kvwatch["build"]["context"]).resolve() == ROOT
    assert (ROOT / kvwatch["build"]["dockerfile"]).exists()


@pytest.mark.prometheus
def test_prometheus_config_passes_promtool_with_the_repositorys_rule_files(tmp_path: Path) -> None:
    out = subprocess.run(
        [require_tool("promtool"), "check", "config", str(COMPOSE_DIR / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # Again with rule_files pointing where the mount takes them from, so promtool checks the rules too.
    config = dict(PROMETHEUS)
    config["rule_files"] = [str(_host_path("prometheus", pattern)) for pattern in PROMETHEUS["rule_files"]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    out = subprocess.run(
        [require_tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_loads_exactly_the_rule_files_kubernetes_gets() -> None:
    globbed = {
        p
        for pattern in PROMETHEUS["rule_files"]
        for p in _host_path("prometheus", pattern).parent.glob(PurePosixPath(pattern).name)
    }
    generated = {p for pattern in RULE_FILE_PATTERNS for p in (ROOT / "alerts").glob(pattern)}
    assert globbed == generated


def test_prometheus_alerts_the_compose_alertmanager() -> None:
    [am] = PROMETHEUS["alerting"]["alertmanagers"]
    assert am["static_configs"][0]["targets"] == ["alertmanager:9093"]
    assert _host_path("prometheus", _flag("prometheus", "config.file")) == COMPOSE_DIR / "prometheus.yml"


@pytest.mark.prometheus
def test_alertmanager_config_it_mounts_passes_amtool() -> None:
    config = _host_path("alertmanager", _flag("alertmanager", "config.file"))
    assert config == ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
    amtool = require_tool("amtool")
    out = subprocess.run(
        [amtool, "check-config", str(config)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _provisioning(kind: str) -> list[dict[str, Any]]:
    files = sorted((PROVISIONING / kind).glob("*.yaml"))
    return [yaml.safe_load(p.read_text(encoding="utf-8")) for p in files]


def test_grafana_reads_the_provisioning_directory_from_the_repository() -> None:
    assert _host_path("grafana", "/etc/grafana/provisioning") == PROVISIONING
    assert _provisioning("datasources") and _provisioning("dashboards")


def test_grafana_dashboard_provider_points_at_the_repositorys_dashboards() -> None:
    providers = [p for doc in _provisioning("dashboards") for p in doc["providers"]]
    assert [p["type"] for p in providers] == ["file"]
    assert _host_path("grafana", providers[0]["options"]["path"]) == ROOT / "dashboards"


def test_grafana_datasources_reach_the_compose_services() -> None:
    sources = {d["type"]: d for doc in _provisioning("datasources") for d in doc["datasources"]}
    assert sources["prometheus"]["url"] == "http://prometheus:9090" and sources["prometheus"]["isDefault"]
    assert sources["alertmanager"]["url"] == "http://alertmanager:9093"
    assert {"prometheus", "alertmanager"} <= set(SERVICES)


def _datasource_uids(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = set()
        ds = node.get("datasource")
        if isinstance(ds, dict) and isinstance(ds.get("uid"), str):
            found.add(ds["uid"])
        return found.union(*(_datasource_uids(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_datasource_uids(v) for v in node))
    return set()


# Grafana's file provider reads subfolders too (dashboards/native/)
@pytest.mark.parametrize("dashboard", sorted((ROOT / "dashboards").rglob("*.json")), ids=lambda p: p.name)
def test_dashboards_name_only_provisioned_datasources(dashboard: Path) -> None:
    board = json.loads(dashboard.read_text(encoding="utf-8"))
    # File provisioning does not resolve import-time inputs (${DS_PROMETHEUS}).
    assert "__inputs" not in board
    provisioned = {d["uid"] for doc in _provisioning("datasources") for d in doc["datasources"]}
    fixed = {uid for uid in _datasource_uids(board) if not uid.startswith("$")}
    assert fixed <= provisioned | {"-- Grafana --", "grafana"}
