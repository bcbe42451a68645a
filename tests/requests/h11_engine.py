"""An engine whose HTTP/1 parser is h11: what uvicorn runs when httptools is not installed.

h11 splits a head on a bare LF and lets ``Transfer-Encoding`` win over ``Content-Length``, so a
header value holding ``\\nTransfer-Encoding: chunked`` that a proxy forwards byte for byte frames
the body differently here than in the proxy: request smuggling (RFC 9112 section 11.2). Every answer
names the request target it answers, after ``delay`` seconds, so a test sees which response went
to which client through kvwatch's shared upstream pool.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import h11


class H11Engine:
    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.targets: list[bytes] = []  # every request target h11 parsed, in order
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    conn.receive_data(data)
                    if not data:
                        return
                    continue
                if isinstance(event, h11.Request):
                    self.targets.append(event.target)
                elif isinstance(event, h11.EndOfMessage):
                    await asyncio.sleep(self.delay)
                    body = b"response to " + self.targets[-1]
                    writer.write(
                        conn.send(
                            h11.Response(
                                status_code=200,
                                headers=[("content-type", "text/plain"), ("content-length", str(len(body)))],
                            )
                        )
                    )
                    writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
                    await writer.drain()
                    if conn.our_state is h11.MUST_CLOSE:
                        return
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    return
        except (h11.RemoteProtocolError, h11.LocalProtocolError, ConnectionError):
            return
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def h11_engine(delay: float = 0.0) -> AsyncIterator[H11Engine]:
    engine = H11Engine(delay)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()
