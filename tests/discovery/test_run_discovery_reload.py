"""``kvwatch run`` end to end: pods discovered through a fake API server in front of simulated vLLM
servers, and its config reloaded from a ConfigMap-style volume (``..data`` symlink swap) and SIGHUP."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.discovery.cluster import Cluster, scrape_until
from tests.discovery.fake_apiserver import FakeApiServer
from tests.local import free_port


class ConfigMapVolume:
    """A directory laid out as the kubelet's AtomicWriter lays out a ConfigMap volume."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.version = 0

    def write(self, text: str) -> None:
        self.version += 1
        stamp = self.root / f"..2026_12_01_18_00_{self.version:02d}.000000001"
        stamp.mkdir()
        (stamp / "kvwatch.yaml").write_text(text)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(stamp.name)
        os.replace(tmp, self.root / "..data")  # the atomic swap
        link = self.root / "kvwatch.yaml"
        if not link.is_symlink():
            link.symlink_to("..data/kvwatch.yaml")

    @property
    def path(self) -> str:
        return str(self.root / "kvwatch.yaml")


def _config(api: FakeApiServer, token: Path, listen: int, extra: str = "") -> str:
    return f"""
listen: 127.0.0.1:{listen}
node: node-a
nvml: {{enabled: false}}
intervals: {{engine: 300ms}}
discovery:
  kubernetes: {{enabled: true, api_url: "{api.url}", token_file: "{token}", ca_file: null, backoff_max: 1s}}
{extra}"""


@pytest.mark.engines(2)
async def test_kvwatch_run_discovers_pods_and_reloads_its_configmap(tmp_path, cluster: Cluster):
    api, token, ports = cluster.api, cluster.token, cluster.ports
    await cluster.ready_vllm_pod("qwen-0", ports[0])
    volume_dir = tmp_path / "config"
    volume_dir.mkdir()
    volume = ConfigMapVolume(volume_dir)
    listen = free_port()
    volume.write(_config(api, token, listen))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvwatch.cli",
        "run",
        "--config",
        volume.path,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{listen}/metrics"
    try:
        await scrape_until(
            url,
            'kvwatch_target_up{backend="vllm",replica="llm/qwen-0"} 1.0',
            "kvwatch_config_last_reload_successful 1.0",
        )
        # the ConfigMap gains a static replica: the kubelet swaps ..data; kvwatch follows
        static = f'replicas: [{{name: bare-1, metrics_url: "http://127.0.0.1:{ports[1]}/metrics"}}]'
        volume.write(_config(api, token, listen, static))
        await scrape_until(
            url,
            'kvwatch_target_up{backend="vllm",replica="bare-1"} 1.0',
            'kvwatch_target_up{backend="vllm",replica="llm/qwen-0"} 1.0',
        )
        # a bad edit: refused, the running config kept, the metric says so
        volume.write(_config(api, token, listen, static).replace("{engine: 300ms}", "{engine: fast}"))
        body = await scrape_until(url, "kvwatch_config_last_reload_successful 0.0")
        assert 'kvwatch_target_up{backend="vllm",replica="bare-1"} 1.0' in body
        # fixed in place (no swap) and SIGHUP: applied; bare-1 gone with its series
        Path(os.path.realpath(volume.path)).write_text(_config(api, token, listen))
        proc.send_signal(signal.SIGHUP)
        await scrape_until(
            url,
            "kvwatch_config_last_reload_successful 1.0",
            'kvwatch_target_up{backend="vllm",replica="llm/qwen-0"} 1.0',
            absent=('replica="bare-1"',),
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, stderr = await asyncio.wait_for(proc.communicate(), 20)
        except TimeoutError:
            proc.kill()
            _, stderr = await proc.communicate()
    log = stderr.decode()
    assert proc.returncode == 0, log[-3000:]
    assert "config reload" in log and "intervals.engine: expected a duration" in log
    assert "replica llm/qwen-0 discovered" in log


def test_a_reload_applies_what_it_can_and_keeps_what_needs_a_restart():
    from kvwatch.agent.reload import applicable, restart_only_changes
    from kvwatch.config import config_from_mapping

    running = config_from_mapping(
        {
            "listen": "127.0.0.1:9477",
            "intervals": {"engine": "5s"},
            "replicas": [
                {
                    "name": "a",
                    "metrics_url": "http://127.0.0.1:8000/metrics",
                    "api_url": "http://127.0.0.1:8000",
                    "proxy_listen": "127.0.0.1:8080",
                }
            ],
        }
    )
    new = config_from_mapping(
        {
            "listen": "127.0.0.1:9999",
            "intervals": {"engine": "1s"},
            "replicas": [
                {"name": "a", "metrics_url": "http://127.0.0.1:8001/metrics"},
                {
                    "name": "b",
                    "metrics_url": "http://127.0.0.1:8002/metrics",
                    "api_url": "http://127.0.0.1:8002",
                    "proxy_listen": "127.0.0.1:8081",
                },
            ],
        }
    )
    assert restart_only_changes(running, new) == ["listen", "replicas[].proxy_listen"]
    applied = applicable(running, new)
    assert applied.listen == running.listen and applied.intervals.engine_s == 1.0
    assert [(r.name, r.metrics_url, r.proxy_listen) for r in applied.replicas] == [
        ("a", "http://127.0.0.1:8001/metrics", running.replicas[0].proxy_listen),
        ("b", "http://127.0.0.1:8002/metrics", None),
    ]


def test_a_reload_keeps_the_gpu_intervals_and_a_proxied_replicas_model_and_says_so():
    # the GPU and process-map jobs are scheduled once, and a proxy labels with the model it started
    # with: a reload logged "config reloaded" and changed neither, without a word
    from kvwatch.agent.reload import applicable, restart_only_changes
    from kvwatch.config import config_from_mapping

    def config(gpu: str, model: str) -> object:
        replica = {
            "name": "a",
            "metrics_url": "http://127.0.0.1:8000/metrics",
            "api_url": "http://127.0.0.1:8000",
            "proxy_listen": "127.0.0.1:8080",
            "model_name": model,
        }
        return config_from_mapping(
            {"intervals": {"engine": "5s", "gpu": gpu, "process_map": "30s"}, "replicas": [replica]}
        )

    running, new = config("60s", "qwen"), config("1s", "llama")
    assert restart_only_changes(running, new) == [
        "intervals.gpu",
        "replicas[].model_name of a proxied replica",
    ]
    applied = applicable(running, new)
    assert (applied.intervals.gpu_s, applied.replicas[0].model_name) == (60.0, "qwen")
    assert restart_only_changes(running, running) == []
