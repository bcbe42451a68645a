"""The proxy dates a request and its longest inter-chunk gap on the wall clock it is given.

The agent passes its own clock (``kvwatch demo``: start time + simulated seconds), so a request's
longest gap and the engine's preemption windows (scrape times) compare. Here the wall clock is
``perf_counter`` shifted by a fixed offset: the scripted engine and the client note times on
``perf_counter`` too, so the proxy's dates are checked with exact inequalities (the proxy relayed
each chunk after the engine wrote it and before the client read it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession

from kvwatch.config import HostPort, ProxyConfig, ReplicaConfig
from kvwatch.model import DEFAULT_BANDS, RequestRecord
from kvwatch.requests.proxy import Accounting, ProxyServer, start_proxy
from kvwatch.state import InFlightTracker
from tests.local import until

from .bodies import CHAT_MAX_64_TOKENS
from .scripted import Script, ScriptedEngine
from .timed_stream import stream

OFFSET = 1_800_000_000.0


@pytest.fixture
async def dated() -> AsyncIterator[tuple[ProxyServer, list[RequestRecord], ScriptedEngine]]:
    engine = ScriptedEngine()
    await engine.start()
    records: list[RequestRecord] = []
    replica = ReplicaConfig(
        name="r0",
        metrics_url=f"{engine.url}/metrics",
        api_url=engine.url,
        proxy_listen=HostPort("127.0.0.1", 0),
        model_name="tiny",
    )
    accounting = Accounting(
        DEFAULT_BANDS,
        InFlightTracker(),
        records.append,
        lambda *a, **k: None,
        clock=time.perf_counter,
        wall_clock=lambda: OFFSET + time.perf_counter(),
    )
    server = await start_proxy(replica, ProxyConfig(), frozenset(), accounting, learn_models=False)
    yield server, records, engine
    await server.stop()
    await engine.stop()


async def test_longest_gap_and_start_are_dated_on_the_given_wall_clock(dated, http: ClientSession) -> None:
    server, records, engine = dated
    engine.script = Script(contents=[(0.05, "a"), (0.1, "b"), (1.2, "c"), (0.1, "d")])
    seen_by_client = await stream(
        http, f"http://127.0.0.1:{server.port}/v1/chat/completions", {**CHAT_MAX_64_TOKENS, "stream": True}
    )
    await until(lambda: len(records) == 1)
    [record] = records
    [seen] = engine.seen

    assert seen_by_client["sent"] + OFFSET <= record.started_at <= seen.received + OFFSET
    gap_start = seen.writes[1], seen_by_client["arrivals"][1]  # when "b" was written / read
    gap_end = seen.writes[2], seen_by_client["arrivals"][2]  # when "c" was written / read
    assert gap_end[0] + OFFSET <= record.max_gap_ended_at <= gap_end[1] + OFFSET
    assert gap_end[0] - gap_start[1] <= record.max_gap_seconds <= gap_end[1] - gap_start[0]
