"""The agent follows engine pods on its node: simulated vLLM servers behind pods of a fake API server."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvwatch.agent import Agent
from kvwatch.config import (
    DiscoveryConfig,
)
from tests.discovery.cluster import Cluster, scrape_until
from tests.discovery.fake_apiserver import make_pod, vllm_container


def _url(agent: Agent) -> str:
    return f"http://127.0.0.1:{agent.port}/metrics"


async def _until(agent: Agent, *present: str, absent: tuple[str, ...] = ()) -> str:
    return await scrape_until(_url(agent), *present, absent=absent)


UP_0 = 'kvwatch_target_up{backend="vllm",replica="llm/qwen-0"} 1.0'
UP_1 = 'kvwatch_target_up{backend="vllm",replica="llm/qwen-1"} 1.0'
READY_0 = 'kvwatch_discovery_replica_ready{{replica="llm/qwen-0"}} {}.0'
KV_0 = (
    'kvwatch_kv_capacity_tokens{backend="vllm",dp_rank="0",'
    'model_name="meta-llama/Llama-3.1-8B-Instruct",replica="llm/qwen-0"}'
)


@pytest.mark.engines(2)
async def test_engine_pods_become_replicas_while_ready_and_drop_out_when_they_go(cluster: Cluster, caplog):
    caplog.set_level(logging.INFO, logger="kvwatch")
    api, ports = cluster.api, cluster.ports
    qwen0 = await api.create(make_pod("qwen-0", containers=[vllm_container(ports[0])]))
    qwen1 = await api.create(make_pod("qwen-1", containers=[vllm_container(ports[1])]))
    bad = await api.create(
        make_pod("typo", annotations={"kvwatch.io/port": "80800"}, containers=[vllm_container(ports[1])])
    )
    await api.create(make_pod("not-an-engine", containers=[{"name": "redis", "image": "redis:7"}]))
    agent = Agent(cluster.watching_agent())
    await agent.start()
    try:
        body = await _until(agent, "kvwatch_discovery_replicas 0.0", "kvwatch_discovery_stale 0.0")
        assert "llm/qwen-0" not in body  # Pending: not a replica yet
        for uid in (qwen0, qwen1, bad):
            await api.run(uid, "127.0.0.1")
        body = await _until(agent, "kvwatch_discovery_replicas 0.0")  # running but not Ready
        for uid in (qwen0, qwen1, bad):
            await api.set_ready(uid)
        body = await _until(agent, UP_0, UP_1, KV_0, "kvwatch_discovery_replicas 2.0")
        assert (
            'kvwatch_discovery_pod_annotation_errors{annotation="kvwatch.io/port",namespace="llm",'
            'pod="typo"} 1.0'
        ) in body
        assert (
            "pod llm/typo: kvwatch.io/port: port 80800 out of range 1..65535; not scraped until fixed"
            in caplog.text
        )
        assert "not-an-engine" not in body

        await api.restart_container(qwen0)  # not ready while it restarts: still a replica, said so
        await _until(agent, UP_1, KV_0, READY_0.format(0))
        await api.set_ready(qwen0)
        await _until(agent, UP_0, KV_0, READY_0.format(1))

        await api.delete(qwen0)
        await _until(agent, UP_1, "kvwatch_discovery_replicas 1.0", absent=('replica="llm/qwen-0"',))
        await api.delete(qwen1)  # ... and comes back on another node: not this agent's any more
        moved = make_pod("qwen-1", node="node-b", containers=[vllm_container(ports[1])])
        uid = await api.create(moved)
        await api.run(uid, "127.0.0.1")
        await api.set_ready(uid)
        fixed = {"kvwatch.io/port": str(ports[1])}
        await api.update(bad, lambda p: p["metadata"]["annotations"].update(fixed))
        body = await _until(
            agent,
            'kvwatch_target_up{backend="vllm",replica="llm/typo"} 1.0',
            absent=('replica="llm/qwen-1"', "kvwatch_discovery_pod_annotation_errors{"),
        )
        assert "replica llm/qwen-0 gone" in caplog.text
    finally:
        await agent.stop()


async def test_known_pods_stay_while_the_api_is_unreachable_and_the_agent_says_so(cluster: Cluster):
    api = cluster.api
    await cluster.ready_vllm_pod("qwen-0", cluster.ports[0])
    agent = Agent(cluster.watching_agent())
    await agent.start()
    try:
        await _until(agent, UP_0, "kvwatch_discovery_stale 0.0")
        await api.stop()
        body = await _until(agent, "kvwatch_discovery_stale 1.0", UP_0)  # still scraped
        assert 'kvwatch_collector_success{collector="kubernetes"} 0.0' in body
        await api.start()  # the same port again
        await _until(agent, "kvwatch_discovery_stale 0.0", UP_0)
    finally:
        await agent.stop()


@pytest.mark.engines(2)
async def test_a_replica_failing_its_readiness_probe_stays_with_its_series(cluster: Cluster, caplog):
    """An overloaded engine fails its readiness probe exactly when it matters: the replica, its
    series and its scrape job stay while the pod is Running (Prometheus' pod discovery keeps the
    target too, with __meta_kubernetes_pod_ready="false"), and kvwatch_discovery_replica_ready says 0.
    A pod never seen Ready is not a replica yet; one that stops running drops out."""
    caplog.set_level(logging.INFO, logger="kvwatch")
    api, ports = cluster.api, cluster.ports
    uid = await cluster.ready_vllm_pod("qwen-0", ports[0])
    starting = await api.create(make_pod("qwen-1", containers=[vllm_container(ports[1])]))
    await api.run(starting, "127.0.0.1")  # Running, never Ready: loading its model
    agent = Agent(cluster.watching_agent())
    await agent.start()
    try:
        await _until(agent, UP_0, KV_0, READY_0.format(1), "kvwatch_discovery_replicas 1.0")
        await api.set_ready(uid, False)  # the readiness probe fails under load
        body = await _until(agent, READY_0.format(0))
        assert UP_0 in body and KV_0 in body and "kvwatch_discovery_replicas 1.0" in body
        assert 'replica="llm/qwen-1"' not in body
        assert "replica llm/qwen-0: pod not ready (readiness probe failing); still scraped" in caplog.text
        await api.set_ready(uid, True)
        await _until(agent, READY_0.format(1))
        assert caplog.text.count("replica llm/qwen-0 discovered") == 1  # never dropped and re-added
        await api.set_ready(uid, False)
        await api.update(uid, lambda p: p["status"].update(phase="Failed"))  # no longer running: gone
        await _until(agent, "kvwatch_discovery_replicas 0.0", absent=('replica="llm/qwen-0"',))
    finally:
        await agent.stop()


async def test_a_missing_ca_file_stops_discovery_with_a_line_naming_it(cluster: Cluster, tmp_path, caplog):
    api = cluster.api
    config = cluster.watching_agent()
    kube = dataclasses.replace(
        config.discovery.kubernetes,
        api_url=f"https://127.0.0.1:{api.port}",
        ca_file=str(tmp_path / "missing-ca.crt"),
    )
    agent = Agent(dataclasses.replace(config, discovery=DiscoveryConfig(kubernetes=kube)))
    await agent.start()
    try:
        await _until(agent, 'kvwatch_collector_success{collector="kubernetes"} 0.0')
        assert "kubernetes discovery cannot start: discovery.kubernetes.ca_file" in caplog.text
        assert "missing-ca.crt' does not exist" in caplog.text
        assert not api.requests
    finally:
        await agent.stop()
