"""A scripted OpenAI-compatible engine (aiohttp) and a kvwatch proxy in front of it (test helpers).

The engine streams chunks shaped like vLLM's (pydantic ``model_dump_json(exclude_unset=True)``:
no spaces, a role chunk with empty content, a finish chunk, a usage-only chunk when
``stream_options.include_usage`` is set, then ``[DONE]``) at scripted times, and records on the
same monotonic clock when it received each request and wrote each chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvwatch.config import HostPort, ProxyConfig, ReplicaConfig
from kvwatch.model import DEFAULT_BANDS, RequestRecord
from kvwatch.requests.accounting import RequestMeter
from kvwatch.requests.proxy import Accounting, ProxyServer, start_proxy
from kvwatch.state import InFlightTracker
from tests.local import serve_app

FIXED_ID = "cmpl-fixed"
CREATED = 1_700_000_000


FINGERPRINT = {"system_fingerprint": "vllm-0.32.0-a34bd6f4"}


def chat_chunk(
    delta: dict | None = None, finish: str | None = None, model: str = "tiny", extra: dict | None = None
) -> bytes:
    choice: dict = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    doc = {
        "id": FIXED_ID,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": model,
        "choices": [choice],
        **(extra or {}),
    }
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def text_chunk(text: str, finish: str | None = None, model: str = "tiny", extra: dict | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    doc = {
        "id": FIXED_ID,
        "object": "text_completion",
        "created": CREATED,
        "model": model,
        "choices": [choice],
        **(extra or {}),
    }
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def usage_chunk(
    prompt: int, completion: int, obj: str = "chat.completion.chunk", extra: dict | None = None
) -> bytes:
    doc = {
        "id": FIXED_ID,
        "object": obj,
        "created": CREATED,
        "model": "tiny",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        },
        **(extra or {}),
    }
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


@dataclass
class Script:
    """What the engine streams: (delay before the event, event) pairs, then the finish event.

    Like vLLM 0.32, ``system_fingerprint`` goes on the finish chunk, or on the usage chunk when
    usage was asked for.
    """

    contents: list[tuple[float, str]] = field(default_factory=lambda: [(0.0, "Hello"), (0.0, " world")])
    first_delay: float = 0.0  # before the role chunk
    finish: str = "stop"
    prompt_tokens: int = 11
    completion_tokens: int | None = None  # usage value; None = number of content events
    send_usage: bool = True  # answer include_usage
    #: vLLM 0.32 --enable-force-include-usage: usage whether asked or not, on the usage chunk and on
    #: every other chunk too (its should_include_usage returns (True, True) when forced)
    force_usage: bool = False
    reasoning: bool = False  # put the text in delta.reasoning instead of delta.content
    status: int = 200
    error_body: bytes = b'{"error":{"message":"bad request","type":"BadRequestError","code":400}}'
    reject_stream_options: bool = False  # a strict engine: 400 when stream_options is present
    usage_delay: float = 0.0  # between the finish chunk and the usage chunk (separate writes)


@dataclass
class Seen:
    """What the engine saw of one request, on time.perf_counter()."""

    path: str
    body: bytes
    headers: dict[str, str]
    received: float
    writes: list[float] = field(default_factory=list)  # when each content event was written
    peer: tuple | None = None  # kvwatch's side of the connection the request came on
    done_at: float | None = None
    disconnected_at: float | None = None


class ScriptedEngine:
    def __init__(self) -> None:
        self.script = Script()
        self.seen: list[Seen] = []
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.models = ["tiny"]
        #: what the next ``/v1/models`` answers instead of the list of ``models`` (then it is cleared)
        self.models_answer: object | None = None
        self.models_asked = 0

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_route("*", "/{tail:.*}", self.other)
        self.runner, port = await serve_app(app, access_log=None)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # -- handlers -----------------------------------------------------------------------------------
    async def list_models(self, request: web.Request) -> web.Response:
        self.models_asked += 1
        if self.models_answer is not None:
            answer, self.models_answer = self.models_answer, None
            return web.json_response(answer)
        models = [{"id": m, "object": "model"} for m in self.models]
        return web.json_response({"object": "list", "data": models})

    async def other(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append(Seen(request.path, body, dict(request.headers), time.perf_counter()))
        return web.Response(
            body=b"engine says: " + request.method.encode() + b" " + request.path_qs.encode(),
            status=218,
            reason="Engine Teapot",
            headers={"X-Engine": "scripted", "Content-Type": "text/plain"},
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        received = time.perf_counter()
        body = await request.read()
        seen = Seen(
            request.path,
            body,
            dict(request.headers),
            received,
            peer=request.transport.get_extra_info("peername") if request.transport else None,
        )
        self.seen.append(seen)
        script = self.script
        try:
            doc = json.loads(body)
        except ValueError:
            return web.Response(status=400, body=script.error_body, content_type="application/json")
        if script.status != 200:
            return web.Response(status=script.status, body=script.error_body, content_type="application/json")
        if script.reject_stream_options and "stream_options" in doc:
            return web.Response(
                status=400,
                body=b'{"error":{"message":"unknown field stream_options"}}',
                content_type="application/json",
            )
        texts = [t for _, t in script.contents]
        completion = script.completion_tokens if script.completion_tokens is not None else len(texts)
        if not doc.get("stream"):
            return self._whole(chat, texts, script, completion)
        options = doc.get("stream_options") or {}
        include_usage = options.get("include_usage") in (True, "true") or script.force_usage
        continuous = script.force_usage or (include_usage and options.get("continuous_usage_stats") is True)
        running = 0

        def on_chunk(event: bytes) -> bytes:
            """Continuous usage stats: the counts so far on a chunk with choices, as vLLM writes them."""
            if not continuous:
                return event
            usage = b',"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}}' % (
                script.prompt_tokens,
                script.prompt_tokens + running,
                running,
            )
            end = event.rindex(b"}")
            return event[:end] + usage + event[end + 1 :]

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        try:
            await asyncio.sleep(script.first_delay)
            if chat:
                await response.write(on_chunk(chat_chunk({"role": "assistant", "content": ""})))
            for delay, text in script.contents:
                await asyncio.sleep(delay)
                running += 1
                if chat:
                    key = "reasoning" if script.reasoning else "content"
                    event = chat_chunk({key: text})
                else:
                    event = text_chunk(text)
                await response.write(on_chunk(event))
                seen.writes.append(time.perf_counter())
            usage = include_usage and script.send_usage
            on_finish = {} if usage else FINGERPRINT
            tail = on_chunk(
                chat_chunk({"content": ""}, script.finish, extra=on_finish)
                if chat
                else text_chunk("", script.finish, extra=on_finish)
            )
            if usage and script.usage_delay:
                await response.write(tail)
                await asyncio.sleep(script.usage_delay)
                tail = b""
            if usage:
                tail += usage_chunk(
                    script.prompt_tokens,
                    completion,
                    "chat.completion.chunk" if chat else "text_completion",
                    FINGERPRINT,
                )
            await response.write(tail + DONE)
            await response.write_eof()
            seen.done_at = time.perf_counter()
        except ConnectionResetError:  # the client (kvwatch) went away: stop generating
            seen.disconnected_at = time.perf_counter()
        except asyncio.CancelledError:
            seen.disconnected_at = time.perf_counter()
            raise
        return response

    @staticmethod
    def _whole(chat: bool, texts: list[str], script: Script, completion: int) -> web.Response:
        text = "".join(texts)
        message = {"role": "assistant", "content": text}
        choice = (
            {"index": 0, "message": message, "finish_reason": script.finish}
            if chat
            else {"index": 0, "text": text, "finish_reason": script.finish}
        )
        doc = {
            "id": FIXED_ID,
            "object": "chat.completion" if chat else "text_completion",
            "created": CREATED,
            "model": "tiny",
            "choices": [choice],
            "usage": {
                "prompt_tokens": script.prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": script.prompt_tokens + completion,
            },
        }
        return web.Response(body=json.dumps(doc).encode(), content_type="application/json")


@dataclass
class ProxyHarness:
    server: ProxyServer
    records: list[RequestRecord]
    counters: Counter
    in_flight: InFlightTracker
    url: str

    def count(self, family: str, *labels: str) -> float:
        return self.counters[(family, *labels)]


async def launch_proxy(
    api_url: str,
    *,
    config: ProxyConfig | None = None,
    model_name: str | None = "tiny",
    known: frozenset[str] = frozenset(),
    learn_models: bool = False,
    meter_factory: Callable[..., RequestMeter] = RequestMeter,
    sink: Callable[[RequestRecord], None] | None = None,
) -> ProxyHarness:
    records: list[RequestRecord] = []
    counters: Counter = Counter()

    def count(family: str, *labels: str, amount: float = 1) -> None:
        counters[(family, *labels)] += amount

    in_flight = InFlightTracker()
    replica = ReplicaConfig(
        name="r0",
        metrics_url=f"{api_url}/metrics",
        api_url=api_url,
        proxy_listen=HostPort("127.0.0.1", 0),
        model_name=model_name,
    )
    server = await start_proxy(
        replica,
        config or ProxyConfig(),
        known,
        Accounting(DEFAULT_BANDS, in_flight, sink or records.append, count, meter_factory),
        learn_models=learn_models,
    )
    return ProxyHarness(server, records, counters, in_flight, f"http://127.0.0.1:{server.port}")


@contextlib.asynccontextmanager
async def proxied(api_url: str, **options: Any) -> AsyncIterator[ProxyHarness]:
    """``launch_proxy(api_url, **options)`` for the block, stopped when it ends however it ends."""
    harness = await launch_proxy(api_url, **options)
    try:
        yield harness
    finally:
        await harness.server.stop()
