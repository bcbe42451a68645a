"""An engine written against the socket, for failures no HTTP server library would produce (a reset
mid-stream, a bad chunk size, a head with control characters): the proxy must survive each one, in
the fault, hostile-input, pool and reuse tests alike."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_engine(handler: RawHandler) -> AsyncIterator[str]:
    """An engine that misbehaves at the socket level."""

    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # kvwatch hung up: part of the scenario
        finally:
            writer.close()  # an unclosed transport warns from __del__, which filterwarnings=error raises

    server = await asyncio.start_server(closing, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    return await reader.readexactly(length)
