"""GPU -> pod attribution where the kubelet is less kind than the first fake: MIG devices, DRA claims,
and devices still listed for pods in a terminal phase (kubernetes issue 119423)."""

from __future__ import annotations

import pytest

from kvwatch.agent import Agent
from kvwatch.derive.gpu_mapping import GpuRef, attributable_grants
from kvwatch.discovery.podresources import list_grants
from kvwatch.gpu.fake import FakeNvml, _uuid_for
from kvwatch.model import GpuGrant
from tests.discovery.cluster import Cluster, scrape_until
from tests.discovery.fake_apiserver import make_pod, vllm_container
from tests.discovery.fake_kubelet import DraDevice, FakeKubelet

GPU0, GPU1 = _uuid_for(0), _uuid_for(1)
GPUS = [GpuRef(0, GPU0), GpuRef(1, GPU1)]
MIG_RESOURCE = "nvidia.com/mig-1g.18gb"
DRA = DraDevice("gpu-claim", "gpu.nvidia.com", "node-a", "gpu-0")


def _owner(gpu: int, uuid: str, namespace: str = "", pod: str = "", container: str = "") -> str:
    return (
        f'kvwatch_gpu_memory_used_bytes{{container="{container}",gpu="{gpu}",namespace="{namespace}",'
        f'pod="{pod}",uuid="{uuid}"}}'
    )


def _mapped(replica: str, gpu: int, uuid: str) -> str:
    return (
        f'kvwatch_replica_gpu_info{{dp_rank="",gpu="{gpu}",mapped_by="pod_resources",replica="{replica}",'
        f'uuid="{uuid}"}} 1.0'
    )


async def test_the_fake_kubelet_serves_mig_and_dra_and_kvwatch_reads_both(tmp_path):
    mig = FakeNvml(1).add_mig_device(0)
    kubelet = FakeKubelet(
        str(tmp_path / "kubelet.sock"),
        {
            ("llm", "small"): {"vllm": [(MIG_RESOURCE, [mig])]},
            ("llm", "dra"): {"vllm": [DRA, ("nvidia.com/gpu", [])]},
        },
    )
    await kubelet.start()
    try:
        grants = await list_grants(kubelet.socket_path, ("nvidia.com/gpu",), 2.0)
    finally:
        await kubelet.stop()
    assert grants == (
        GpuGrant("llm", "small", "vllm", MIG_RESOURCE, mig),
        GpuGrant("llm", "dra", "vllm", "gpu.nvidia.com", "node-a/gpu-0", dra=True),
    )


def test_a_device_listed_for_two_pods_names_neither_without_their_phases():
    grants = [
        GpuGrant("llm", "old", "vllm", "nvidia.com/gpu", GPU1),
        GpuGrant("llm", "new", "vllm", "nvidia.com/gpu", GPU1),
        GpuGrant("llm", "ts", "a", "nvidia.com/gpu", f"{GPU0}::0"),  # time-sliced: own ids
        GpuGrant("llm", "ts2", "b", "nvidia.com/gpu", f"{GPU0}::1"),
        GpuGrant("llm", "init", "init", "nvidia.com/gpu", "0"),  # an init container's device ...
        GpuGrant("llm", "init", "main", "nvidia.com/gpu", "0"),
    ]  # ... reused in its pod
    result = attributable_grants(grants, GPUS)
    assert {(g.pod, g.device_id) for g in result.grants} == {
        ("ts", f"{GPU0}::0"),
        ("ts2", f"{GPU0}::1"),
        ("init", "0"),
    }
    assert result.unattributed["stale_duplicate"] == 2
    known = attributable_grants(grants, GPUS, terminal_pods={("llm", "old")})
    assert ("new", GPU1) in {(g.pod, g.device_id) for g in known.grants}
    assert known.unattributed["terminal_pod"] == 1 and known.unattributed["stale_duplicate"] == 0


def test_mig_ids_stand_for_their_gpu_in_both_driver_forms():
    new_form = "MIG-5f1e0d2c-aaaa-bbbb-cccc-000000000000"
    old_form = f"MIG-{GPU1}/3/0"  # drivers before R470: MIG-<GPU UUID>/<GPU instance>/<compute instance>
    grants = [
        GpuGrant("llm", "a", "c", MIG_RESOURCE, new_form),
        GpuGrant("llm", "b", "c", MIG_RESOURCE, old_form),
        GpuGrant("llm", "c", "c", MIG_RESOURCE, "MIG-ffffffff-0000-0000-0000-000000000000"),
    ]
    result = attributable_grants(grants, GPUS, mig_parents={new_form: GPU0})
    assert [(g.pod, g.device_id) for g in result.grants] == [("a", GPU0), ("b", GPU1)]
    assert result.unattributed["mig_unresolved"] == 1


@pytest.mark.engines(2)
async def test_mig_dra_and_terminal_pods_on_a_real_watch_and_kubelet(tmp_path, cluster: Cluster):
    api, ports = cluster.api, cluster.ports
    nvml = FakeNvml(2)
    mig = nvml.add_mig_device(0)
    job = await cluster.ready_vllm_pod("batch-job", ports[0])
    await cluster.ready_vllm_pod("small", ports[1])
    kubelet = FakeKubelet(
        str(tmp_path / "kubelet.sock"),
        {
            ("llm", "batch-job"): {"vllm": [("nvidia.com/gpu", [GPU1])]},
            ("llm", "small"): {"vllm": [(MIG_RESOURCE, [mig])]},
            ("llm", "dra-pod"): {"vllm": [DRA]},
        },
    )
    await kubelet.start()
    config = cluster.attributing_agent(kubelet.socket_path)
    agent = Agent(config, nvml=nvml)
    await agent.start()
    url = f"http://127.0.0.1:{agent.port}/metrics"
    try:
        # the MIG device's GPU is its pod's; the DRA claim is counted, not guessed
        await scrape_until(
            url,
            _owner(0, GPU0, "llm", "small", "vllm"),
            _owner(1, GPU1, "llm", "batch-job", "vllm"),
            _mapped("llm/small", 0, GPU0),
            'kvwatch_gpu_grants_unattributed{reason="dra"} 1.0',
        )

        # the job ends; the kubelet keeps listing it and hands its GPU to the next pod
        await api.finish(job)
        await api.create(make_pod("qwen-next", containers=[vllm_container(ports[0])]))
        uid = next(u for u, p in api.pods.items() if p["metadata"]["name"] == "qwen-next")
        await api.run(uid, "127.0.0.1")
        await api.set_ready(uid)
        kubelet.pods = {**kubelet.pods, ("llm", "qwen-next"): {"vllm": [("nvidia.com/gpu", [GPU1])]}}
        body = await scrape_until(
            url,
            _owner(1, GPU1, "llm", "qwen-next", "vllm"),
            _mapped("llm/qwen-next", 1, GPU1),
            'kvwatch_gpu_grants_unattributed{reason="terminal_pod"} 1.0',
        )
        assert 'pod="batch-job"' not in body
        assert 'kvwatch_gpu_grants_unattributed{reason="stale_duplicate"} 0.0' in body
    finally:
        await agent.stop()
        await kubelet.stop()
