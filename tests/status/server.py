"""Serve the status routes over a NodeState on a free loopback port (for page and top tests)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from kvwatch.config import Config
from kvwatch.state import NodeState
from kvwatch.status.page import make_status_routes

from .node import T0


@contextlib.asynccontextmanager
async def serve(state: NodeState, cfg: Config, clock: Callable[[], float] = lambda: T0 + 11,
                middleware: Callable | None = None) -> AsyncIterator[str]:
    app = web.Application(middlewares=[middleware] if middleware else [])
    app.add_routes(make_status_routes(state, cfg, clock))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
