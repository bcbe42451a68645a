"""deploy/systemd: the hardened unit and its example config."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from kvwatch.config import load_config
from tests.local import require_tool

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "kvwatch.service"
CONFIG = ROOT / "deploy" / "systemd" / "kvwatch.yaml"


def _directives(text: str) -> dict[str, list[str]]:
    """``Key=Value`` lines of the [Service] section; keys may repeat, as in systemd."""
    section, out = "", defaultdict(list)
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key].append(value)
    return out


def _unit_runnable_here(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this checkout's kvwatch, since verify checks the binary exists."""
    kvwatch = Path(sys.executable).with_name("kvwatch")
    unit = tmp_path / "kvwatch.service"
    unit.write_text(UNIT.read_text().replace("/opt/kvwatch/bin/kvwatch", str(kvwatch)))
    return unit


def test_unit_runs_the_agent_with_the_documented_config() -> None:
    d = _directives(UNIT.read_text())
    assert d["ExecStart"] == ["/opt/kvwatch/bin/kvwatch run --config /etc/kvwatch/kvwatch.yaml"]
    assert d["Restart"] == ["on-failure"] and d["KillSignal"] == ["SIGTERM"] and d["TimeoutStopSec"]
    assert d["ConfigurationDirectory"] == ["kvwatch"]  # /etc/kvwatch


def test_unit_drops_every_privilege() -> None:
    d = _directives(UNIT.read_text())
    expected = {
        "DynamicUser": "yes",
        "NoNewPrivileges": "yes",
        "CapabilityBoundingSet": "",
        "AmbientCapabilities": "",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
        "DevicePolicy": "closed",
    }
    for key, value in expected.items():
        assert d[key] == [value], key
    assert "@system-service" in d["SystemCallFilter"]


def test_unit_sets_an_open_files_limit_kvwatch_cannot_set_itself() -> None:
    """The proxy needs two descriptors per stream; the unit's filter denies setrlimit (@resources)."""
    d = _directives(UNIT.read_text())
    assert int(d["LimitNOFILE"][0]) >= 65536
    assert any("~" in v and "@resources" in v for v in d["SystemCallFilter"])


def test_unit_opens_only_the_nvidia_devices_nvml_needs() -> None:
    d = _directives(UNIT.read_text())
    # PrivateDevices=yes would hide /dev/nvidia* altogether; the device cgroup limits access instead.
    assert d["PrivateDevices"] == ["no"]
    allowed = {entry.split()[0]: entry.split()[1] for entry in d["DeviceAllow"]}
    assert allowed == {"char-nvidia": "rw", "char-nvidia-frontend": "rw", "char-nvidia-caps": "r"}
    assert not any("uvm" in entry for entry in d["DeviceAllow"])  # CUDA memory: not needed for NVML


def test_ledger_lives_in_the_state_directory_the_unit_makes_writable() -> None:
    d = _directives(UNIT.read_text())
    cfg = load_config(CONFIG, environ={})
    assert d["StateDirectory"] == ["kvwatch"]
    assert cfg.ledger.path is not None and cfg.ledger.path.startswith("/var/lib/kvwatch/")


def test_example_config_is_valid() -> None:
    cfg = load_config(CONFIG, environ={})
    assert [r.name for r in cfg.replicas] == ["vllm-0", "vllm-1"]
    assert str(cfg.otlp.listen) == "127.0.0.1:4318"


def test_systemd_analyze_verify_finds_nothing(tmp_path: Path) -> None:
    out = subprocess.run(
        [require_tool("systemd-analyze"), "verify", str(_unit_runnable_here(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0
    # Unknown or misspelt keys are only warnings: demand silence.
    assert out.stdout + out.stderr == ""


def test_systemd_security_exposure_is_ok(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            require_tool("systemd-analyze"),
            "security",
            "--offline=yes",
            "--no-pager",
            str(_unit_runnable_here(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if "--offline" in out.stderr:
        pytest.skip("systemd-analyze too old for --offline (systemd < 252)")
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
    assert match, out.stdout + out.stderr
    # systemd rates < 2.0 "OK"; what is left open (network, /proc, devices) is what kvwatch needs.
    assert float(match.group(1)) < 2.0
