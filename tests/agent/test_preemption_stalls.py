"""Per-band preemption exposure: the agent's sink judges each proxied request's longest gap against
its replica's preemption windows and counts ``kvwatch_request_preemption_stalls_total``.

One test drives ``Agent.record`` over a derived view built by the real ``update_derived``; the other
runs the whole agent (scheduler, scraper, proxy, ``/metrics``) against a small fake vLLM whose
preemption counter rises while a stream it serves is paused, which also checks that the proxy dates
requests on the agent's clock (the windows are scrape times).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession, web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.agent import Agent
from kvwatch.agent.derived import update_derived
from kvwatch.config import Config, HostPort, IntervalsConfig, NvmlConfig, ReplicaConfig
from kvwatch.export.requests import RequestCollector
from kvwatch.model import Outcome, ReplicaSample, RequestRecord
from tests.local import serve_app, until

STALLS = "kvwatch_request_preemption_stalls"
T0 = 1_750_000_000.0


def proxied(
    api_url: str = "http://127.0.0.1:1", metrics_url: str = "http://127.0.0.1:1/metrics", **config
) -> Config:
    replica = ReplicaConfig(
        "r0",
        metrics_url,
        backend="vllm",
        api_url=api_url,
        proxy_listen=HostPort("127.0.0.1", 0),
        model_name="tiny",
    )
    return Config(
        replicas=(replica,), listen=HostPort("127.0.0.1", 0), nvml=NvmlConfig(enabled=False), **config
    )


def scrape(at: float, preemptions: float) -> ReplicaSample:
    return ReplicaSample(
        replica="r0",
        backend="vllm",
        scraped_at=at,
        model_name="tiny",
        dp_rank="0",
        requests_running=2.0,
        preemptions_total=preemptions,
    )


def finished(
    gap: float | None, gap_ended_at: float | None, output: int = 12_000, source: str = "proxy"
) -> RequestRecord:
    return RequestRecord(
        "r0",
        "tiny",
        source,
        Outcome.COMPLETED,
        started_at=T0,
        output_tokens=output,
        max_gap_seconds=gap,
        max_gap_ended_at=gap_ended_at,
    )


def stall_series(text: str) -> dict[tuple[str, str], float]:
    """(length_band, source) -> value of the stall counter."""
    return {
        (s.labels["length_band"], s.labels["source"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == STALLS
        for s in family.samples
    }


def test_the_sink_counts_a_long_gap_that_overlapped_a_preemption_window() -> None:
    agent = Agent(proxied())
    for at, preemptions in ((T0 + 100, 3.0), (T0 + 105, 5.0), (T0 + 110, 5.0)):
        agent.state.target("r0").up = True
        agent.state.target("r0").samples = (scrape(at, preemptions),)
        update_derived(agent.state, agent.config, at)

    agent.record(finished(4.0, T0 + 106))  # gap 102..106 overlaps the window 100..105
    agent.record(finished(4.0, T0 + 99))  # gap 95..99: before the preemption
    agent.record(finished(0.8, T0 + 104))  # during it, but not longer than 1 s
    agent.record(finished(6.0, T0 + 108, output=300))  # another band, stalled
    agent.record(finished(None, None, source="otlp"))  # a source that does not measure gaps

    assert agent.state.requests.stall_counts() == {
        ("r0", "tiny", "10k-20k", "proxy"): 1,
        ("r0", "tiny", "0-1k", "proxy"): 1,
    }
    registry = CollectorRegistry()
    registry.register(RequestCollector(agent.state, agent.config))
    series = stall_series(generate_latest(registry).decode())
    assert series[("10k-20k", "proxy")] == 1.0 and series[("0-1k", "proxy")] == 1.0
    assert series[("20k+", "proxy")] == 0.0  # every band of a proxied replica starts at zero
    assert not any(source == "otlp" for _, source in series)


def test_without_a_derived_view_nothing_is_a_stall() -> None:
    agent = Agent(proxied())
    agent.record(finished(30.0, T0 + 100))
    assert agent.state.requests.stall_counts() == {("r0", "tiny", "10k-20k", "proxy"): 0}


# -- the whole agent against a fake vLLM --------------------------------------------------------------


class FakeVllm:
    """``/metrics`` with a preemption counter, and a chat stream that pauses ``pause_s`` after its
    second chunk; ``preempt_during_pause`` bumps the counter half a second into the pause."""

    def __init__(self) -> None:
        self.preemptions = 0
        self.pause_s = 3.0
        self.preempt_during_pause = True
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner, port = await serve_app(app, access_log=None)
        self.url = f"http://127.0.0.1:{port}"

    async def metrics(self, request: web.Request) -> web.Response:
        labels = 'engine="0",model_name="tiny"'
        text = (
            f"vllm:num_requests_running{{{labels}}} 1.0\n"
            f"vllm:num_preemptions_total{{{labels}}} {float(self.preemptions)}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        def chunk(doc: dict) -> bytes:
            return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

        def content(text: str) -> bytes:
            return chunk({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})

        for text in ("a", "b"):
            await response.write(content(text))
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        if self.preempt_during_pause:
            self.preemptions += 1
        await asyncio.sleep(self.pause_s - 0.5)
        await response.write(content("c"))
        await response.write(chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
        await response.write(
            chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
        )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def running() -> AsyncIterator[tuple[FakeVllm, Agent]]:
    engine = FakeVllm()
    await engine.start()
    # the agent's clock runs ahead of time.time() (as in `kvwatch demo`): a proxy dating requests on
    # time.time() would never overlap a scrape window
    offset = 3600.0
    agent = Agent(
        proxied(engine.url, f"{engine.url}/metrics", intervals=IntervalsConfig(engine_s=0.25)),
        clock=lambda: time.time() + offset,
    )
    await agent.start()
    yield engine, agent
    await agent.stop()
    await engine.stop()


async def _chat(session: ClientSession, agent: Agent) -> None:
    url = f"http://127.0.0.1:{agent.proxy_ports['r0']}/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with session.post(url, json=body) as response:
        assert response.status == 200
        await response.read()


async def _metrics(session: ClientSession, agent: Agent) -> dict[tuple[str, str], float]:
    async with session.get(f"http://127.0.0.1:{agent.port}/metrics") as response:
        return stall_series(await response.text())


async def _settle(agent: Agent, requests: int) -> None:
    await until(lambda: agent.state.requests.observed >= requests, 20, "the proxy to record the request")


async def test_agent_counts_a_stream_paused_by_a_preemption(running) -> None:
    engine, agent = running
    async with ClientSession() as session:
        await _chat(session, agent)
        await _settle(agent, 1)
        assert (await _metrics(session, agent))[("0-1k", "proxy")] == 1.0
        assert engine.preemptions == 1

        engine.preempt_during_pause = False  # the same pause without a preemption: not a stall
        await _chat(session, agent)
        await _settle(agent, 2)
        assert (await _metrics(session, agent))[("0-1k", "proxy")] == 1.0
