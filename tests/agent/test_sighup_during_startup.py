"""A SIGHUP while ``kvwatch run`` is still starting (a ConfigMap edit lands, or ``systemctl reload``
races the start) does not kill it (SIGHUP's default action ends a process); the reload it asked
for is done once the agent runs."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import httpx

from tests.local import free_port, kvwatch_run, kvwatch_run_refused, wait_until

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
    proc = kvwatch_run("--config", str(config))
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


def test_the_command_lines_log_level_outlives_a_reload(tmp_path: Path) -> None:
    # a reload set the file's level: --log-level warning gave way to info at the first SIGHUP
    port = free_port()
    config = tmp_path / "kvwatch.yaml"
    config.write_text(_config(port, ["first"]) + "log_level: info\n")
    proc = kvwatch_run("--config", str(config), "--log-level", "warning")
    try:

        def serving(added: str) -> str:
            body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            return body if f'replica="{added}"' in body else ""

        wait_until(
            lambda: serving("first"), 60, "the agent to serve", interval_s=0.1, retry_on=(httpx.HTTPError,)
        )
        config.write_text(_config(port, ["first", "second"]) + "log_level: info\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: serving("second"), 60, "the reload", interval_s=0.1, retry_on=(httpx.HTTPError,))
    finally:
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=30)[1]
    assert proc.returncode == 0, log[-3000:]
    assert " INFO " not in log and "config reloaded" not in log, log[-3000:]  # an INFO line, held back


def test_a_blank_kvwatch_config_is_no_config(tmp_path: Path) -> None:
    # docs/config.md: a blank KVWATCH_* value is unset; KVWATCH_CONFIG= was read as the path ""
    with socket.create_server(("127.0.0.1", 0)) as taken:  # the agent gets past its config, then stops
        port = taken.getsockname()[1]
        result = kvwatch_run_refused("--listen", f"127.0.0.1:{port}", KVWATCH_NVML__ENABLED="false")
    assert result.returncode == 1 and "address already in use" in result.stderr.lower(), result.stderr[-2000:]
    assert "cannot read" not in result.stderr
