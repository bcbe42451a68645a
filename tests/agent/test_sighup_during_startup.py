"""A SIGHUP while ``kvwatch run`` is still starting (a ConfigMap edit lands, or ``systemctl reload``
races the start) does not kill it (SIGHUP's default action ends a process); the reload it asked
for is done once the agent runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.local import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _config(port: int, replicas: list[str]) -> str:
    listed = ", ".join(
        f'{{name: {r}, metrics_url: "http://127.0.0.1:9/metrics", backend: vllm}}' for r in replicas
    )
    return f"listen: 127.0.0.1:{port}\nnode: node-a\nnvml: {{enabled: false}}\nreplicas: [{listed}]\n"


def test_a_sighup_during_start_up_is_held_and_applied(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "kvwatch.yaml"
    config.write_text(_config(port, ["first"]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwatch", "run", "--config", str(config)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    log: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the first log line: config read, the agent not yet imported
            log.append(line)
            if "open files limit" in line:
                break
        config.write_text(_config(port, ["first", "second"]))  # an edit while it starts ...
        proc.send_signal(signal.SIGHUP)  # ... and the reload that asks for it

        def reloaded_or_dead() -> str | bool:
            if proc.poll() is not None:
                return True  # the assertion below says how it died
            body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            return body if 'replica="second"' in body else ""

        body = wait_until(
            reloaded_or_dead,
            timeout_s=60,
            what="/metrics to show the replica the SIGHUP added",
            interval_s=0.1,
            retry_on=(httpx.HTTPError,),
        )
        assert proc.poll() is None, f"kvwatch died (exit {proc.returncode}) on a SIGHUP during start-up"
        assert 'kvwatch_target_up{backend="vllm",replica="second"}' in body
        assert 'kvwatch_target_up{backend="vllm",replica="first"}' in body
        assert "kvwatch_config_last_reload_successful 1.0" in body
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[1]
    log.append(rest)
    assert proc.returncode == 0, "".join(log)
    assert "config reloaded (SIGHUP during start-up)" in "".join(log)
