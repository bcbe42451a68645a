"""A real local HTTP server standing in for an engine's /metrics (aiohttp, loopback, free port).

Its behaviour is switched per test (``server.mode``): the fetcher and scraper are exercised over a
real socket, not mocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from tests.local import free_port, serve_app

from .helpers import page

METRICS_CT = "text/plain; version=0.0.4; charset=utf-8"


class EngineServer:
    """Serves ``/metrics`` and ``/slots`` the way the current ``mode`` says."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.body = page("vllm_0_32_cpu_idle.prom")
        self.slots_body: str | None = None
        self.status = 200
        self.delay_s = 0.0
        self.content_type = METRICS_CT
        self.requests = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.mode == "drip":  # headers at once, then a byte every 0.2 s for a long time
            resp = web.StreamResponse(headers={"Content-Type": METRICS_CT})
            await resp.prepare(request)
            for _ in range(200):
                await resp.write(b"#")
                await asyncio.sleep(0.2)
            return resp
        if self.mode == "huge_chunked":  # no Content-Length, endless valid lines
            resp = web.StreamResponse(headers={"Content-Type": METRICS_CT})
            await resp.prepare(request)
            line = b'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n' * 1000
            for _ in range(10_000):
                await resp.write(line)
            return resp
        if self.mode == "short_body":  # Content-Length promises more than is sent, then close
            body = self.body.encode()
            resp = web.StreamResponse(headers={"Content-Type": METRICS_CT, "Content-Length": str(len(body))})
            await resp.prepare(request)
            await resp.write(body[: len(body) // 2])
            request.transport.close()
            return resp
        return web.Response(
            body=self.body.encode(), status=self.status, headers={"Content-Type": self.content_type}
        )

    async def _slots(self, request: web.Request) -> web.Response:
        if self.slots_body is None:
            return web.Response(status=501, text='{"error": "This server does not support slots endpoint."}')
        return web.Response(text=self.slots_body, content_type="application/json")

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/slots", self._slots)
        self._runner, self.port = await serve_app(app, port, handle_signals=False, shutdown_timeout=0.5)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@pytest.fixture
async def server() -> AsyncIterator[EngineServer]:
    srv = EngineServer()
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as c:
        yield c


@pytest.fixture
def refused_url() -> str:
    """A loopback URL where nothing listens (port bound then released)."""
    return f"http://127.0.0.1:{free_port()}/metrics"
