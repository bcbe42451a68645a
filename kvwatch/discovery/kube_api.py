"""The pods on this node, kept current through the Kubernetes API: list, then watch.

Client: plain httpx (already a dependency) speaking the watch protocol, rather than
kubernetes_asyncio (a generated client of every API group, megabytes of models, for one GET) or
lightkube (small, but its watch iterator owns the stream, so it cannot enforce a byte budget per
event). The protocol, as client-go's reflector follows it:

1. ``GET /api/v1/pods?fieldSelector=spec.nodeName=<node>``: the pods now, and the list's
   ``resourceVersion``; the known set is replaced whole (pods deleted meanwhile drop out).
2. ``GET ...&watch=1&resourceVersion=<rv>&allowWatchBookmarks=true&timeoutSeconds=<t>``: a chunked
   stream of one JSON event per line, ``ADDED`` / ``MODIFIED`` / ``DELETED`` / ``BOOKMARK`` /
   ``ERROR``. Every event moves ``rv`` on; a bookmark only moves ``rv`` (so a quiet watch can resume
   without a relist). When the server ends the watch (``timeoutSeconds``), watch again from ``rv``.
3. ``410 Gone``, as an HTTP status or as an ``ERROR`` event whose Status has ``code: 410`` (the
   version is older than the server's watch cache): list again.
4. API unreachable (connect error, timeout, 5xx, 401/403): keep the last known pods, marked stale,
   retry with exponential backoff (0.5 s doubling to ``backoff_max``, with jitter).

A list over 128 KiB comes gzipped (kube-apiserver compresses non-watch responses past that size when
the client offers gzip, as httpx does; watch streams never are). The offer is kept, since it cuts what
a fleet of agents relisting costs the API server's network, and the body is inflated here in bounded
steps, so ``max_list_bytes`` counts decoded bytes and a small compressed body cannot inflate past it.

The stream is outsider input: lines are split in linear time, one event may be at most
``max_event_bytes`` and a list ``max_list_bytes``. An event that is too large, not JSON, not an
event, or cut off by a broken connection is counted and the watch restarts from the last event it
applied, so nothing is skipped and nothing crashes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvwatch.config import KubernetesDiscoveryConfig
from kvwatch.selfmetrics import Count, Report

log = logging.getLogger(__name__)

EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")
WATCH_EVENTS = "kvwatch_discovery_watch_events"
WATCH_ERRORS = "kvwatch_discovery_watch_errors"
RELISTS = "kvwatch_discovery_relists"
BACKOFF_BASE_S = 0.5
OFF_LOOP_BYTES = 1024 * 1024
COLLECTOR = "kubernetes"
#: the only verbs the agent sends (the discovery overlay's ClusterRole grants exactly these)
POD_VERBS = ("list", "watch")

Pods = dict[str, dict[str, Any]]  # pod uid -> pod object as the API sent it


class ApiError(Exception):
    """A failed request; ``reason`` is the counted label (unreachable, http_status, gone, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class GoneError(ApiError):
    """410: the resourceVersion is too old; list again."""

    def __init__(self, message: str) -> None:
        super().__init__("gone", message)


class StreamError(ApiError):
    """The watch stream broke the protocol (malformed, too_large, truncated); watch again from rv."""


def in_cluster_url(environ: Mapping[str, str]) -> str:
    """``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``, as client-go's InClusterConfig."""
    host = environ.get("KUBERNETES_SERVICE_HOST")
    port = environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ApiError("config", "not in a cluster: KUBERNETES_SERVICE_HOST is not set; set "
                                 "discovery.kubernetes.api_url")
    host = f"[{host}]" if ":" in host else host
    return f"https://{host}:{port}"


def split_lines(buffer: bytearray, chunk: bytes, max_line: int) -> list[bytes]:
    """Append ``chunk`` and cut off every complete line; linear in the bytes seen.

    Raises StreamError when an unfinished line already exceeds ``max_line``.
    """
    start = len(buffer)
    buffer += chunk
    lines = []
    begin = 0
    newline = buffer.find(b"\n", max(start, 0))
    while newline != -1:
        lines.append(bytes(buffer[begin:newline]))
        begin = newline + 1
        newline = buffer.find(b"\n", begin)
    del buffer[:begin]
    too_long = [line for line in lines if len(line) > max_line]
    if too_long or len(buffer) > max_line:
        raise StreamError("too_large", f"a watch event exceeds max_event_bytes ({max_line} bytes)")
    return [line for line in lines if line.strip()]


def decode_event(line: bytes) -> tuple[str, dict[str, Any]]:
    """(type, object) of one watch line; StreamError(malformed) for anything else."""
    try:
        event = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StreamError("malformed", f"watch event is not JSON: {exc}") from None
    if not isinstance(event, dict) or event.get("type") not in EVENT_TYPES \
            or not isinstance(event.get("object"), dict):
        raise StreamError("malformed", "watch line is not an event {type, object}")
    kind, obj = event["type"], event["object"]
    if kind != "ERROR" and not isinstance(obj.get("metadata"), dict):
        raise StreamError("malformed", f"{kind} event without object metadata")
    return kind, obj


async def _decoded_body(resp: httpx.Response, limit: int) -> bytes:
    """The list body as JSON bytes, identity or gzip, at most ``limit`` bytes once decoded."""
    encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip"):
        raise ApiError("malformed", f"pod list in an unsupported Content-Encoding {encoding[:40]!r}")
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if encoding == "gzip" else None
    body = bytearray()
    async for chunk in resp.aiter_raw():
        if inflate is None:
            body += chunk
        else:
            pending = chunk
            try:
                while pending and len(body) <= limit:  # max_length > 0 always: inflation stays bounded
                    body += inflate.decompress(pending, limit + 1 - len(body))
                    pending = inflate.unconsumed_tail
            except zlib.error as exc:
                raise ApiError("malformed", f"pod list is not valid gzip: {exc}") from None
        if len(body) > limit:
            raise ApiError("too_large", f"pod list exceeds max_list_bytes ({limit} bytes, decoded)")
    if inflate is not None and not inflate.eof:
        raise ApiError("malformed", "pod list ends inside its gzip stream")
    return bytes(body)


def resource_version(obj: Mapping[str, Any]) -> str | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv else None


@dataclass(slots=True)
class WatchStatus:
    """What the agent exports about the watch."""

    stale: bool = True  # no successful list yet, or the API is unreachable now
    synced: bool = False  # a list has succeeded at least once
    resource_version: str | None = None
    last_error: str | None = None


class PodWatch:
    """Keeps ``pods`` (this node's pods) current and calls ``on_change(pods)`` after every change.

    ``count(family, *labels)`` and ``report(collector, success, duration, error)`` are the agent's
    self-metric sinks (NodeState.count / NodeState.report). ``run()`` loops until cancelled.
    """

    def __init__(self, config: KubernetesDiscoveryConfig, node: str,
                 on_change: Callable[[Pods], None], count: Count,
                 report: Report, environ: Mapping[str, str] | None = None,
                 sleep: Callable[[float], Any] = asyncio.sleep,
                 on_stale: Callable[[bool], None] = lambda stale: None) -> None:
        self.config = config
        self.node = node
        self.pods: Pods = {}
        self.status = WatchStatus()
        self._on_change = on_change
        self._on_stale = on_stale
        self._count = count
        self._report = report
        self._environ = os.environ if environ is None else environ
        self._sleep = sleep
        self._failures = 0

    # -- the loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        base = self.config.api_url or in_cluster_url(self._environ)
        async with httpx.AsyncClient(base_url=base, verify=self._verify(base), follow_redirects=False,
                                     timeout=httpx.Timeout(10.0, read=30.0)) as client:
            rv: str | None = None
            while True:
                try:
                    if rv is None:
                        rv = await self._list(client)
                    rv = await self._watch(client, rv)
                except GoneError as exc:
                    self._count(RELISTS)
                    self._count(WATCH_ERRORS, exc.reason)
                    log.info("kubernetes: %s; listing pods again", exc)
                    rv = None
                except StreamError as exc:
                    rv = self.status.resource_version  # the last event applied
                    self._count(WATCH_ERRORS, exc.reason)
                    log.warning("kubernetes: %s; watching again from resourceVersion %s", exc, rv)
                    await self._backoff()
                except ApiError as exc:
                    rv = self.status.resource_version if self.status.synced else None
                    self._failed(exc)
                    await self._backoff()

    def _verify(self, base: str) -> ssl.SSLContext | bool:
        if not base.startswith("https://"):
            return False
        ca = self.config.ca_file
        if ca and Path(ca).exists():
            return ssl.create_default_context(cafile=ca)
        return ssl.create_default_context()

    def _headers(self) -> dict[str, str]:
        """A fresh read of the token each request: projected service account tokens rotate."""
        headers = {"Accept": "application/json", "User-Agent": "kvwatch"}
        path = self.config.token_file
        if path:
            try:
                token = Path(path).read_text(encoding="utf-8").strip()
            except OSError:
                token = ""
            if token:
                headers["Authorization"] = f"Bearer {token}"
        return headers

    def _params(self, **extra: str) -> dict[str, str]:
        return {"fieldSelector": f"spec.nodeName={self.node}", **extra}

    async def _backoff(self) -> None:
        self._failures += 1
        delay = min(self.config.backoff_max_s, BACKOFF_BASE_S * 2.0 ** (self._failures - 1))
        await self._sleep(delay * random.uniform(0.8, 1.2))

    def _failed(self, exc: ApiError) -> None:
        self._count(WATCH_ERRORS, exc.reason)
        first = not self.status.stale or self.status.last_error != str(exc)
        self.status.stale = True
        self._on_stale(True)
        self.status.last_error = str(exc)
        self._report(COLLECTOR, False, 0.0, str(exc))
        if first:
            kept = f"; keeping the {len(self.pods)} known pod(s), marked stale" if self.pods else ""
            log.warning("kubernetes: %s%s", exc, kept)

    def _healthy(self, started: float) -> None:
        if self.status.stale and self.status.synced:
            log.info("kubernetes: API reachable again")
        self.status.stale = False
        self._on_stale(False)
        self.status.last_error = None
        self._failures = 0
        self._report(COLLECTOR, True, time.perf_counter() - started)

    # -- list --------------------------------------------------------------------------------------
    async def _list(self, client: httpx.AsyncClient) -> str:
        started = time.perf_counter()
        body = await self._get_bounded(client, self._params(), self.config.max_list_bytes)
        try:
            # a node's pods are ~10 KiB each; a large list decodes off the event loop (the proxy runs there)
            small = len(body) < OFF_LOOP_BYTES
            data = json.loads(body) if small else await asyncio.to_thread(json.loads, body)
            items = data["items"] if isinstance(data.get("items"), list) else []
            rv = str(data["metadata"]["resourceVersion"])
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ApiError("malformed", "pod list is not a PodList with metadata.resourceVersion") from None
        pods: Pods = {}
        for item in items:
            uid = (item.get("metadata") or {}).get("uid") if isinstance(item, dict) else None
            if uid:
                pods[str(uid)] = item
        self.pods = pods
        self.status.synced = True
        self.status.resource_version = rv
        self._healthy(started)
        self._on_change(self.pods)
        return rv

    async def _get_bounded(self, client: httpx.AsyncClient, params: dict[str, str], limit: int) -> bytes:
        try:
            async with client.stream("GET", "/api/v1/pods", params=params, headers=self._headers()) as resp:
                self._check(resp)
                return await _decoded_body(resp, limit)
        except httpx.HTTPError as exc:
            raise ApiError("unreachable",
                           f"API server {client.base_url}: {type(exc).__name__}: {exc}") from None

    @staticmethod
    def _check(resp: httpx.Response) -> None:
        if resp.status_code == 410:
            raise GoneError(f"HTTP 410 Gone for {resp.url.path}")
        if resp.status_code in (401, 403):
            raise ApiError("http_status", f"HTTP {resp.status_code} from the API server: the service "
                                          f"account needs {' and '.join(POD_VERBS)} on pods (ClusterRole "
                                          "kvwatch-pod-reader)")
        if resp.status_code != 200:
            raise ApiError("http_status", f"HTTP {resp.status_code} from the API server for {resp.url.path}")

    # -- watch -------------------------------------------------------------------------------------
    async def _watch(self, client: httpx.AsyncClient, rv: str) -> str:
        """Apply events until the server ends the watch; return the resourceVersion to resume from."""
        timeout = int(self.config.watch_timeout_s)
        params = self._params(watch="1", resourceVersion=rv, allowWatchBookmarks="true",
                              timeoutSeconds=str(timeout))
        started = time.perf_counter()
        applied = 0
        try:
            async with client.stream("GET", "/api/v1/pods", params=params, headers=self._headers(),
                                     timeout=httpx.Timeout(10.0, read=timeout + 30.0)) as resp:
                self._check(resp)
                self._healthy(started)
                async for kind, obj in self._events(resp):
                    rv = self._apply(kind, obj, rv)
                    self.status.resource_version = rv
                    applied += 1
        except httpx.HTTPError as exc:
            raise ApiError("unreachable",
                           f"watch on {client.base_url}: {type(exc).__name__}: {exc}") from None
        if applied == 0 and time.perf_counter() - started < 1.0:
            await self._backoff()  # a server that ends every watch at once must not make this spin
        return rv

    async def _events(self, resp: httpx.Response) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        buffer = bytearray()
        try:
            async for chunk in resp.aiter_raw():
                for line in split_lines(buffer, chunk, self.config.max_event_bytes):
                    yield decode_event(line)
        except httpx.HTTPError:
            if not buffer.strip():
                raise  # died between events: the API (or the way to it) went away
        if buffer.strip():  # ended or died inside an event
            raise StreamError("truncated", "the watch stream ended in the middle of an event")

    def _apply(self, kind: str, obj: dict[str, Any], rv: str) -> str:
        self._count(WATCH_EVENTS, kind)
        if kind == "ERROR":
            code = obj.get("code")
            message = str(obj.get("message") or obj.get("reason") or "")[:200]
            if code == 410:
                raise GoneError(f"watch ERROR event 410 ({message})")
            raise ApiError("error_event", f"watch ERROR event {code}: {message}")
        new_rv = resource_version(obj) or rv
        if kind == "BOOKMARK":
            return new_rv
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if not uid:
            raise StreamError("malformed", f"{kind} event for an object without metadata.uid")
        if kind == "DELETED":
            self.pods.pop(uid, None)
        else:
            self.pods[uid] = obj
        self._on_change(self.pods)
        return new_rv
