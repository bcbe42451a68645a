"""The agent's HTTP surface: ``/metrics``, health endpoints, and whatever routes the status page adds.

``/metrics`` is rendered at scrape time from ``NodeState`` by the node collector; the render runs
in a worker thread so a large exposition never stalls the event loop (and the proxy streams on it).
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Callable, Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.registry import Collector

from kvwatch.export.encode import TEXT_CONTENT_TYPE, TextEncoder
from kvwatch.export.protobuf import PROTOBUF_CONTENT_TYPE, ProtobufEncoder, wants_protobuf

_MAX_ACCEPT_ENCODING_BYTES = 8192  # aiohttp's own header limit


def make_registry(collector: Collector) -> CollectorRegistry:
    """The agent's registry: the node collector, and prometheus_client's process (RSS, CPU, open fds,
    start time; read from /proc at scrape time) and platform (``python_info``) collectors."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` header takes gzip: named with a q-value above 0, or not named
    and ``*`` is (RFC 9110: a coding named outranks ``*``, so ``*, gzip;q=0`` refuses gzip)."""
    weights: dict[str, float] = {}
    for item in accept_encoding[:_MAX_ACCEPT_ENCODING_BYTES].split(","):
        coding, _, params = item.partition(";")
        weights.setdefault(coding.strip().lower(), _q_value(params))
    return weights.get("gzip", weights.get("*", 0.0)) > 0


def _q_value(params: str) -> float:
    """An entry's ``q`` (1 when absent); a q that does not parse is 0, the safe side."""
    name, _, value = params.partition("=")
    if name.strip().lower() != "q":
        return 1.0
    try:
        return float(value)
    except ValueError:
        return 0.0


def metrics_app(
    registry: CollectorRegistry, ready: Callable[[], bool], extra_routes: Iterable[web.RouteDef] = ()
) -> web.Application:
    """aiohttp app serving the exposition, ``/-/healthy`` (process alive) and ``/-/ready``."""

    encoder = TextEncoder()
    protobuf = ProtobufEncoder()

    async def metrics(request: web.Request) -> web.Response:
        if wants_protobuf(request.headers.get("Accept", "")):  # native histograms: docs/scale.md
            body = await asyncio.to_thread(protobuf.encode, registry)
            headers = {"Content-Type": PROTOBUF_CONTENT_TYPE}
        else:
            body = await asyncio.to_thread(encoder.encode, registry)
            headers = {"Content-Type": TEXT_CONTENT_TYPE}
        if accepts_gzip(request.headers.get("Accept-Encoding", "")):
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        return web.Response(body=body, headers=headers)

    async def healthy(_request: web.Request) -> web.Response:
        return web.Response(text="kvwatch is healthy\n")

    async def is_ready(_request: web.Request) -> web.Response:
        if ready():
            return web.Response(text="kvwatch is ready\n")
        return web.Response(status=503, text="kvwatch is starting\n")

    app = web.Application(client_max_size=1024 * 1024)
    app.add_routes(
        [
            web.get("/metrics", metrics),
            web.get("/-/healthy", healthy),
            web.get("/-/ready", is_ready),
            *extra_routes,
        ]
    )
    return app
