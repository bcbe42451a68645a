"""Fixtures: a scripted engine, a proxy in front of it, an HTTP client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import uvloop
from aiohttp import ClientSession

from .scripted import ProxyHarness, ScriptedEngine, launch_proxy

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


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


#: tests of what listens on the agent's loop for outsiders: the proxy, the OTLP receiver
BOTH_LOOPS = ("test_proxy_", "test_otlp")


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, LoopFactory]:
    """These run on both loops the agent runs on: asyncio's own and uvloop (the ``fast`` extra).
    They differ in what runs first after a transport is made, which a test on one loop alone
    cannot see."""
    if item.path.name.startswith(BOTH_LOOPS):
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}
