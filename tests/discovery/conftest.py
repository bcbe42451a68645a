"""The ``cluster`` fixture for discovery tests (``cluster.py`` holds what it builds)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvwatch.sim.node import SimNode, h200_node
from tests.discovery.cluster import Cluster
from tests.discovery.fake_apiserver import FakeApiServer


@pytest.fixture
async def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    marker = request.node.get_closest_marker("engines")
    engines = SimNode(h200_node("llama-3.1-8b", gpus=marker.args[0] if marker else 1, speed=20))
    await engines.start()
    api = FakeApiServer()
    await api.start()
    token = tmp_path / "token"
    token.write_text("test-token\n")
    try:
        yield Cluster(api, engines, token)
    finally:
        await api.stop()
        await engines.stop()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "engines(n): simulated vLLM servers in the discovery cluster")
