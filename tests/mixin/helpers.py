"""Helpers for the mixin tests: the real promtool/amtool binaries and the repository paths."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "alerts"
PROMTOOL_TESTS = Path(__file__).resolve().parent / "promtool"


def tool(name: str) -> str:
    """Path of a Debian Prometheus tool; the suite's set-up installs them (scripts/setup-test-env.sh)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: run scripts/setup-test-env.sh (Debian prometheus / "
                    "prometheus-alertmanager)")
    return path


def run_tool(*args: str | Path, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          check=False)
