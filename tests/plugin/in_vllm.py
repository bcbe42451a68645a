"""Run one of this folder's harness scripts in the cached CPU vLLM venv, the plugin on its path, and
collect what it sent to a socket the test bound with kvwatch's receiver code."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from kvwatch.requests.vllm_plugin import bind_socket
from tests.local import CACHE, SKIP_REAL_ENGINES, unavailable

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("VENV", CACHE / "kvwatch-vllm" / "venv"))


def run_harness(script: str, socket_path: str, *args: str) -> tuple[dict[str, Any], list[bytes]]:
    """``script``'s last stdout line (a JSON object), and every datagram it sent to ``socket_path``."""
    python = VENV / "bin" / "python"
    if not python.exists():
        unavailable(f"real vLLM is not installed in {VENV}: run scripts/setup-test-env.sh", SKIP_REAL_ENGINES)
    sock = bind_socket(socket_path)
    try:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT / "plugins" / "vllm"),
            "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        proc = subprocess.run(
            [str(python), str(Path(__file__).with_name(script)), socket_path, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        sock.setblocking(False)
        datagrams = []
        while True:
            try:
                datagrams.append(sock.recv(70_000))
            except BlockingIOError:
                break
    finally:
        sock.close()
    return result, datagrams
