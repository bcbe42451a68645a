"""A client process for test_independent_clients: the official ``openai`` SDK with one ``httpx``
keep-alive client, WORKERS concurrent workers each sending its share of LENGTHS sequentially.

Usage: openai_load.py BASE_URL OUT.json WORKERS LENGTHS_JSON ALLOWED_TOKEN_IDS_JSON

Writes one row per request: output_tokens (the engine's usage, as the SDK parsed it), ttft (to the
first chunk with non-empty text), e2e (to the end of the stream), start (perf_counter) and
connections (distinct connections the pool had used when the request ended). Timed here, in a
process of its own, as a real client would.

One ``GET /v1/models`` goes first, on the same pool: the SDK's first call builds its machinery and
opens the connection (seen: 27 ms before the first byte left), which no proxy can see, since the
request is not on the wire yet. The completions are then timed as a warm client times them.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import openai


async def main(base_url: str, out: str, workers: int, lengths: list[int], allowed: list[int]) -> None:
    connections: set[int] = set()

    async def note_connection(response: httpx.Response) -> None:
        connections.add(id(response.extensions.get("network_stream")))

    http = httpx.AsyncClient(
        timeout=120,
        limits=httpx.Limits(max_keepalive_connections=workers),
        event_hooks={"response": [note_connection]},
    )
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for n in lengths:
        queue.put_nowait(n)
    rows: list[dict] = []
    await client.models.list()

    async def worker() -> None:
        while not queue.empty():
            n = queue.get_nowait()
            start, start_wall = time.perf_counter(), time.time()
            ttft = None
            usage = None
            stream = await client.completions.create(
                model="tiny",
                prompt="Once upon a time",
                max_tokens=n,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "allowed_token_ids": allowed},
            )
            async for chunk in stream:
                if ttft is None and chunk.choices and chunk.choices[0].text:
                    ttft = time.perf_counter() - start
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            rows.append(
                {
                    "output_tokens": usage,
                    "ttft": ttft,
                    "e2e": time.perf_counter() - start,
                    "start": start,
                    "start_wall": start_wall,
                    "connections": len(connections),
                }
            )

    try:
        await asyncio.gather(*(worker() for _ in range(workers)))
    finally:
        await client.close()
        await http.aclose()
    with open(out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    asyncio.run(
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), json.loads(sys.argv[5]))
    )
