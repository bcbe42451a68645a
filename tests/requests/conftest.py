"""Fixtures: a scripted engine, a proxy in front of it, an HTTP client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession

from .scripted import ProxyHarness, ScriptedEngine, launch_proxy


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedEngine]:
    e = ScriptedEngine()
    await e.start()
    yield e
    await e.stop()


@pytest.fixture
async def proxy(engine: ScriptedEngine) -> AsyncIterator[ProxyHarness]:
    harness = await launch_proxy(engine.url)
    yield harness
    await harness.server.stop()


@pytest.fixture
async def http() -> AsyncIterator[ClientSession]:
    async with ClientSession(auto_decompress=False) as session:
        yield session
