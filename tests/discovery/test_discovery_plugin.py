"""The vLLM plugin attached to discovered replicas: the engine-pod recipe of docs/vllm-plugin.md and the
discovery overlay name the same socket on the node, and datagrams from the plugin's own code (in this
process with vLLM's base class stood in for, and, marked real_vllm, inside the real vLLM venv with
vLLM's own stats classes) reach the discovered replica ``namespace/pod`` through the fake API server."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.agent import Agent
from kvwatch.config import ReplicaConfig, config_from_mapping
from kvwatch.discovery.plugin_dir import socket_path
from kvwatch.requests.vllm_plugin import PluginReceiver
from tests.deploy.manifests import KUBE, agent_config, build, kvwatch_container, kvwatch_pod
from tests.discovery.cluster import Cluster, scrape_until
from tests.local import CACHE, SKIP_REAL_ENGINES, unavailable, until

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins" / "vllm"))
from kvwatch_vllm_plugin import wire  # noqa: E402


def recipe_pod() -> dict[str, Any]:
    """The engine pod of docs/vllm-plugin.md (the YAML block with ``kind: Pod``)."""
    text = (ROOT / "docs" / "vllm-plugin.md").read_text(encoding="utf-8")
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    [pod] = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "Pod"]
    return pod


def _env(container: dict[str, Any], uid: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it (the downward API's metadata.uid)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "valueFrom" in item:
            assert item["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
            env[item["name"]] = uid
        else:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], item["value"])
    return env


def _on_node(pod_spec: dict[str, Any], container: dict[str, Any], path: str, env: dict[str, str]) -> str:
    """Where ``path`` inside ``container`` lies on the node: through its hostPath mount (and
    ``subPathExpr``, expanded as the kubelet does)."""
    mount = max(
        (m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")),
        key=lambda m: len(m["mountPath"]),
    )
    volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
    expression = mount.get("subPathExpr", mount.get("subPath", ""))
    sub = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], expression)
    rest = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    return os.path.normpath(os.path.join(volume["hostPath"]["path"], sub, rest))


def engine_socket_on_node(uid: str) -> tuple[str, str]:
    """(the node directory the kubelet makes for the recipe's subPathExpr, where its plugin sends)."""
    spec = recipe_pod()["spec"]
    container = next(c for c in spec["containers"] if c["name"] == "vllm")
    env = _env(container, uid)
    sends_to = wire.socket_path(env)  # what the plugin reads: KVWATCH_VLLM_SOCKET, else its default
    return os.path.dirname(_on_node(spec, container, sends_to, env)), _on_node(spec, container, sends_to, env)


def agent_socket_on_node(uid: str) -> str:
    """Where the discovery overlay's agent binds the socket of the pod with ``uid``, on the node."""
    objects = build(KUBE / "overlays" / "discovery")
    directory = agent_config(objects).discovery.kubernetes.vllm_plugin_dir
    assert directory is not None
    path = socket_path(directory, uid)
    assert path is not None
    pod = kvwatch_pod(objects)
    return _on_node(pod, kvwatch_container(pod), path, {})


UID = "6f1c0e0a-2b4d-4c8e-9a51-3d2f7b9e0c11"


def test_the_docs_engine_recipe_and_the_discovery_overlay_meet_at_one_socket() -> None:
    directory, sends_to = engine_socket_on_node(UID)
    assert sends_to == agent_socket_on_node(UID) == f"/run/kvwatch/vllm/{UID}/vllm.sock"
    assert directory == f"/run/kvwatch/vllm/{UID}"
    spec = recipe_pod()["spec"]
    mount = next(m for c in spec["containers"] for m in c["volumeMounts"] if m["name"] == "kvwatch-plugin")
    assert mount["readOnly"] is True  # the engine sends; it creates and removes nothing there
    objects = build(KUBE / "overlays" / "discovery")
    agent_mount = next(
        m
        for m in kvwatch_container(kvwatch_pod(objects))["volumeMounts"]
        if m["mountPath"] == "/run/kvwatch/vllm"
    )
    assert not agent_mount.get("readOnly")  # the agent binds there
    # the agent's group is the one the recipe adds: the sockets are mode 0660
    agent_group = kvwatch_pod(objects)["securityContext"]["runAsGroup"]
    assert agent_group in spec["securityContext"]["supplementalGroups"]


def test_the_docs_engine_recipe_is_a_valid_pod(tmp_path: Path) -> None:
    import subprocess

    rendered = tmp_path / "pod.yaml"
    rendered.write_text(yaml.safe_dump(recipe_pod()))
    command = [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.29.0", str(rendered)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and " passed for resource " in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("uid", ["../../etc", "uid-0001", "6f1c0e0a-2b4d-4c8e-9a51-3d2f7b9e0c11/x", ""])
def test_only_a_uuid_names_a_socket(uid: str) -> None:
    assert socket_path("/run/kvwatch/vllm", uid) is None


@pytest.fixture
def node_root() -> Iterator[Path]:
    """The node's filesystem root for the test (short: a socket path is at most 107 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="kvw", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def stat_logger(monkeypatch: pytest.MonkeyPatch) -> type:
    """The plugin's ``KvwatchStatLogger``, its vLLM base class stood in for (vLLM is not installed in
    the agent's venv; the base class only marks the type)."""
    loggers = types.ModuleType("vllm.v1.metrics.loggers")
    loggers.StatLoggerBase = object  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.v1", "vllm.v1.metrics"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.metrics.loggers", loggers)
    monkeypatch.delitem(sys.modules, "kvwatch_vllm_plugin.logger", raising=False)
    module = importlib.import_module("kvwatch_vllm_plugin.logger")
    monkeypatch.delitem(sys.modules, "kvwatch_vllm_plugin.logger")
    return module.KvwatchStatLogger


def _finished(output: int) -> SimpleNamespace:
    return SimpleNamespace(
        finish_reason="stop",
        e2e_latency=1.5,
        queued_time=0.25,
        prefill_time=0.25,
        decode_time=1.0,
        inference_time=1.25,
        num_prompt_tokens=100,
        num_generation_tokens=output,
        num_cached_tokens=0,
        max_tokens_param=2048,
        num_preemptions=0,
    )


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


async def _until_socket(path: str, present: bool = True, timeout_s: float = 10.0) -> None:
    await until(
        lambda: _is_socket(path) is present,
        timeout_s,
        f"{path}: socket {'bound' if present else 'removed'}",
        interval_s=0.05,
    )


#: run by the real vLLM venv's python: the plugin as vLLM loads it (vLLM's StatLoggerBase and stats
#: classes), its socket from the environment the recipe gives the engine container
IN_VLLM = """
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
from kvwatch_vllm_plugin.logger import KvwatchStatLogger
logger = KvwatchStatLogger(None, engine_index=0)
it = IterationStats()
it.finished_requests = [FinishedRequestStats(finish_reason=FinishReason.STOP, e2e_latency=1.5,
                                             num_prompt_tokens=100, num_generation_tokens=n,
                                             max_tokens_param=2048, queued_time=0.25, prefill_time=0.25,
                                             inference_time=1.25, decode_time=1.0) for n in (700, 1200)]
logger.record(SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.5), it)
assert logger.sender.sent >= 1 and logger.sender.dropped == 0, (logger.sender.sent, logger.sender.dropped)
"""


def _send_from_real_vllm(socket_env: str) -> None:
    python = CACHE / "kvwatch-vllm" / "venv" / "bin" / "python"
    if not python.exists():
        unavailable(
            f"real vLLM is not installed at {python}: run scripts/setup-test-env.sh", SKIP_REAL_ENGINES
        )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "plugins" / "vllm"),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        wire.SOCKET_ENV: socket_env,
    }
    proc = subprocess.run(
        [str(python), "-c", IN_VLLM], capture_output=True, text=True, env=env, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.engines(2)
@pytest.mark.parametrize(
    "sender", ["plugin", pytest.param("plugin_in_real_vllm", marks=pytest.mark.real_vllm)]
)
async def test_a_discovered_vllm_pod_gets_its_plugin_socket_and_its_datagrams(
    cluster: Cluster, node_root: Path, stat_logger: type, monkeypatch: pytest.MonkeyPatch, sender: str
) -> None:
    with_plugin = await cluster.ready_vllm_pod("qwen-7d9f8-x2k4q", cluster.ports[0])
    without = await cluster.ready_vllm_pod("qwen-7d9f8-b8zlm", cluster.ports[1])  # mounts no plugin dir
    pods = {p["metadata"]["uid"]: p for p in cluster.api.pods.values()}
    assert {with_plugin, without} <= pods.keys()

    # the kubelet makes the recipe's subPathExpr directory before the container starts
    kubelet_dir, sends_to = engine_socket_on_node(with_plugin)
    os.makedirs(f"{node_root}{kubelet_dir}", mode=0o755)
    agent_dir = f"{node_root}{os.path.dirname(os.path.dirname(agent_socket_on_node(with_plugin)))}"
    agent = Agent(cluster.watching_agent(vllm_plugin_dir=agent_dir))
    await agent.start()
    try:
        url = f"http://127.0.0.1:{agent.port}/metrics"
        await scrape_until(
            url,
            'kvwatch_target_up{backend="vllm",replica="llm/qwen-7d9f8-x2k4q"} 1.0',
            'kvwatch_target_up{backend="vllm",replica="llm/qwen-7d9f8-b8zlm"} 1.0',
        )
        await _until_socket(f"{node_root}{sends_to}")
        assert not os.path.exists(f"{node_root}/run/kvwatch/vllm/{without}")  # no opt-in, no socket

        # the plugin as vLLM constructs it in that pod: its environment, the node path it sends to
        _, inside = engine_socket_on_node(with_plugin)
        if sender == "plugin_in_real_vllm":
            await asyncio.to_thread(_send_from_real_vllm, f"{node_root}{inside}")
        else:
            monkeypatch.setenv(wire.SOCKET_ENV, f"{node_root}{inside}")
            logger = stat_logger(None, engine_index=0)
            iteration = SimpleNamespace(
                num_generation_tokens=7,
                num_preempted_reqs=0,
                finished_requests=[_finished(700), _finished(1200)],
            )
            scheduler = SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.5)
            logger.record(scheduler, iteration)
            assert logger.sender.sent >= 1 and logger.sender.dropped == 0
        replica = 'replica="llm/qwen-7d9f8-x2k4q"'
        body = await scrape_until(
            url,
            f'kvwatch_vllm_plugin_datagrams_total{{{replica},result="accepted"}} 1.0',
            # kvwatch_requests_total stays per replica in both metrics profiles
            'kvwatch_requests_total{length_band="0-1k",model_name="other",outcome="completed",'
            f'{replica},source="vllm_plugin"}} 1.0',
        )
        assert (
            'kvwatch_requests_total{length_band="1k-5k",model_name="other",outcome="completed",'
            f'{replica},source="vllm_plugin"}} 1.0' in body
        )
        assert 'replica="llm/qwen-7d9f8-b8zlm",result=' not in body

        await cluster.api.delete(with_plugin)  # the pod goes: its socket and plugin series go with it
        await scrape_until(
            url,
            'kvwatch_target_up{backend="vllm",replica="llm/qwen-7d9f8-b8zlm"} 1.0',
            absent=(
                f'kvwatch_target_up{{backend="vllm",{replica}}}',
                f'kvwatch_vllm_plugin_dropped_datagrams_total{{dp_rank="0",{replica}}}',
            ),
        )
        await _until_socket(f"{node_root}{sends_to}", present=False)
    finally:
        await agent.stop()


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("run/kvwatch", "expected an absolute directory"),
        ("/" + "d" * 60, "at most 60 bytes"),
    ],
)
def test_a_plugin_dir_that_cannot_hold_a_socket_is_refused(value: str, problem: str) -> None:
    from kvwatch.config import ConfigError, config_from_mapping

    with pytest.raises(ConfigError, match=problem) as refused:
        config_from_mapping({"discovery": {"kubernetes": {"vllm_plugin_dir": value}}})
    assert "discovery.kubernetes.vllm_plugin_dir" in str(refused.value)
    longest = "/" + "d" * 59  # 60 bytes + "/<uuid>/vllm.sock" (47) = 107, the socket path limit
    cfg = config_from_mapping({"discovery": {"kubernetes": {"vllm_plugin_dir": longest + "/"}}})
    assert cfg.discovery.kubernetes.vllm_plugin_dir == longest
    path = socket_path(longest, UID)
    assert path is not None and len(path.encode()) == 107


