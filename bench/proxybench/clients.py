"""The client side (runs in the orchestrator process; its CPU is not measured): streams, arrivals,
bursts and keep-alive clients, and the CPU of the processes measured."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from proxybench.common import CLK_TCK

_STAMP = re.compile(rb'"content":"(\d+)"')
_RECEIVED = re.compile(rb'"id":"chatcmpl-(\d+)"')


class _Client(asyncio.Protocol):
    def __init__(self, request: bytes, sent_ns: int, done: asyncio.Future, sample: _Stream) -> None:
        self.request = request
        self.sent_ns = sent_ns
        self.done = done
        self.sample = sample
        self.tail = b""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter_ns()
        data = self.tail + data
        cut = data.rfind(b"\n\n")
        self.tail = data[cut + 2 :] if cut >= 0 else data
        stamps = _STAMP.findall(data[: cut + 2]) if cut >= 0 else []
        if self.sample.upstream_received_ns is None and (m := _RECEIVED.search(data)):
            self.sample.upstream_received_ns = int(m.group(1))
        if stamps and self.sample.ttft_ns is None:
            self.sample.ttft_ns = now - self.sent_ns
            if self.sample.upstream_received_ns is not None:  # minus the upstream's own TTFT
                self.sample.ttft_ns -= int(stamps[0]) - self.sample.upstream_received_ns
        for s in stamps:
            self.sample.latencies_ns.append(now - int(s))
        self.sample.chunks += len(stamps)

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(None)


@dataclass
class _Stream:
    ttft_ns: int | None = None  # client TTFT minus the upstream's own (request in -> first chunk out)
    sent_ns: int = 0  # when the client wrote the request (keep-alive clients)
    upstream_received_ns: int | None = None
    chunks: int = 0
    latencies_ns: list[int] = field(default_factory=list)


REQUEST_BODY = (
    b'{"model":"bench","messages":[{"role":"user","content":"benchmark prompt"}],'
    b'"stream":true,"max_tokens":256}'
)


def chat_request(port: int, path: str = "/v1/chat/completions", close: bool = True) -> bytes:
    """The bench's streaming chat request, head and body (``connection: close`` unless kept alive)."""
    return (
        b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%s\r\n%s"
        % (path.encode(), port, len(REQUEST_BODY), b"connection: close\r\n" if close else b"", REQUEST_BODY)
    )


async def one_stream(port: int) -> _Stream:
    loop = asyncio.get_running_loop()
    request = chat_request(port)
    done = loop.create_future()
    sample = _Stream()
    sent = time.perf_counter_ns()
    transport, _ = await loop.create_connection(
        lambda: _Client(request, sent, done, sample), "127.0.0.1", port
    )
    try:
        await asyncio.wait_for(done, 120)
    finally:
        transport.close()
    return sample


def _cpu_seconds(pids: Sequence[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK


def _children(pid: int) -> list[int]:
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out += [int(p) for p in task.read_text().split()]
    return out


async def steady(port: int, streams: int, seconds: float) -> tuple[list[int], list[int], int]:
    """Keep ``streams`` in flight; requests after the first wave arrive one by one."""
    arrivals: list[int] = []
    latencies: list[int] = []
    chunks = 0
    deadline = time.monotonic() + seconds

    async def lane(first: bool) -> None:
        nonlocal chunks
        while time.monotonic() < deadline:
            s = await one_stream(port)
            if not first and s.ttft_ns is not None:
                arrivals.append(s.ttft_ns)
            first = False
            latencies.extend(s.latencies_ns)
            chunks += s.chunks

    lanes = []
    for _ in range(streams):  # stagger the first wave over one stream's lifetime
        lanes.append(asyncio.create_task(lane(True)))
        await asyncio.sleep(2.0 / streams)
    await asyncio.gather(*lanes)
    return arrivals, latencies, chunks


async def burst(port: int, streams: int, rounds: int) -> list[int]:
    ttfts: list[int] = []
    for _ in range(rounds):
        samples = await asyncio.gather(*(one_stream(port) for _ in range(streams)))
        ttfts += [s.ttft_ns for s in samples if s.ttft_ns is not None]
    return ttfts


class _KeepAliveClient(asyncio.Protocol):
    """One connection, one request at a time: the next is sent once the previous response is complete
    (its last-chunk marker read), as aiohttp, httpx and the ``openai`` SDK do; with ``pace`` (low,
    high seconds), not before a time drawn from it has passed since the previous one was sent."""

    def __init__(
        self, request: bytes, count: int, done: asyncio.Future, pace: tuple[float, float] | None = None
    ) -> None:
        self.request = request
        self.left = count
        self.done = done
        self.pace = pace
        self.samples: list[_Stream] = []
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.sent_ns = 0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        self._send()

    def _send(self) -> None:
        self.left -= 1
        self.sent_ns = time.perf_counter_ns()
        self.samples.append(_Stream(sent_ns=self.sent_ns))
        self.transport.write(self.request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter_ns()
        sample = self.samples[-1]
        self.buf += data
        if sample.upstream_received_ns is None and (m := _RECEIVED.search(self.buf)):
            sample.upstream_received_ns = int(m.group(1))
        if (
            sample.ttft_ns is None
            and sample.upstream_received_ns is not None
            and (stamp := _STAMP.search(self.buf))
        ):
            sample.ttft_ns = now - self.sent_ns - (int(stamp.group(1)) - sample.upstream_received_ns)
        if self.buf.endswith(b"\r\n0\r\n\r\n"):  # the response is complete
            self.buf = b""
            if self.left and self.pace:
                due_ns = self.sent_ns + int(random.uniform(*self.pace) * 1e9)
                asyncio.get_running_loop().call_later(max(0.0, (due_ns - now) / 1e9), self._send)
            elif self.left:
                self._send()
            elif not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_exception(RuntimeError(f"connection lost: {exc}"))


async def reused_connections(
    port: int, clients: int, requests: int, pace: tuple[float, float] | None = None
) -> list[_Stream]:
    """Every request after each client's first (those go on a reused connection), with its TTFT."""
    loop = asyncio.get_running_loop()
    request = chat_request(port, close=False)

    async def one_client() -> list[_Stream]:
        done = loop.create_future()
        transport, protocol = await loop.create_connection(
            lambda: _KeepAliveClient(request, requests, done, pace), "127.0.0.1", port
        )
        try:
            await asyncio.wait_for(done, 120 + requests * (pace[1] if pace else 0))
        finally:
            transport.close()
        return protocol.samples

    lanes = []
    for _ in range(clients):
        lanes.append(asyncio.create_task(one_client()))
        await asyncio.sleep(0.05)
    samples = await asyncio.gather(*lanes)
    return [s for lane in samples for s in lane[1:] if s.ttft_ns is not None]


def crowded_share(sent_ns: list[int], within_ns: int) -> float:
    """The share of requests sent within ``within_ns`` of another one: how bunched the arrivals are.

    Clients that send their next request as soon as a stream ends stay in step when every stream is
    as long as the others; through a proxy that ends streams at ``[DONE]`` they then arrive together,
    while direct clients are spread by the engine's random tails. Same arrivals, same comparison."""
    times = sorted(sent_ns)
    near = 0
    for i, t in enumerate(times):
        before = t - times[i - 1] if i else within_ns
        after = times[i + 1] - t if i + 1 < len(times) else within_ns
        near += min(before, after) < within_ns
    return near / len(times) if times else 0.0
