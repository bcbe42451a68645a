"""Serve the status routes over a NodeState on a free loopback port (for page and top tests)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from kvwatch.config import Config
from kvwatch.state import NodeState
from kvwatch.status.page import make_status_routes
from tests.local import serving

from .node import T0


@contextlib.asynccontextmanager
async def serve(
    state: NodeState,
    cfg: Config,
    clock: Callable[[], float] = lambda: T0 + 11,
    middleware: Callable | None = None,
) -> AsyncIterator[str]:
    app = web.Application(middlewares=[middleware] if middleware else [])
    app.add_routes(make_status_routes(state, cfg, clock))
    async with serving(app) as base:
        yield base
