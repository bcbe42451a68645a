"""The load generator: sends a workload over HTTP as OpenAI clients do, impatient clients included.

Arrivals are simulated seconds; at ``speed`` X the generator sends request ``r`` at wall time
``start + r.arrival / X`` and a client's patience is ``patience / X`` wall seconds, so it matches a
``SimNode`` running at the same speed. Requests are OpenAI-shaped (``/v1/chat/completions`` or
``/v1/completions``, ``stream: true``, ``max_tokens``, ``stream_options.include_usage`` on a share of
them) plus the simulator's ``kvwatch_sim`` hints (output length, exact prompt tokens, shared prefix),
which a real engine ignores. The prompt is filler text of about the right size (4 characters per
token), so a proxy in the path carries realistic bytes.

Routing: one base URL per replica (point them at kvwatch's proxy listeners for the demo) and a
``RouterSpec``; loads are this generator's own in-flight requests per replica. The ``skewed`` policy
is the documented knob for stranded capacity (see ``routing.py``).

The hot path stays lean: a streamed response is read as raw bytes (no JSON per chunk); only the
final usage chunk is parsed.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp

from kvwatch.jsonsafe import loads
from kvwatch.model import DEFAULT_BANDS, LengthBands
from kvwatch.sim.routing import Router, RouterSpec
from kvwatch.sim.workload import WorkloadRequest

_PROMPT_WORD = "tok "  # 4 characters per token


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one client saw. Times are wall seconds (multiply by speed for simulated seconds)."""

    request_id: str
    replica: int
    klass: str
    outcome: str  # completed | truncated | aborted | error | rejected
    status: int | None
    finish_reason: str | None
    completion_tokens: int | None
    target_tokens: int
    ttft_s: float | None
    e2e_s: float


@dataclass(slots=True)
class LoadReport:
    """Running totals plus the most recent results (bounded)."""

    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)
    recent: deque = field(default_factory=lambda: deque(maxlen=20_000))

    def by_band(self, speed: float, bands: LengthBands = DEFAULT_BANDS) -> dict[str, dict[str, float]]:
        """Per output-length band (target length): count and p50/p99 of TTFT and e2e, in simulated
        seconds, over the recent completed/truncated requests."""
        groups: dict[str, list[RequestResult]] = {}
        for r in self.recent:
            if r.outcome in ("completed", "truncated"):
                groups.setdefault(bands.band_for(r.completion_tokens), []).append(r)
        out = {}
        for band in bands.names:
            rs = groups.get(band, [])
            if not rs:
                continue
            e2e = sorted(r.e2e_s * speed for r in rs)
            ttft = sorted(r.ttft_s * speed for r in rs if r.ttft_s is not None)
            out[band] = {
                "count": len(rs),
                "e2e_p50": _quantile(e2e, 0.5),
                "e2e_p99": _quantile(e2e, 0.99),
                "ttft_p50": _quantile(ttft, 0.5),
                "ttft_p99": _quantile(ttft, 0.99),
            }
        return out


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


@dataclass(frozen=True, slots=True)
class LoadGenConfig:
    speed: float = 1.0  # simulated seconds per wall second (match the node)
    chat_share: float = 0.8  # the rest use /v1/completions
    include_usage_share: float = 0.5  # streamed requests that ask for the usage chunk
    send_hints: bool = True  # kvwatch_sim hints (exact lengths); off for a real engine
    seed: int = 0


