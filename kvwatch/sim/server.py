"""A vLLM-compatible HTTP server in front of simulated engines (aiohttp).

Speaks what kvwatch meets in front of a real vLLM: ``/metrics`` (vLLM 0.33 names, see
``exposition.py``), ``/health``, ``/version``, ``/v1/models``, and ``/v1/chat/completions`` and
``/v1/completions``, streaming (SSE, OpenAI chunk shapes, ``stream_options.include_usage``) or not.

What the simulation needs from a request, beyond the OpenAI fields:

* prompt tokens: ``kvwatch_sim.prompt_tokens`` if given, else estimated from the prompt text
  (``chars_per_token`` characters per token, 3 more per chat message);
* output length: ``kvwatch_sim.output_tokens`` (where the "model" emits EOS) if given, else drawn
  from the output profile; ``max_tokens`` / ``max_completion_tokens`` cut it (finish_reason
  ``length``), ``ignore_eos`` generates up to the budget;
* shared prompt prefix (prefix caching): ``kvwatch_sim.prefix_id`` and ``kvwatch_sim.prefix_tokens``.

Generated text is filler (one ``" tok"`` per token); nothing of the prompt is kept or logged. Tokens
are delivered as the node's clock advances: one SSE chunk per clock tick carries every token generated
since the previous tick (vLLM merges deltas the same way when the client lags). A client that
disconnects cancels its handler (aiohttp ``handler_cancellation``) and the request is aborted in the
engine at once, freeing its KV.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Callable, Sequence

from aiohttp import web

from kvwatch.jsonsafe import loads
from kvwatch.sim.engine import SimEngine, TokenEvent
from kvwatch.sim.exposition_writer import render_vllm_metrics

FILLER = " tok"
VLLM_VERSION = "0.33.0"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class BadRequestError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def _error(message: str, status: int = 400, param: str | None = None) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


class SimServer:
    """One API server over one or more DP ranks (``engines``), advanced by someone else's clock.

    ``clock()`` returns the current simulated time (arrival stamps). The engines must be advanced by
    a driver (``SimNode``); this class only submits, subscribes and aborts.
    """

    def __init__(
        self,
        engines: Sequence[SimEngine],
        *,
        model_name: str,
        clock: Callable[[], float],
        output_tokens: Callable[[], int],
        chars_per_token: float = 4.0,
    ) -> None:
        if not engines:
            raise ValueError("a server needs at least one engine")
        self.engines = list(engines)
        self.model_name = model_name
        self.clock = clock
        self.output_tokens = output_tokens
        self.chars_per_token = chars_per_token
        self.created = time.time()
        self.url: str | None = None
        self._next = 0
        self._runner: web.AppRunner | None = None
        self._model_json = json.dumps(model_name)

    # ------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 2**20)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen (port 0: a free one) and return the base URL."""
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound_port = self._runner.addresses[-1][1]  # the port actually bound when port=0
        self.url = f"http://{host}:{bound_port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ plain endpoints

    async def _metrics(self, request: web.Request) -> web.Response:
        body = render_vllm_metrics(self.engines, self.model_name, self.created)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": int(self.created),
            "owned_by": "vllm",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.engines[0].config.context_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    # ------------------------------------------------------------------ completions

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = loads(await request.read())
        except ValueError:  # UnicodeDecodeError is one
            return _error("request body is not valid JSON")
        try:
            job = self._parse(body, chat)
        except BadRequestError as exc:
            return _error(str(exc), exc.status, exc.param)
        engine = self._pick_engine()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            engine.submit(
                rid,
                job["prompt"],
                job["max_tokens"],
                job["output"],
                arrival=self.clock(),
                ignore_eos=job["ignore_eos"],
                prefix_id=job["prefix_id"],
                prefix_tokens=job["prefix_tokens"],
            )
        except ValueError as exc:  # what the engine refuses, vLLM answers with a 400
            return _error(str(exc))
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        engine.subscribe(rid, events.put_nowait)
        finished = False
        try:
            if job["stream"]:
                resp, finished = await self._stream(request, rid, events, job, chat)
            else:
                resp = await self._whole(rid, events, job, chat)
                finished = True
            return resp
        finally:
            if not finished:  # client went away (cancelled handler or broken pipe)
                engine.unsubscribe(rid)
                engine.abort(rid)

    def _pick_engine(self) -> SimEngine:
        """vLLM's internal DP load balancer: fewest running + waiting, waiting penalised under
        KV pressure (``DPLBAsyncMPClient.get_core_engine_for_request``); ties rotate."""
        engines = self.engines
        if len(engines) == 1:
            return engines[0]
        n = len(engines)
        best, best_score = engines[self._next % n], math.inf
        for k in range(n):
            e = engines[(self._next + k) % n]
            waiting = e.num_waiting
            score: float = waiting + e.num_running
            if waiting:
                score += waiting * 6.0 * max(0.0, e.kv_usage - 0.5)
            if score < best_score:
                best, best_score = e, score
        self._next = (self._next + 1) % n
        return best

    def _parse(self, body: object, chat: bool) -> dict:
        if not isinstance(body, dict):
            raise BadRequestError("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequestError(f"The model `{model}` does not exist.", 404, "model")
        if body.get("n", 1) != 1:
            raise BadRequestError("the simulator serves n=1 only", param="n")
        hint = body.get("kvwatch_sim") or {}
        if not isinstance(hint, dict):
            raise BadRequestError("kvwatch_sim must be an object", param="kvwatch_sim")
        prompt = hint.get("prompt_tokens")
        if prompt is None:
            prompt = self._estimate_prompt(body, chat)
        max_tokens = (
            body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens", 16)
        )
        limit = self.engines[0].config.context_len
        for name, value in (("prompt_tokens", prompt), ("max_tokens", max_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise BadRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
        if max_tokens is not None and prompt + max_tokens > limit:
            raise BadRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        if prompt >= limit:
            raise BadRequestError(
                f"This model's maximum context length is {limit} tokens; the prompt has {prompt}."
            )
        output = hint.get("output_tokens")
        if output is None:
            output = self.output_tokens()
        elif not isinstance(output, int) or output < 1:
            raise BadRequestError(f"kvwatch_sim.output_tokens must be a positive integer, got {output!r}")
        prefix_tokens = hint.get("prefix_tokens", 0)
        if not isinstance(prefix_tokens, int) or not 0 <= prefix_tokens <= prompt:
            raise BadRequestError(
                f"kvwatch_sim.prefix_tokens must be an integer within the prompt, got {prefix_tokens!r}"
            )
        prefix_id = hint.get("prefix_id")
        if prefix_id is not None and not isinstance(prefix_id, str):
            raise BadRequestError(f"kvwatch_sim.prefix_id must be a string, got {prefix_id!r}")
        options = body.get("stream_options") or {}
        return {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "output": output,
            "ignore_eos": bool(body.get("ignore_eos", False)),
            "prefix_id": prefix_id if prefix_tokens else None,
            "prefix_tokens": prefix_tokens,
            "stream": bool(body.get("stream", False)),
            "include_usage": bool(options.get("include_usage", False)),
            "continuous_usage": bool(options.get("continuous_usage_stats", False)),
        }

    def _estimate_prompt(self, body: dict, chat: bool) -> int:
        cpt = self.chars_per_token
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequestError("messages must be a non-empty list", param="messages")
            chars = 0
            for m in messages:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, str):
                    chars += len(content)
                elif isinstance(content, list):
                    chars += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
            return max(1, math.ceil(chars / cpt) + 3 * len(messages))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return max(1, math.ceil(len(prompt) / cpt))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        raise BadRequestError(
            "prompt must be a string, a one-string list or a list of token ids", param="prompt"
        )

    # ------------------------------------------------------------------ responses

    async def _stream(
        self, request: web.Request, rid: str, events: asyncio.Queue, job: dict, chat: bool
    ) -> tuple[web.StreamResponse, bool]:
        """Relay token events as SSE; returns (response, whether the request finished)."""
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        try:
            await resp.prepare(request)
            await self._relay(resp, rid, events, job, chat)
        except ConnectionResetError:  # the client left (before the headers or under a write);
            return resp, False  # aiohttp's ClientConnectionResetError is a ConnectionResetError
        return resp, True

    async def _relay(
        self, resp: web.StreamResponse, rid: str, events: asyncio.Queue, job: dict, chat: bool
    ) -> None:
        created = int(time.time())
        head = (
            f'data: {{"id":"{rid}","object":"{"chat.completion.chunk" if chat else "text_completion"}",'
            f'"created":{created},"model":{self._model_json},"choices":[{{"index":0,'
        )
        prompt = job["prompt"]
        continuous = job["continuous_usage"]
        first = True
        while True:
            ev: TokenEvent = await events.get()
            if ev.finish_reason == "abort":
                break
            parts = []
            if chat and first:
                parts.append(
                    head + '"delta":{"role":"assistant","content":""},"logprobs":null,'
                    '"finish_reason":null}]' + self._usage_tail(continuous, prompt, 0)
                )
            first = False
            if ev.new_tokens or ev.finish_reason:
                text = FILLER * ev.new_tokens
                reason = "null" if ev.finish_reason is None else f'"{ev.finish_reason}"'
                if chat:
                    choice = f'"delta":{{"content":"{text}"}},"logprobs":null,"finish_reason":{reason}}}]'
                else:
                    choice = f'"text":"{text}","logprobs":null,"finish_reason":{reason},"stop_reason":null}}]'
                parts.append(head + choice + self._usage_tail(continuous, prompt, ev.generated_tokens))
            if ev.finish_reason is not None:
                if job["include_usage"]:
                    usage = json.dumps(_usage(prompt, ev.generated_tokens))
                    parts.append(head[: head.index('"choices"')] + f'"choices":[],"usage":{usage}}}\n\n')
                parts.append("data: [DONE]\n\n")
                await resp.write("".join(parts).encode())
                break
            if parts:
                await resp.write("".join(parts).encode())
        await resp.write_eof()

    @staticmethod
    def _usage_tail(continuous: bool, prompt: int, completion: int) -> str:
        if not continuous:
            return "}\n\n"
        return f',"usage":{json.dumps(_usage(prompt, completion))}}}\n\n'

    async def _whole(self, rid: str, events: asyncio.Queue, job: dict, chat: bool) -> web.Response:
        while True:
            ev: TokenEvent = await events.get()
            if ev.finish_reason is not None:
                break
        if ev.finish_reason == "abort":
            return _error("request aborted", 500)
        text = FILLER * ev.generated_tokens
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": ev.finish_reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": ev.finish_reason,
                "stop_reason": None,
            }
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                "usage": _usage(job["prompt"], ev.generated_tokens),
            }
        )


def _usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
    }
