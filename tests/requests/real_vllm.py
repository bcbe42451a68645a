"""The real CPU vLLM's own counters, and the client-disconnect attempts the real-engine tests make.

What a disconnect test can see, learned from a CI failure. The proxy closes its engine connection
within a millisecond of the client's FIN (tcpdump). How soon vLLM then stops depends on what reaches
its frontend (one event loop: it renders /metrics, and notices a gone client when it next writes to
it) at that moment. On the 2-core machine, after the client left, vLLM generated 106, 939 and all
1900 tokens more while the test polled /metrics every 50 ms from that instant; 186, 1517 and 1567
with a poll every 0.25 s from that instant; one token, in each run, with no poll for QUIET_S first.
Why a poll at that instant holds the frontend back for seconds is vLLM's and not established here.
So the attempt leaves vLLM alone for QUIET_S and reads kvwatch's part off the wire.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from aiohttp import ClientSession

from kvwatch.model import Outcome
from tests.local import RealEngine, until

from .scripted import launch_proxy
from .wire import tcpdump

CHAT = [{"role": "user", "content": "Say something long."}]
LONG = 1900  # tokens the client asks for and leaves early from
ATTEMPTS = 5
QUIET_S = 0.3  # no poll of vLLM's /metrics this soon after the client left: its FIN would be first
# the proxy's FIN or RST must reach vLLM this soon after the client's FIN: 0.1 ms when the proxy's
# loop runs at once, 110 ms in a clean-clone run where the first chunk had taken 8.8-9.3 s (this VM
# stalls every process under vLLM's load for seconds); under QUIET_S, so no FIN of the test's own
# polls can pass for the proxy's, and a proxy that keeps the connection still fails
CLOSED_WITHIN_S = 0.25
assert CLOSED_WITHIN_S < QUIET_S
_CLOSE = re.compile(r"^(\d+\.\d+) IP 127\.0\.0\.1\.(\d+) > 127\.0\.0\.1\.(\d+): Flags ")


@dataclass(frozen=True)
class Engine:
    metrics_url: str


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def vllm_metrics(engine: Engine | RealEngine) -> str:
    """Async: the proxy under test runs on this loop, so nothing here may block it."""
    async with httpx.AsyncClient() as client:
        return (await client.get(engine.metrics_url, timeout=10)).text


async def until_idle(engine: Engine, timeout_s: float = 120) -> None:
    """Until no request runs or waits in the shared vLLM: another test's tokens would count as ours."""

    async def idle() -> bool:
        text = await vllm_metrics(engine)
        return metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting") == 0

    await until(idle, timeout_s, "the shared vLLM to finish an earlier test's requests", interval_s=0.2)


async def leave_at_first_chunk(url: str, http: ClientSession) -> float:
    """Stream LONG tokens and leave at the first content chunk; returns when the client left."""
    body = {"model": "tiny", "messages": CHAT, "max_tokens": LONG, "stream": True, "ignore_eos": True}
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        async for line in response.content:
            if b'"content":"' in line and b'"content":""' not in line:
                break
        response.close()
        return time.monotonic()


async def generation_stops(engine: Engine, left: float) -> tuple[float, float]:
    """Poll ``vllm:generation_tokens_total`` until it stops moving: (last value, when it last rose).
    Gently: vLLM's frontend renders /metrics on the loop that also notices the disconnect, and
    polling every 50 ms held that loop up to 10 s behind its engine on CI's two cores."""
    value = metric(await vllm_metrics(engine), "vllm:generation_tokens_total")
    rose = left
    while time.monotonic() - rose < 1.0:  # a second without a new token: stopped
        assert time.monotonic() - left < 30, "vLLM kept generating for a client that left"
        await asyncio.sleep(0.25)
        now = metric(await vllm_metrics(engine), "vllm:generation_tokens_total")
        if now != value:
            value, rose = now, time.monotonic()
    return value, rose


def closes(lines: bytes) -> list[tuple[float, int, int]]:
    """The FINs and RSTs a text capture (``tcpdump -nn -tt``) saw: (epoch time, from port, to port)."""
    return [(float(m[1]), int(m[2]), int(m[3])) for m in map(_CLOSE.match, lines.decode().splitlines()) if m]


def upstream_closed_after(seen: list[tuple[float, int, int]], since: float, proxy: int, engine: int) -> float:
    """Seconds from the client's first FIN to the proxy after ``since`` to the next FIN or RST the
    engine got (the proxy's, as nothing else closes a connection to the engine that soon)."""
    client_left = min(t for t, _, to in seen if to == proxy and t >= since)
    return min(t for t, _, to in seen if to == engine and t >= client_left) - client_left


async def disconnect_attempts(base_url: str) -> dict[str, object]:
    """Leave at the first content chunk until vLLM had not finished by then (at most ATTEMPTS times,
    each on an idle engine so that only this request's tokens count); what was seen, for the test."""
    engine = Engine(f"{base_url}/metrics")
    engine_port = urlsplit(base_url).port
    assert engine_port is not None, base_url
    harness = await launch_proxy(base_url, model_name=None, learn_models=True)
    proxy_port = harness.server.port
    attempts: list[dict[str, float]] = []
    try:
        await until(lambda: "tiny" in harness.server.metering.labels.known, timeout_s=30)
        fins = f"tcp[tcpflags] & (tcp-fin|tcp-rst) != 0 and (dst port {proxy_port} or dst port {engine_port})"
        async with ClientSession(auto_decompress=False) as http, tcpdump("-nn", "-tt", "-l", fins) as output:
            for _ in range(ATTEMPTS):
                await until_idle(engine)
                before = metric(await vllm_metrics(engine), "vllm:generation_tokens_total")
                sent, sent_at = time.monotonic(), time.time()
                left = await leave_at_first_chunk(harness.url, http)
                await asyncio.sleep(QUIET_S)
                after, rose = await generation_stops(engine, left)
                seen_by = {"sent_at": sent_at, "waited_s": left - sent, "rose_s": rose - left}
                attempts.append({**seen_by, "generated": after - before})
                if after - before < LONG:
                    break
        seen = closes(output[0])
        for attempt in attempts:
            attempt["upstream_closed_s"] = upstream_closed_after(
                seen, attempt["sent_at"], proxy_port, engine_port
            )
        await until(lambda: any(r.outcome is Outcome.ABORTED for r in harness.records), 10, "the record")
        running = metric(await vllm_metrics(engine), "vllm:num_requests_running")
        last = harness.records[-1]
    finally:
        await harness.server.stop()
    return {
        "attempts": attempts,
        "running_after": running,
        "outcome": last.outcome.value,
        "output_tokens": last.output_tokens,
    }