class LoadGenerator:
    """Sends ``WorkloadRequest`` streams to ``base_urls`` (one per replica)."""

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        model: str,
        router: RouterSpec | Router | None = None,
        config: LoadGenConfig | None = None,
        session: aiohttp.ClientSession | None = None,
        on_result: Callable[[RequestResult], None] | None = None,
    ) -> None:
        if not base_urls:
            raise ValueError("the load generator needs at least one base URL")
        self.base_urls = [u.rstrip("/") for u in base_urls]
        self.model = model
        self.config = config or LoadGenConfig()
        self.router = router if isinstance(router, Router) else Router(router or RouterSpec(), len(base_urls))
        self.report = LoadReport()
        self.in_flight = [0] * len(base_urls)
        self.on_result = on_result
        self._session = session
        self._own_session = session is None
        self._rng = random.Random(self.config.seed)
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> LoadGenerator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=None)
            )
        return self._session

    async def run(
        self, requests: Iterable[WorkloadRequest], *, duration: float | None = None, drain: bool = True
    ) -> LoadReport:
        """Send every request at its arrival time (stop scheduling after ``duration`` simulated
        seconds); with ``drain`` wait for the ones in flight, else cancel them (clients leave)."""
        await self.schedule(requests, duration=duration)
        if drain:
            while self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
        else:
            await self.close()
        return self.report

    async def schedule(self, requests: Iterable[WorkloadRequest], *, duration: float | None = None) -> None:
        """Send every request at its arrival time, then wait out ``duration`` simulated seconds; the
        requests still in flight are left as they are (``open_requests``), for the caller to wait
        for or cancel (``close``)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        speed = self.config.speed
        for wr in requests:
            if duration is not None and wr.arrival >= duration:
                break
            delay = start + wr.arrival / speed - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            replica = self.router.route(wr, self.in_flight)
            task = asyncio.create_task(self.send(wr, replica))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if duration is not None:
            rest = start + duration / speed - loop.time()
            if rest > 0:
                await asyncio.sleep(rest)

    @property
    def open_requests(self) -> int:
        """Requests sent whose client has not finished with them yet."""
        return sum(self.in_flight)

    def _body(self, wr: WorkloadRequest, chat: bool, include_usage: bool) -> dict:
        text = _PROMPT_WORD * wr.prompt_tokens
        body: dict = {"model": self.model, "stream": wr.stream}
        if wr.max_tokens is not None:
            body["max_tokens"] = wr.max_tokens
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if wr.stream and include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.config.send_hints:
            hint: dict[str, int | str] = {
                "output_tokens": wr.output_tokens,
                "prompt_tokens": wr.prompt_tokens,
            }
            if wr.prefix_id is not None:
                hint["prefix_id"] = wr.prefix_id
                hint["prefix_tokens"] = wr.prefix_tokens
            body["kvwatch_sim"] = hint
        return body

    async def send(self, wr: WorkloadRequest, replica: int) -> RequestResult:
        """One client: send, read to the end or give up when patience runs out."""
        cfg = self.config
        chat = self._rng.random() < cfg.chat_share
        include_usage = self._rng.random() < cfg.include_usage_share
        url = self.base_urls[replica] + ("/v1/chat/completions" if chat else "/v1/completions")
        body = self._body(wr, chat, include_usage)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first_deadline = _deadline(t0, wr.first_token_patience, cfg.speed)
        total_deadline = _deadline(t0, wr.total_patience, cfg.speed)
        status = finish = tokens = ttft = None
        outcome = "error"
        self.in_flight[replica] += 1
        self.report.sent += 1
        try:
            async with asyncio.timeout_at(_earliest(first_deadline, total_deadline)) as limit:
                async with self._client().post(url, json=body) as resp:
                    status = resp.status
                    if status >= 400:
                        await resp.read()
                        outcome = "rejected" if status < 500 else "error"
                    elif wr.stream:
                        finish, tokens, ttft = await self._read_stream(resp, limit, t0, total_deadline)
                    else:
                        data = loads(await resp.read())
                        ttft = loop.time() - t0
                        finish = data["choices"][0]["finish_reason"]
                        tokens = data["usage"]["completion_tokens"]
            if finish is not None:
                outcome = "completed" if finish == "stop" else "truncated"
        except TimeoutError:
            outcome = "aborted"  # patience ran out: leaving closes the connection, the engine aborts
        except (aiohttp.ClientError, ConnectionError, ValueError, KeyError):
            outcome = "error"
        except asyncio.CancelledError:
            outcome = "aborted"  # the generator is closing: its clients leave
            raise
        finally:
            self.in_flight[replica] -= 1
            result = RequestResult(
                wr.request_id,
                replica,
                wr.klass,
                outcome,
                status,
                finish,
                tokens,
                wr.output_tokens,
                ttft,
                loop.time() - t0,
            )
            self.report.outcomes[outcome] += 1
            self.report.recent.append(result)
            if self.on_result is not None:
                self.on_result(result)
        return result

    @staticmethod
    async def _read_stream(
        resp: aiohttp.ClientResponse, limit: asyncio.Timeout, t0: float, total_deadline: float | None
    ) -> tuple[str | None, int, float | None]:
        """Scan SSE bytes as they come (no JSON per chunk): the first content, the finish reason and
        the usage count. A marker may straddle two reads, so each scan includes the previous tail."""
        loop = asyncio.get_running_loop()
        ttft = None
        finish = usage = None
        counted = 0  # filler tokens seen, for streams without a usage chunk
        carry = b""
        async for data in resp.content.iter_any():
            buf = carry + data
            if ttft is None and (b'"content":" ' in buf or b'"text":" ' in buf):
                ttft = loop.time() - t0
                limit.reschedule(total_deadline)  # first token seen: only the total limit is left
            counted += (carry[-3:] + data).count(b" tok")
            found = _FINISH.findall(buf)
            if found:
                finish = found[-1].decode()
            found = _USAGE.findall(buf)
            if found:
                usage = int(found[-1])
            carry = buf[-64:]
        return finish, counted if usage is None else usage, ttft


_FINISH = re.compile(rb'"finish_reason":"(\w+)"')
_USAGE = re.compile(rb'"completion_tokens":(\d+)')


def _deadline(t0: float, patience: float | None, speed: float) -> float | None:
    return None if patience is None else t0 + patience / speed


def _earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)