def _datagram(output: int) -> bytes:
    """One plugin datagram: a step and a finished request (the plugin's own encoder)."""
    header = {"v": wire.WIRE_VERSION, "e": 0, "p": 7, "n": 1, "t": 1000.0, "d": 0, "ds": 0}
    finished = {"reason": "stop", "e2e": 1.0, "queue": 0.1, "prompt": 10, "output": output, "preemptions": 1}
    [body] = wire.encode(header, [{"run": 1, "t": 1000.0, "preempted": 1}], [finished], [], 0)
    return wire.dumps(body)


def _receive(agent: Agent, replica: str, output: int = 700) -> None:
    """A datagram for ``replica`` handed on as its socket's receiver does (the agent's sinks)."""
    state = agent.state
    receiver = PluginReceiver(
        replica, "/nonexistent", "m", agent.record, state.plugin.observe, state.count, state.report
    )
    receiver.handle(_datagram(output))


def _replica_series(body: str, replica: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The request and plugin series of ``replica`` (what the agent counts, not what a scrape moves)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.labels.get("replica") == replica and s.name.startswith(("kvwatch_request", "kvwatch_vllm"))
    }


async def test_a_pod_that_goes_takes_its_request_series_and_a_reload_resets_no_kept_replica() -> None:
    config = config_from_mapping(
        {
            "listen": "127.0.0.1:0",
            "node": "node-a",
            "nvml": {"enabled": False},
            "replicas": [{"name": "static", "metrics_url": "http://127.0.0.1:9/metrics", "model_name": "m"}],
        }
    )
    pods = [ReplicaConfig(f"llm/{p}", "http://127.0.0.1:9/metrics", model_name="m") for p in "ab"]
    agent = Agent(config)
    await agent.start()
    try:
        url = f"http://127.0.0.1:{agent.port}/metrics"
        agent.set_discovered_replicas(tuple(pods))
        for replica in ("static", "llm/a", "llm/b"):
            _receive(agent, replica)
        body = await scrape_until(url, 'replica="llm/b",result="accepted"')
        kept = {replica: _replica_series(body, replica) for replica in ("static", "llm/a")}
        assert all(kept.values())

        # pod b is deleted; pod a keeps its name with another address; then the file reloads with a new
        # engine interval: every scrape job is replaced, and only b's series go
        agent.set_discovered_replicas(
            (dataclasses.replace(pods[0], metrics_url="http://127.0.0.2:9/metrics"),)
        )
        intervals = dataclasses.replace(config.intervals, engine_s=config.intervals.engine_s + 1)
        agent.apply_config(dataclasses.replace(agent.file_config, intervals=intervals))
        body = await scrape_until(url, absent=('replica="llm/b"',))
        assert {replica: _replica_series(body, replica) for replica in kept} == kept
        assert ("llm/b", "0") not in agent.state.plugin.snapshot()

        agent.set_discovered_replicas(tuple(pods))  # a pod of the same name again: counted from zero
        _receive(agent, "llm/b", output=5000)
        body = await scrape_until(url, 'replica="llm/b",result="accepted"} 1.0')
        completed = 'model_name="m",outcome="completed",replica="llm/b",source="vllm_plugin"}'
        assert f'kvwatch_requests_total{{length_band="5k-10k",{completed} 1.0' in body
        assert f'kvwatch_requests_total{{length_band="0-1k",{completed} 0.0' in body
    finally:
        await agent.stop()
