"""The kubelet's PodResources v1 gRPC service on a unix socket, built from the real api.proto.

Served with grpc.aio from the same generated stubs kvwatch uses, which are generated from the
kubelet's own ``api.proto``; so the wire format is the kubelet's. ``pods`` is what ``List`` answers:
``{(namespace, pod): {container: [(resource_name, [device ids]) or DraDevice]}}``, as the device
manager and the DRA manager report allocations (a container that requested nothing has no devices;
CPU-manager ids are left empty). What real kubelets do and a kinder fake would not:

- **MIG devices** come as their own resources under the device plugin's "mixed" strategy
  (``nvidia.com/mig-1g.18gb``) with ``MIG-<uuid>`` ids (``FakeNvml.add_mig_device`` makes them);
- **DRA claims** (``ContainerResources.dynamic_resources``, kubelet 1.27+ with
  ``KubeletPodResourcesDynamicResources``) name a driver, pool and device, never a GPU UUID;
- **pods in a terminal phase** stay listed with their devices (kubernetes issue 119423: ``List``
  reports Succeeded and Failed pods, whose devices the device manager may already have given to a
  new pod): a test keeps the pod's entry after the API server reports it terminal, and gives its
  device to the next pod, so ``pods`` holds both the dead and the new holder.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvwatch.third_party.podresources_v1 import api_pb2, api_pb2_grpc


@dataclass(frozen=True)
class DraDevice:
    """One device of a container's ResourceClaim, as ``ClaimResource`` carries it."""

    claim: str
    driver: str
    pool: str
    device: str


Allocation = dict[tuple[str, str], dict[str, list[tuple[str, list[str]] | DraDevice]]]


class FakeKubelet(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, socket_path: str, pods: Allocation | None = None) -> None:
        self.socket_path = socket_path
        self.pods: Allocation = pods or {}
        self.calls = 0
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self._server = grpc.aio.server()
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket_path}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    async def List(self, request, context):
        self.calls += 1
        response = api_pb2.ListPodResourcesResponse()
        for (namespace, name), containers in self.pods.items():
            pod = response.pod_resources.add(name=name, namespace=namespace)
            for container_name, devices in containers.items():
                container = pod.containers.add(name=container_name)
                for entry in devices:
                    if isinstance(entry, DraDevice):
                        claim = container.dynamic_resources.add(
                            claim_name=entry.claim, claim_namespace=namespace
                        )
                        claim.claim_resources.add(
                            driver_name=entry.driver, pool_name=entry.pool, device_name=entry.device
                        )
                    else:
                        resource_name, ids = entry
                        container.devices.add(resource_name=resource_name, device_ids=ids)
        return response

    async def GetAllocatableResources(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not served by this fake")

    async def Get(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not served by this fake")
