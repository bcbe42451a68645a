"""A client's own timing of a stream, on the clock the scripted engine and kvwatch stamp with
(``time.perf_counter``, one process): the conformance and the longest-gap tests bound what kvwatch
measured between what the engine and the client saw."""

from __future__ import annotations

import json
import time

from aiohttp import ClientSession


def _is_content(event: bytes) -> bool:
    """The client's own judgement of a content-bearing event, by parsing it."""
    if not event.startswith(b"data: {"):
        return False
    doc = json.loads(event[6:])
    for choice in doc.get("choices") or ():
        delta = choice.get("delta") or {}
        if any(delta.get(k) for k in ("content", "reasoning", "reasoning_content", "tool_calls")):
            return True
        if choice.get("text"):
            return True
    return False


async def stream(session: ClientSession, url: str, body: dict) -> dict:
    """POST and read the stream; arrival time of every content event on perf_counter."""
    sent = time.perf_counter()
    async with session.post(url, json=body) as response:
        raw = b""
        arrivals: list[float] = []
        pending = b""
        async for data in response.content.iter_any():
            now = time.perf_counter()
            raw += data
            pending += data
            *events, pending = pending.split(b"\n\n")
            arrivals += [now for e in events if _is_content(e)]
        ended = time.perf_counter()
        return {
            "sent": sent,
            "arrivals": arrivals,
            "ended": ended,
            "raw": raw,
            "status": response.status,
            "headers": response.headers,
        }
