"""Which container holds which GPU, from the kubelet's PodResources API (no hostPID, no /proc).

gRPC over the kubelet's unix socket (``/var/lib/kubelet/pod-resources/kubelet.sock``), v1 ``List``,
as dcgm-exporter does: every pod of the node with its containers and, per container, the devices
the device plugins allocated (``resource_name`` + ``device_ids``). Only ``resource_names`` count
(``nvidia.com/gpu`` by default; add e.g. ``nvidia.com/gpu.shared`` for time-slicing renames). The
stubs in ``kvwatch/third_party/podresources_v1/`` are generated from the kubelet's ``api.proto``
and committed (no build step for a pure-Python package, no protoc at install time);
``scripts/gen-podresources.sh`` regenerates them and a test checks they are current.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvwatch.model import GpuGrant


class PodResourcesError(Exception):
    """The kubelet could not be asked (socket missing, refused, timed out, unimplemented)."""


#: MIG devices under the NVIDIA device plugin's "mixed" strategy (nvidia.com/mig-1g.18gb, ...):
#: always GPUs, as dcgm-exporter's ``NvidiaMigResourcePrefix`` takes them
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
#: the DRA drivers whose devices are GPUs (dcgm-exporter's ``DRAGPUDriverName``)
DRA_GPU_DRIVERS = frozenset({"gpu.nvidia.com"})


def grants(pod_resources: Iterable[Any], resource_names: Sequence[str]) -> tuple[GpuGrant, ...]:
    """Flatten a ``ListPodResourcesResponse.pod_resources`` into one grant per allocated device:
    device-plugin devices of ``resource_names`` and MIG resources, and the GPU devices of each
    container's DRA claims (``dynamic_resources``, marked ``dra``)."""
    wanted = set(resource_names)
    out = []
    for pod in pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                name = devices.resource_name
                if name not in wanted and not name.startswith(MIG_RESOURCE_PREFIX):
                    continue
                for device_id in devices.device_ids:
                    out.append(GpuGrant(pod.namespace, pod.name, container.name, name, device_id))
            for claim in container.dynamic_resources:
                for resource in claim.claim_resources:
                    if resource.driver_name in DRA_GPU_DRIVERS:
                        out.append(
                            GpuGrant(
                                pod.namespace,
                                pod.name,
                                container.name,
                                resource.driver_name,
                                f"{resource.pool_name}/{resource.device_name}",
                                dra=True,
                            )
                        )
    return tuple(out)


async def list_grants(socket: str, resource_names: Sequence[str], timeout_s: float) -> tuple[GpuGrant, ...]:
    """One ``List`` call on the kubelet's socket."""
    import grpc

    from kvwatch.third_party.podresources_v1 import api_pb2, api_pb2_grpc

    try:
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            response = await stub.List(api_pb2.ListPodResourcesRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise PodResourcesError(
            f"kubelet PodResources List on {socket}: {exc.code().name}: {exc.details()}"
        ) from None
    return grants(response.pod_resources, resource_names)
