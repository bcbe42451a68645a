"""/metrics is gzipped when the scraper accepts gzip (Prometheus asks by default: scrape/scrape.go
sends ``Accept-Encoding: gzip``), and sent as is otherwise, including when gzip is refused (q=0)."""

from __future__ import annotations

import gzip

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvwatch.export.encode import TextEncoder
from kvwatch.export.server import accepts_gzip, metrics_app

from .node import full_node_registry


@pytest.mark.parametrize(
    ("header", "gzipped"),
    [
        ("gzip", True),  # Prometheus
        ("gzip, deflate", True),  # httpx, aiohttp, curl --compressed
        ("deflate, GZIP;q=0.5", True),
        ("*", True),
        ("", False),
        ("identity", False),
        ("gzip;q=0", False),
        ("gzip; q=0.000", False),
        ("x-gzip-not", False),
        ("*;q=0.5, gzip;q=0", False),  # a coding named outranks "*"
        ("gzip;q=0, *", False),
        ("*;q=0, gzip", True),
        ("gzip;q=lots", False),
    ],
)
def test_which_accept_encodings_get_gzip(header: str, gzipped: bool):
    assert accepts_gzip(header) is gzipped


async def test_a_scrape_that_accepts_gzip_gets_gzip_and_one_that_does_not_gets_identity():
    registry = full_node_registry(replicas=2)
    client = TestClient(TestServer(metrics_app(registry, lambda: True)), auto_decompress=False)
    await client.start_server()
    try:
        zipped = await client.get("/metrics", headers={"Accept-Encoding": "gzip"})
        plain = await client.get("/metrics", skip_auto_headers=("Accept-Encoding",))
        refused = await client.get("/metrics", headers={"Accept-Encoding": "gzip;q=0"})
        zipped_body, plain_body = await zipped.read(), await plain.read()
        refused_body = await refused.read()
    finally:
        await client.close()
    assert zipped.headers["Content-Encoding"] == "gzip"
    assert "Content-Encoding" not in plain.headers and "Content-Encoding" not in refused.headers
    assert gzip.decompress(zipped_body) == plain_body == refused_body == TextEncoder().encode(registry)
    assert len(zipped_body) < len(plain_body) / 5
