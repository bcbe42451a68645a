"""The metrics fetcher against a real local HTTP server: every failure is a ScrapeError with a reason."""

from __future__ import annotations

import time

import pytest

from kvwatch.catalog import SCRAPE_ERROR_REASONS
from kvwatch.engines.fetch import ScrapeError, fetch_metrics, metrics_text

LIMIT = 1024 * 1024


async def fetch(client, url, timeout_s=5.0, max_bytes=LIMIT):
    return await fetch_metrics(client, url, replica="r0", timeout_s=timeout_s, max_bytes=max_bytes)


async def test_fetches_the_page(server, client):
    text = await fetch(client, server.url)
    assert text == server.body


async def test_timeout_with_a_slow_server(server, client):
    server.delay_s = 5.0
    started = time.monotonic()
    with pytest.raises(ScrapeError) as err:
        await fetch(client, server.url, timeout_s=0.3)
    assert err.value.reason == "timeout"
    assert "replica r0" in err.value.message and server.url in err.value.message
    assert time.monotonic() - started < 3.0  # generous: loaded 2-core machine


async def test_a_server_dripping_bytes_is_cut_at_the_total_deadline(server, client):
    """Each byte arrives well within a read timeout; only a whole-fetch deadline stops it."""
    server.mode = "drip"
    started = time.monotonic()
    with pytest.raises(ScrapeError) as err:
        await fetch(client, server.url, timeout_s=0.5)
    assert err.value.reason == "timeout"
    assert time.monotonic() - started < 5.0


async def test_announced_size_over_the_cap(server, client):
    server.body = "x 1\n" * 1000
    with pytest.raises(ScrapeError) as err:
        await fetch(client, server.url, max_bytes=1000)
    assert err.value.reason == "too_large"
    assert "4000 bytes" in err.value.message and "scrape.max_response_bytes" in err.value.message


async def test_streamed_body_is_cut_at_the_cap(server, client):
    server.mode = "huge_chunked"
    with pytest.raises(ScrapeError) as err:
        await fetch(client, server.url, max_bytes=100_000)
    assert err.value.reason == "too_large"
    assert "more than 100000 bytes" in err.value.message


async def test_body_shorter_than_content_length_is_malformed(server, client):
    server.mode = "short_body"
    with pytest.raises(ScrapeError) as err:
        await fetch(client, server.url)
    assert err.value.reason == "malformed"
    assert "truncated" in err.value.message


@pytest.mark.parametrize("status", [404, 500, 503])
async def test_http_error_status(server, client, status):
    server.status = status
    with pytest.raises(ScrapeError) as err:
        await fetch(client, server.url)
    assert err.value.reason == "http_status"
    assert f"HTTP {status}" in err.value.message


async def test_html_error_page_served_with_200(server, client):
    server.body = "<!DOCTYPE html><html><body>Bad gateway</body></html>"
    server.content_type = "text/plain"
    with pytest.raises(ScrapeError) as err:
        await fetch(client, server.url)
    assert err.value.reason == "not_metrics"
    assert "HTML" in err.value.message
    assert "Bad gateway" not in err.value.message  # bodies never go into messages


async def test_json_body_points_at_trtllm_prometheus_path(server, client):
    server.body = '[{"iter": 1, "kvCacheStats": {}}]'
    server.content_type = "application/json"
    with pytest.raises(ScrapeError) as err:
        await fetch(client, server.url)
    assert err.value.reason == "not_metrics"
    assert "/prometheus/metrics" in err.value.message


async def test_connection_refused(client, refused_url):
    with pytest.raises(ScrapeError) as err:
        await fetch(client, refused_url)
    assert err.value.reason == "connect"
    assert refused_url in err.value.message


def test_binary_and_non_utf8_bodies_are_not_metrics():
    for body in (b"\x00\x01\x02", b"vllm:x 1\n\xff\xfe\n"):
        with pytest.raises(ScrapeError) as err:
            metrics_text(body, "text/plain", replica="r0", url="http://h/metrics")
        assert err.value.reason == "not_metrics"


def test_reasons_are_the_catalog_label_values():
    from kvwatch.catalog import spec

    for reason in SCRAPE_ERROR_REASONS:
        assert reason in spec("kvwatch_target_scrape_errors").help
