"""Config pieces the tests share."""

from __future__ import annotations

from typing import Any

from kvwatch.config import HostPort, ReplicaConfig


def proxied_replica(name: str, port: int, **fields: Any) -> ReplicaConfig:
    """A replica kvwatch proxies, its engine on ``127.0.0.1:port`` (nothing needs to listen there)."""
    url = f"http://127.0.0.1:{port}"
    return ReplicaConfig(name, f"{url}/metrics", api_url=url, proxy_listen=HostPort("127.0.0.1", 0), **fields)
