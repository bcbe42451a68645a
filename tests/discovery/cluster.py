"""A small cluster for discovery tests: simulated vLLM servers, a fake API server, a service account
token file (the ``cluster`` fixture of conftest.py builds one); and a /metrics poller."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from kvwatch.config import (
    Config,
    DiscoveryConfig,
    HostPort,
    IntervalsConfig,
    KubernetesDiscoveryConfig,
    NvmlConfig,
    PodResourcesConfig,
    ScrapeConfig,
)
from kvwatch.sim.node import SimNode
from tests.discovery.fake_apiserver import FakeApiServer, make_pod, vllm_container
from tests.local import until


@dataclass
class Cluster:
    api: FakeApiServer
    engines: SimNode
    token: Path

    @property
    def ports(self) -> list[int]:
        """The simulated vLLM servers' ports: what the pods' ``--port`` say, their IP 127.0.0.1."""
        return [int(url.rsplit(":", 1)[1]) for url in self.engines.replica_urls]

    async def ready_vllm_pod(self, name: str, port: int, **pod) -> str:
        """A vLLM pod scheduled here, started and Ready (as the kubelet reports it); its uid."""
        uid = await self.api.create(make_pod(name, containers=[vllm_container(port)], **pod))
        await self.api.run(uid, "127.0.0.1")
        await self.api.set_ready(uid)
        return uid

    def watching_agent(self, vllm_plugin_dir: str | None = None) -> Config:
        """An agent that follows this cluster's pods (no NVML), quick to scrape and to retry."""
        discovery = KubernetesDiscoveryConfig(
            enabled=True,
            api_url=self.api.url,
            token_file=str(self.token),
            ca_file=None,
            watch_timeout_s=30.0,
            backoff_max_s=0.3,
            vllm_plugin_dir=vllm_plugin_dir,
        )
        return Config(
            listen=HostPort("127.0.0.1", 0),
            node="node-a",
            intervals=IntervalsConfig(engine_s=0.3),
            scrape=ScrapeConfig(timeout_s=1.0, backoff_max_s=0.5),
            nvml=NvmlConfig(enabled=False),
            discovery=DiscoveryConfig(kubernetes=discovery),
        )

    def attributing_agent(self, kubelet_socket: str) -> Config:
        """An agent that follows this cluster's pods and asks the kubelet at ``kubelet_socket`` which
        GPUs each holds; its NVML is the test's (``fake_gpus=0``: the test passes its own)."""
        discovery = DiscoveryConfig(
            kubernetes=KubernetesDiscoveryConfig(
                enabled=True, api_url=self.api.url, token_file=str(self.token), ca_file=None
            ),
            pod_resources=PodResourcesConfig(enabled=True, socket=kubelet_socket, interval_s=0.3),
        )
        return Config(
            listen=HostPort("127.0.0.1", 0),
            node="node-a",
            nvml=NvmlConfig(fake_gpus=0),
            intervals=IntervalsConfig(engine_s=0.3, gpu_s=0.3, process_map_s=0.3),
            scrape=ScrapeConfig(timeout_s=1.0),
            discovery=discovery,
        )


async def scrape_until(
    url: str,
    *present: str,
    absent: tuple[str, ...] = (),
    timeout_s: float = 15.0,
    show: tuple[str, ...] = ("llm/", "discovery", "reload", "gpu_memory_used"),
) -> str:
    """Poll ``url`` until every ``present`` line fragment is there and no ``absent`` one."""
    body = ""

    async def reached() -> str | None:
        nonlocal body
        try:
            body = (await client.get(url, timeout=2)).text
        except httpx.HTTPError:
            body = ""
        shown = body and all(p in body for p in present) and not any(a in body for a in absent)
        return body if shown else None

    async with httpx.AsyncClient() as client:
        try:
            return await until(reached, timeout_s, f"present={present} absent={absent}", interval_s=0.1)
        except AssertionError:
            lines = "\n".join(line for line in body.splitlines() if any(s in line for s in show))
            raise AssertionError(f"not reached: present={present} absent={absent}\n{lines}") from None
