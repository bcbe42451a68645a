"""GPU -> pod/container attribution from the kubelet's PodResources API, without hostPID."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvwatch.agent import Agent
from kvwatch.derive.gpu_mapping import GpuRef, resolve_device_id
from kvwatch.discovery.podresources import PodResourcesError, list_grants
from kvwatch.gpu.fake import FakeNvml, _uuid_for
from kvwatch.model import GpuGrant
from tests.discovery.cluster import Cluster, scrape_until
from tests.discovery.fake_kubelet import FakeKubelet

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "kvwatch" / "third_party" / "podresources_v1"
GPU0, GPU1 = _uuid_for(0), _uuid_for(1)


#: where a generator writes its own version into the stubs: the oldest grpcio / protobuf runtime they
#: import on (each stub refuses an older one at import)
GRPC_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.M)
PROTOBUF_STAMP = re.compile(
    r"^# Protobuf Python Version: ([0-9.]+)$|"
    r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
    re.M,
)


def _unstamped(text: str) -> str:
    return PROTOBUF_STAMP.sub("<protobuf version>", GRPC_STAMP.sub("<grpc version>", text))


def _floor(requirements: list[str], package: str) -> str:
    """The ``>=`` version of ``package`` in a list of PEP 508 requirements."""
    (found,) = (m.group(1) for r in requirements if (m := re.fullmatch(rf"{package}>=([0-9.]+)(,.*)?", r)))
    return found


def test_committed_stubs_are_what_the_kubelets_proto_generates(tmp_path):
    """Byte for byte, but for the version the generator stamps into them: any grpcio-tools release
    writes its own there, so the committed stamps are checked against the project's floors instead
    (stubs stamped above ``grpcio>=`` / ``protobuf>=`` would refuse an allowed runtime at import)."""
    pytest.importorskip("grpc_tools")
    subprocess.run(
        ["sh", str(ROOT / "scripts" / "gen-podresources.sh"), str(tmp_path)],
        check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        cwd=ROOT,
    )
    for name in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"):
        generated, committed = ((d / name).read_text() for d in (tmp_path, STUBS))
        assert _unstamped(generated) == _unstamped(committed), f"{name} is stale: run the script"
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    grpc_stamp = GRPC_STAMP.search((STUBS / "api_pb2_grpc.py").read_text())
    assert grpc_stamp is not None and grpc_stamp.group(1) == _floor(requirements, "grpcio")
    protobuf_stamps = PROTOBUF_STAMP.findall((STUBS / "api_pb2.py").read_text())
    assert [v or ".".join(parts) for v, *parts in protobuf_stamps] == [_floor(requirements, "protobuf")] * 2


@pytest.mark.parametrize(
    ("device_id", "expected"),
    [
        (GPU1, 1),
        (GPU1.lower(), 1),
        ("1", 1),
        (f"{GPU0}::3", 0),
        ("nvidia1", 1),
        ("nvidia0/vgpu2", 0),
        ("MIG-5f1e0d2c-aaaa-bbbb-cccc-000000000000", None),
        ("GPU-00000000-dead", None),
        ("7", None),
    ],
)
def test_device_ids_as_device_plugins_report_them(device_id, expected):
    gpus = [GpuRef(0, GPU0), GpuRef(1, GPU1)]
    ref = resolve_device_id(device_id, gpus)
    assert (ref.index if ref else None) == expected


async def test_list_reads_gpu_grants_over_the_kubelet_socket(tmp_path):
    kubelet = FakeKubelet(
        str(tmp_path / "kubelet.sock"),
        {
            ("llm", "qwen-0"): {
                "vllm": [("nvidia.com/gpu", [GPU0, GPU1]), ("example.com/nic", ["eth7"])],
                "sidecar": [],
            },
            ("monitoring", "dcgm-exporter-x"): {"exporter": []},
        },
    )
    await kubelet.start()
    try:
        grants = await list_grants(kubelet.socket_path, ("nvidia.com/gpu",), 2.0)
    finally:
        await kubelet.stop()
    assert grants == (
        GpuGrant("llm", "qwen-0", "vllm", "nvidia.com/gpu", GPU0),
        GpuGrant("llm", "qwen-0", "vllm", "nvidia.com/gpu", GPU1),
    )


async def test_a_missing_socket_is_an_error_that_names_it(tmp_path):
    with pytest.raises(PodResourcesError, match=r"kubelet\.sock"):
        await list_grants(str(tmp_path / "kubelet.sock"), ("nvidia.com/gpu",), 0.5)


async def test_gpu_series_carry_the_pod_and_the_replica_map_needs_no_process_scan(tmp_path, cluster: Cluster):
    await cluster.ready_vllm_pod("qwen-0", cluster.ports[0])
    kubelet = FakeKubelet(
        str(tmp_path / "kubelet.sock"), {("llm", "qwen-0"): {"vllm": [("nvidia.com/gpu", [GPU1])]}}
    )
    await kubelet.start()
    config = cluster.attributing_agent(kubelet.socket_path)

    class NoProcessScan:
        def tree(self, pid):
            raise AssertionError("a process scan was attempted")

    agent = Agent(config, nvml=FakeNvml(2), proc=NoProcessScan())
    await agent.start()
    url = f"http://127.0.0.1:{agent.port}/metrics"
    try:
        body = await scrape_until(
            url,
            f'kvwatch_gpu_memory_used_bytes{{container="vllm",gpu="1",namespace="llm",pod="qwen-0",'
            f'uuid="{GPU1}"}}',
            f'kvwatch_replica_gpu_info{{dp_rank="",gpu="1",mapped_by="pod_resources",replica="llm/qwen-0",'
            f'uuid="{GPU1}"}} 1.0',
        )
        unowned = f'kvwatch_gpu_memory_used_bytes{{container="",gpu="0",namespace="",pod="",uuid="{GPU0}"}}'
        assert unowned in body
        assert 'kvwatch_collector_success{collector="pod_resources"} 1.0' in body
        kubelet.pods = {}  # the pod went away: the GPU is nobody's
        await scrape_until(
            url, f'kvwatch_gpu_memory_used_bytes{{container="",gpu="1",namespace="",pod="",uuid="{GPU1}"}}'
        )
        await kubelet.stop()
        await scrape_until(url, 'kvwatch_collector_success{collector="pod_resources"} 0.0')
    finally:
        await agent.stop()
        await kubelet.stop()
