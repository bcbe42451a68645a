"""Helpers for the mixin tests: the real promtool/amtool binaries and the repository paths."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.local import require_tool

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "alerts"
PROMTOOL_TESTS = Path(__file__).resolve().parent / "promtool"


def tool(name: str) -> str:
    """Path of a Debian Prometheus tool; the suite's set-up installs them (scripts/setup-test-env.sh)."""
    return require_tool(
        name, install="run scripts/setup-test-env.sh (Debian prometheus / prometheus-alertmanager)"
    )


def run_tool(*args: str | Path, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False
    )
