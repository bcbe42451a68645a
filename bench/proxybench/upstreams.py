"""Role upstream: an OpenAI-style SSE engine, paced by flags, stamping its send times into the stream."""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import time

from proxybench.common import CONTENT_CHUNK, DONE, FINISH_CHUNK, ROLE_CHUNK, USAGE_CHUNK, _frame, _ready, pair

#: ``GET /v1/models``, as vLLM answers it for the bench's model
MODELS = b'{"object":"list","data":[{"id":"bench","object":"model","owned_by":"vllm"}]}'
MODELS_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
    len(MODELS),
    MODELS,
)


class _Upstream(asyncio.Protocol):
    chunks = 200
    chunk_range: tuple[int, int] | None = None  # each stream's length drawn from it, if set
    interval = 0.01
    tail: tuple[float, float] | None = None  # seconds between [DONE] and the last-chunk marker

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        """One request at a time; keep-alive unless the request says ``connection: close``; a path
        with ``break=N`` in its query gets a stream that breaks after N content chunks."""
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1")
        m = re.search(r"(?im)^content-length:\s*(\d+)", head)
        length = int(m.group(1)) if m else 0
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4 : end + 4 + length]
        self.buf = self.buf[end + 4 + length :]
        close = re.search(r"(?im)^connection:\s*close", head) is not None
        if head.startswith("GET /v1/models "):  # as an engine answers it (kvwatch learns model names)
            assert self.transport is not None
            self.transport.write(MODELS_RESPONSE)
            if close:
                self.transport.close()
            return
        cut = re.match(r"\S+ \S*[?&]break=(\d+)", head)  # the stream breaks after that many chunks
        breaks_after = int(cut.group(1)) if cut else None
        asyncio.get_running_loop().create_task(self.stream(body, time.perf_counter_ns(), close, breaks_after))

    async def stream(
        self, body: bytes, received_ns: int, close: bool, breaks_after: int | None = None
    ) -> None:
        t = self.transport
        assert t is not None
        usage = b'"include_usage":true' in body or b'"include_usage": true' in body
        t.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + _frame(ROLE_CHUNK % received_ns)
        )
        loop = asyncio.get_running_loop()
        start = loop.time()
        chunks = random.randint(*self.chunk_range) if self.chunk_range else self.chunks
        for i in range(chunks):
            if self.interval:
                delay = start + (i + 1) * self.interval - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
            if self.closed:
                return
            if i == breaks_after:  # an engine that dies mid-stream: the connection reset, no last chunk
                t.abort()
                return
            t.write(_frame(CONTENT_CHUNK % time.perf_counter_ns()))
        tail = _frame(FINISH_CHUNK)
        if usage:
            tail += _frame(USAGE_CHUNK % (chunks + 12, chunks))
        if self.tail is None:
            t.write(tail + _frame(DONE) + b"0\r\n\r\n")
        else:
            t.write(tail + _frame(DONE))
            await asyncio.sleep(random.uniform(*self.tail))
            if self.closed:
                return
            t.write(b"0\r\n\r\n")
        if close:
            t.close()


async def role_upstream(args: argparse.Namespace) -> None:
    _Upstream.chunks = args.chunks
    _Upstream.interval = args.interval
    if args.chunk_range:
        _Upstream.chunk_range = pair(args.chunk_range, int)
    if args.tail:
        _Upstream.tail = pair(args.tail, float)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Upstream, "127.0.0.1", args.port, backlog=1024)
    _ready(args.port)
    async with server:
        await server.serve_forever()
