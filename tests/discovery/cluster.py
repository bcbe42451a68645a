"""A small cluster for discovery tests: simulated vLLM servers, a fake API server, a service account
token file (the ``cluster`` fixture of conftest.py builds one); and a /metrics poller."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

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
