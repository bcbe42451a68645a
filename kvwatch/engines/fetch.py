"""Fetching an engine's metrics page (or llama.cpp's ``/slots``) over HTTP: the one place that does.

Every failure is a ``ScrapeError(reason, message)``; ``reason`` is a label value of
``kvwatch_target_scrape_errors_total{replica,reason}`` and the message names the replica, the URL and
what to check. The whole fetch has one deadline (``timeout_s``), so a server that drips a byte at a
time cannot hold a scrape open, and the body is streamed and cut at ``max_bytes`` (decoded bytes,
so a gzip bomb is cut too). Response bodies are never put into messages or logs.
"""

from __future__ import annotations

import asyncio

import httpx

from kvwatch.catalog import SCRAPE_ERROR_REASONS
from kvwatch.safetext import shown_url

ACCEPT_METRICS = "text/plain;version=0.0.4;q=0.9,text/plain;q=0.5,*/*;q=0.1"
ACCEPT_JSON = "application/json"


class ScrapeError(Exception):
    """A failed scrape: ``reason`` (one of ``SCRAPE_ERROR_REASONS``) and a message saying what to fix."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in SCRAPE_ERROR_REASONS, reason
        self.reason = reason
        self.message = message
        super().__init__(f"{reason}: {message}")


async def fetch_body(
    client: httpx.AsyncClient,
    url: str,
    *,
    replica: str,
    timeout_s: float,
    max_bytes: int,
    accept: str = ACCEPT_METRICS,
) -> tuple[bytes, str]:
    """GET ``url``; return (body, content type). Raises ``ScrapeError``."""
    where = f"replica {replica}: {shown_url(url)}" if replica else shown_url(url)
    try:
        async with asyncio.timeout(timeout_s):
            return await _get(client, url, where, timeout_s, max_bytes, accept)
    except TimeoutError:
        raise ScrapeError(
            "timeout",
            f"{where} did not answer completely within {timeout_s:g}s "
            "(scrape.timeout / replicas[].scrape_timeout)",
        ) from None
    except httpx.TimeoutException:
        raise ScrapeError("timeout", f"{where} timed out after {timeout_s:g}s") from None
    except httpx.RemoteProtocolError as exc:
        raise ScrapeError(
            "malformed", f"{where} broke the HTTP exchange ({_brief(exc)}): body truncated or not HTTP"
        ) from None
    except (httpx.ConnectError, httpx.NetworkError, httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
        raise ScrapeError(
            "connect", f"{where} unreachable ({_brief(exc)}): is the engine running and is the URL right?"
        ) from None
    except httpx.HTTPError as exc:
        raise ScrapeError("connect", f"{where} failed: {_brief(exc)}") from None


def _brief(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 160 else text[:160] + "..."


async def _get(
    client: httpx.AsyncClient, url: str, where: str, timeout_s: float, max_bytes: int, accept: str
) -> tuple[bytes, str]:
    async with client.stream(
        "GET", url, headers={"Accept": accept}, timeout=httpx.Timeout(timeout_s)
    ) as response:
        if response.status_code != 200:
            raise ScrapeError(
                "http_status",
                f"{where} answered HTTP {response.status_code} {response.reason_phrase}".rstrip(),
            )
        declared = response.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_bytes:
            raise ScrapeError(
                "too_large",
                f"{where} announced {int(declared)} bytes, over the "
                f"{max_bytes}-byte limit (scrape.max_response_bytes)",
            )
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > max_bytes:
                raise ScrapeError(
                    "too_large",
                    f"{where} sent more than {max_bytes} bytes; stopped reading (scrape.max_response_bytes)",
                )
            chunks.append(chunk)
        return b"".join(chunks), response.headers.get("content-type", "")


def metrics_text(body: bytes, content_type: str, *, replica: str, url: str) -> str:
    """Decode a metrics body, refusing what is plainly not an exposition (HTML, JSON, binary)."""
    where = f"replica {replica}: {shown_url(url)}" if replica else shown_url(url)
    kind = content_type.split(";", maxsplit=1)[0].strip().lower()
    head = body[:512].lstrip().lower()
    if kind == "text/html" or head.startswith((b"<!doctype", b"<html", b"<?xml", b"<")):
        raise ScrapeError(
            "not_metrics",
            f"{where} returned an HTML page, not Prometheus metrics "
            "(a proxy or error page? check metrics_url)",
        )
    if kind == "application/json" or head.startswith((b"{", b"[")):
        raise ScrapeError(
            "not_metrics",
            f"{where} returned JSON, not Prometheus text (TensorRT-LLM "
            "serves Prometheus on /prometheus/metrics; its /metrics is a "
            "JSON stats queue)",
        )
    if b"\x00" in body:
        raise ScrapeError("not_metrics", f"{where} returned binary data, not Prometheus text")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScrapeError("not_metrics", f"{where} body is not UTF-8 text (byte {exc.start})") from None


async def fetch_metrics(
    client: httpx.AsyncClient, url: str, *, replica: str, timeout_s: float, max_bytes: int
) -> str:
    """GET a Prometheus text page; ``ScrapeError`` on transport, status, size or content problems."""
    body, content_type = await fetch_body(
        client, url, replica=replica, timeout_s=timeout_s, max_bytes=max_bytes
    )
    return metrics_text(body, content_type, replica=replica, url=url)
