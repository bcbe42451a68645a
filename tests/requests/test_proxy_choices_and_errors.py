"""Streams of several sequences (n > 1) and streams an engine ends with an error event, through the
proxy, shaped as vLLM writes them (chat_completion/serving.py: choice ``index`` per sequence, one
finish chunk each; serving_engine.create_streaming_error_response: ``data: {"error": {...}}`` and
``[DONE]`` in a 200 stream)."""

from __future__ import annotations

import asyncio
import json

import httpx
from aiohttp import web

from kvwatch.model import Outcome
from tests.local import serving, until
from tests.requests.scripted import proxied

DONE = b"data: [DONE]\n\n"


def event(doc: dict) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def chunk(index: int, content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return event(
        {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny", "choices": [choice]}
    )


ERROR = event(
    {"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError", "code": 500}}
)


def engine(script: list[bytes], gap_s: float = 0.0) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for data in script:
            await asyncio.sleep(gap_s)
            await response.write(data)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def _one(script: list[bytes], body: dict, gap_s: float = 0.0):
    async with serving(engine(script, gap_s)) as url, proxied(url) as proxy:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(f"{proxy.url}/v1/chat/completions", json=body)
        await until(lambda: proxy.records)
        return response, proxy.records[0]


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 100}


async def test_an_error_event_in_a_200_stream_is_an_error_not_a_completion():
    """vLLM turns a generation error into an error event in the stream it already answered 200;
    the request was recorded completed, with a short e2e, in the band of the tokens it got."""
    response, record = await _one([chunk(0, ""), *(chunk(0, f"t{i}") for i in range(5)), ERROR, DONE], CHAT)
    assert response.status_code == 200 and b'"error"' in response.content
    assert record.outcome is Outcome.ERROR and record.status_code == 200
    _, first = await _one([ERROR, DONE], CHAT)  # the first event already
    assert first.outcome is Outcome.ERROR


async def test_n_choices_count_a_sequences_tokens_for_the_band_and_tpot():
    """vLLM runs n sequences; the record counted every choice's tokens as one answer's, so TPOT was
    divided by n and the request landed in a longer band than any of its sequences."""
    script = [chunk(i, "") for i in range(2)]
    for k in range(40):
        script += [chunk(0, f"a{k}"), chunk(1, f"b{k}")]
    script += [chunk(0, "", "stop"), chunk(1, "", "stop"), DONE]
    _, record = await _one(script, {**CHAT, "n": 2}, gap_s=0.002)
    assert record.outcome is Outcome.COMPLETED and record.choices == 2
    assert record.output_tokens == 40 and record.output_tokens_estimated
    span = record.e2e_seconds - record.ttft_seconds
    assert record.tpot_seconds == span / 39  # a sequence's 39 gaps, not 79


async def test_a_client_leaving_before_every_choice_finished_is_an_abort():
    """The first finish reason ended the request as completed, though the other choice was still
    generating when the client left (the engine was cut)."""
    script = [chunk(0, ""), chunk(1, ""), chunk(0, "x"), chunk(0, "", "stop")]
    script += [chunk(1, f"y{k}") for k in range(400)] + [chunk(1, "", "stop"), DONE]
    async with serving(engine(script, gap_s=0.01)) as url, proxied(url) as proxy:
        body = {**CHAT, "n": 2}
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream("POST", f"{proxy.url}/v1/chat/completions", json=body) as response,
        ):
            async for data in response.aiter_bytes():
                if b'"finish_reason":"stop"' in data:
                    break  # choice 0 is done, choice 1 is not
        await until(lambda: proxy.records)
    assert proxy.records[0].outcome is Outcome.ABORTED
