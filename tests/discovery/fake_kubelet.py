"""The kubelet's PodResources v1 gRPC service on a unix socket, built from the real api.proto.

Served with grpc.aio from the same generated stubs kvwatch uses, which are generated from the
kubelet's own ``api.proto``; so the wire format is the kubelet's. ``pods`` is what ``List`` answers:
``{(namespace, pod): {container: [(resource_name, [device ids])]}}``, as the device manager reports
allocations (a container that requested nothing has no devices; CPU-manager ids are left empty).
"""

from __future__ import annotations

import grpc

from kvwatch.discovery.podresources_v1 import api_pb2, api_pb2_grpc

Allocation = dict[tuple[str, str], dict[str, list[tuple[str, list[str]]]]]


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
                for resource_name, ids in devices:
                    container.devices.add(resource_name=resource_name, device_ids=ids)
        return response

    async def GetAllocatableResources(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not served by this fake")

    async def Get(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not served by this fake")
