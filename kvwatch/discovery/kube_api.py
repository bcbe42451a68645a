"""The pods on this node, kept current through the Kubernetes API: list, then watch.

Client: plain httpx (already a dependency) speaking the watch protocol, rather than
kubernetes_asyncio (a generated client of every API group, megabytes of models, for one GET) or
lightkube (small, but its watch iterator owns the stream, so it cannot enforce a byte budget per
event). The protocol, as client-go's reflector (``tools/cache/reflector.go``) follows it:

1. ``GET /api/v1/pods?fieldSelector=spec.nodeName=<node>&resourceVersion=<v>``: the pods, and the
   list's ``resourceVersion``; the known set is replaced whole (pods deleted meanwhile drop out).
   ``v`` is the reflector's ``relistResourceVersion()``: ``"0"`` for the first list (served from the
   API server's watch cache, not a quorum read of etcd), then the last version synced (a list "at
   least as fresh as" it, also from the cache), and ``""`` (no parameter: a consistent read) only
   once a list at that version was refused as ``410 Expired`` or ``504 Too large resource version``,
   which is retried at once.
2. ``GET ...&watch=1&resourceVersion=<rv>&allowWatchBookmarks=true&timeoutSeconds=<t>``: a chunked
   stream of one JSON event per line, ``ADDED`` / ``MODIFIED`` / ``DELETED`` / ``BOOKMARK`` /
   ``ERROR``. Every event moves ``rv`` on; a bookmark only moves ``rv`` (so a quiet watch can resume
   without a relist). When the server ends the watch (``timeoutSeconds``, drawn from
   ``[watch_timeout, 2 x watch_timeout)`` as the reflector draws it, so a fleet's watches do not all
   restart together), watch again from ``rv``.
3. ``410 Gone``, as an HTTP status or as an ``ERROR`` event whose Status has ``code: 410`` (the
   version is older than the server's watch cache), or a ``504`` Status whose cause is
   ``ResourceVersionTooLarge``: list again, after a jittered wait, since a 410 reaches every agent
   at once.
4. API unreachable (connect error, timeout, 5xx, 401/403): keep the last known pods, marked stale,
   retry with exponential backoff with jitter (see ``backoff_delay``).

Every retry, whatever the cause, draws its wait from one ``Backoff``, which, as client-go's
``ExponentialBackoffManager``, forgets the failures only after two minutes without a retry, not at the
first answer: an API server (or a load balancer before it) that accepts each watch and then ends it
at once would otherwise be retried every second by every agent of the fleet, forever.

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
from kvwatch.jsonsafe import loads
from kvwatch.selfmetrics import Count, Report
from kvwatch.workers import brief_error

log = logging.getLogger(__name__)

EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")
WATCH_EVENTS = "kvwatch_discovery_watch_events"
WATCH_ERRORS = "kvwatch_discovery_watch_errors"
RELISTS = "kvwatch_discovery_relists"
BACKOFF_BASE_S = 0.8  # client-go's reflector: NewExponentialBackoffManager(800ms, 30s, 2min, ...)
BACKOFF_RESET_S = 120.0  # ... and its backoffResetDuration: that long without a retry starts over
STATUS_BYTES = 64 * 1024  # an error's Status body; the API's are a few hundred bytes
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


class TooLargeError(ApiError):
    """504 "Too large resource version": this API server's watch cache is behind the version asked
    for (another API server served it); list again with a consistent read."""

    def __init__(self, message: str) -> None:
        super().__init__("too_large_resource_version", message)


class StreamError(ApiError):
    """The watch stream broke the protocol (malformed, too_large, truncated); watch again from rv."""


def in_cluster_url(environ: Mapping[str, str]) -> str:
    """``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``, as client-go's InClusterConfig."""
    host = environ.get("KUBERNETES_SERVICE_HOST")
    port = environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ApiError(
            "config", "not in a cluster: KUBERNETES_SERVICE_HOST is not set; set discovery.kubernetes.api_url"
        )
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
        event = loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StreamError("malformed", f"watch event is not JSON: {exc}") from None
    if (
        not isinstance(event, dict)
        or event.get("type") not in EVENT_TYPES
        or not isinstance(event.get("object"), dict)
    ):
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


def status_error(status: Mapping[str, Any], http_code: int) -> ApiError:
    """The error an API ``Status`` (an error response's body, or an ``ERROR`` event's object) means.

    As client-go's reflector tells them apart: ``isExpiredError`` (code 410, reason ``Expired`` or
    ``Gone``) and ``isTooLargeResourceVersionError`` (a cause ``ResourceVersionTooLarge``; before
    Kubernetes 1.18.6 only the text "Too large resource version" in a cause or the message of a 504).
    """
    code = status.get("code") if isinstance(status.get("code"), int) else http_code
    message = str(status.get("message") or status.get("reason") or "")[:200]
    details = status.get("details")
    found = details.get("causes") if isinstance(details, Mapping) else None
    causes = [c for c in found if isinstance(c, Mapping)] if isinstance(found, list) else []
    if code == 410 or status.get("reason") in ("Expired", "Gone"):
        return GoneError(f"410 {status.get('reason') or 'Gone'} ({message})")
    if any(c.get("reason") == "ResourceVersionTooLarge" for c in causes) or (
        code == 504
        and (
            any(c.get("message") == "Too large resource version" for c in causes)
            or "Too large resource version" in message
        )
    ):
        return TooLargeError(f"504 ({message})")
    if code in (401, 403):
        return ApiError(
            "http_status",
            f"HTTP {code} from the API server: the service account needs "
            f"{' and '.join(POD_VERBS)} on pods (ClusterRole kvwatch-pod-reader)",
        )
    return ApiError("http_status", f"HTTP {code} from the API server ({message})")


def backoff_delay(failures: int, cap_s: float) -> float:
    """The wait before retry number ``failures`` (1, 2, ...): client-go's reflector waits
    ``[d, 2d)`` for d from 0.8 s doubling (jitter factor 1.0); here d stops at ``cap_s / 2``, so
    that ``backoff_max`` stays the longest wait and agents that failed together spread out."""
    step = min(cap_s / 2.0, BACKOFF_BASE_S * 2.0 ** max(failures - 1, 0))
    return random.uniform(step, 2.0 * step)


class Backoff:
    """The waits of one watch loop: ``backoff_delay`` for the retries counted since the last stretch
    of ``BACKOFF_RESET_S`` without one (client-go's ``exponentialBackoffManagerImpl``), so a loop
    that fails right after each success still backs off further every time."""

    def __init__(self, cap_s: float, reset_s: float = BACKOFF_RESET_S) -> None:
        self.cap_s = cap_s
        self.reset_s = reset_s
        self.failures = 0
        self._last: float | None = None

    def next_wait(self, now: float) -> float:
        """The wait before the retry that starts at ``now`` (monotonic seconds)."""
        if self._last is None or now - self._last > self.reset_s:
            self.failures = 0
        self._last = now
        self.failures += 1
        return backoff_delay(self.failures, self.cap_s)


def _metadata(obj: Any, key: str) -> str | None:
    """``metadata.<key>`` of an API object: a non-empty string, as the API server writes it, else None."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    value = meta.get(key) if isinstance(meta, Mapping) else None
    return value if isinstance(value, str) and value else None


def resource_version(obj: Mapping[str, Any]) -> str | None:
    return _metadata(obj, "resourceVersion")


def _uid(obj: Any) -> str | None:
    return _metadata(obj, "uid")


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

    def __init__(
        self,
        config: KubernetesDiscoveryConfig,
        node: str,
        on_change: Callable[[Pods], None],
        count: Count,
        report: Report,
        environ: Mapping[str, str] | None = None,
        sleep: Callable[[float], Any] = asyncio.sleep,
        on_stale: Callable[[bool], None] = lambda stale: None,
    ) -> None:
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
        self._backoff_waits = Backoff(config.backoff_max_s)
        #: client-go's isLastSyncResourceVersionUnavailable: the last version was refused (410/504)
        self._version_unavailable = False

    # -- the loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        base = self.config.api_url or in_cluster_url(self._environ)
        async with httpx.AsyncClient(
            base_url=base,
            verify=self._verify(base),
            follow_redirects=False,
            timeout=httpx.Timeout(10.0, read=30.0),
        ) as client:
            rv: str | None = None
            while True:
                try:
                    if rv is None:
                        rv = await self._list(client)
                    rv = await self._watch(client, rv)
                except (GoneError, TooLargeError) as exc:
                    # a 410 on a watch: list at the last synced version (the watch cache has it: a
                    # list is "at least as fresh as" its version); a 504: that version is not there
                    self._version_unavailable = isinstance(exc, TooLargeError)
                    self._count(RELISTS)
                    self._count(WATCH_ERRORS, exc.reason)
                    log.info("kubernetes: watch: %s; listing pods again", exc)
                    rv = None
                    await self._backoff()  # every agent got it at the same moment: spread the relists
                except StreamError as exc:
                    rv = self.status.resource_version  # the last event applied
                    self._count(WATCH_ERRORS, exc.reason)
                    log.warning("kubernetes: %s; watching again from resourceVersion %s", exc, rv)
                    await self._backoff()
                except ApiError as exc:
                    rv = self.status.resource_version if self.status.synced else None
                    self._failed(exc)
                    await self._backoff()
                except Exception as exc:  # reading what the API sent failed (a bug): never end discovery
                    log.debug("kubernetes: reading the API's answer failed", exc_info=True)
                    rv = None  # list again: what was read last cannot be trusted
                    self._failed(ApiError("internal", f"reading the API's answer failed: {brief_error(exc)}"))
                    await self._backoff()

    def _verify(self, base: str) -> ssl.SSLContext | bool:
        """TLS as configured: ``ca_file`` when set (it must exist), the system's CAs when it is null."""
        if not base.startswith("https://"):
            return False
        ca = self.config.ca_file
        if not ca:
            return ssl.create_default_context()
        try:
            return ssl.create_default_context(cafile=ca)
        except (OSError, ssl.SSLError) as exc:
            detail = "does not exist" if not Path(ca).exists() else f"cannot be read as PEM ({exc})"
            raise ApiError(
                "config",
                f"discovery.kubernetes.ca_file {ca!r} {detail}; mount the API "
                "server's CA there, or set ca_file: null to trust the system's "
                "CAs",
            ) from None

    def _headers(self) -> dict[str, str]:
        """A fresh read of the token each request: projected service account tokens rotate."""
        # the one encoding _decoded_body inflates (httpx offers deflate and br too)
        headers = {"Accept": "application/json", "Accept-Encoding": "gzip", "User-Agent": "kvwatch"}
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
        await self._sleep(self._backoff_waits.next_wait(time.monotonic()))

    def _list_version(self) -> str:
        """client-go's ``relistResourceVersion()``: "" (consistent read) once the version was refused,
        "0" (any, from the watch cache) before the first sync, else the last version synced."""
        if self._version_unavailable:
            return ""
        return self.status.resource_version or "0"

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
        self._report(COLLECTOR, True, time.perf_counter() - started)

    # -- list --------------------------------------------------------------------------------------
    async def _list(self, client: httpx.AsyncClient) -> str:
        started = time.perf_counter()
        version = self._list_version()
        try:
            body = await self._get_list(client, version)
        except (GoneError, TooLargeError) as exc:
            if version == "":
                raise ApiError(exc.reason, f"a consistent list was refused: {exc}") from None
            # as the reflector's list(): retry at once with a consistent read
            self._version_unavailable = True
            self._count(RELISTS)
            self._count(WATCH_ERRORS, exc.reason)
            log.info(
                "kubernetes: list at resourceVersion %s: %s; listing with a consistent read", version, exc
            )
            body = await self._get_list(client, "")
        self._version_unavailable = False
        try:
            # a node's pods are ~10 KiB each; a large list decodes off the event loop (the proxy runs there)
            small = len(body) < OFF_LOOP_BYTES
            data = loads(body) if small else await asyncio.to_thread(loads, body)
            items = data["items"] if isinstance(data.get("items"), list) else []
            rv = str(data["metadata"]["resourceVersion"])
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ApiError("malformed", "pod list is not a PodList with metadata.resourceVersion") from None
        pods: Pods = {}
        for item in items:  # an item that is no pod object is skipped, as a malformed watch event is
            uid = _uid(item)
            if uid is not None:
                pods[uid] = item
        self.pods = pods
        self.status.synced = True
        self.status.resource_version = rv
        self._healthy(started)
        self._on_change(self.pods)
        return rv

    async def _get_list(self, client: httpx.AsyncClient, version: str) -> bytes:
        """The list body; ``version`` "" sends no resourceVersion, as client-go does for ""."""
        params = self._params(resourceVersion=version) if version else self._params()
        try:
            async with client.stream("GET", "/api/v1/pods", params=params, headers=self._headers()) as resp:
                await self._check(resp)
                return await _decoded_body(resp, self.config.max_list_bytes)
        except httpx.HTTPError as exc:
            raise ApiError(
                "unreachable", f"API server {client.base_url}: {type(exc).__name__}: {exc}"
            ) from None

    @staticmethod
    async def _check(resp: httpx.Response) -> None:
        """Raise what a refusal means, read from its Status body (bounded)."""
        if resp.status_code == 200:
            return
        try:
            status = loads(await _decoded_body(resp, STATUS_BYTES))
        except (ApiError, ValueError, UnicodeDecodeError):
            status = None
        raise status_error(status if isinstance(status, dict) else {}, resp.status_code)

    # -- watch -------------------------------------------------------------------------------------
    async def _watch(self, client: httpx.AsyncClient, rv: str) -> str:
        """Apply events until the server ends the watch; return the resourceVersion to resume from."""
        timeout = int(self.config.watch_timeout_s * random.uniform(1.0, 2.0))  # as the reflector does
        params = self._params(
            watch="1", resourceVersion=rv, allowWatchBookmarks="true", timeoutSeconds=str(timeout)
        )
        started = time.perf_counter()
        applied = 0
        try:
            async with client.stream(
                "GET",
                "/api/v1/pods",
                params=params,
                headers=self._headers(),
                timeout=httpx.Timeout(10.0, read=timeout + 30.0),
            ) as resp:
                await self._check(resp)
                self._healthy(started)
                async for kind, obj in self._events(resp):
                    rv = self._apply(kind, obj, rv)
                    self.status.resource_version = rv
                    applied += 1
        except httpx.HTTPError as exc:
            raise ApiError(
                "unreachable", f"watch on {client.base_url}: {type(exc).__name__}: {exc}"
            ) from None
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
            error = status_error(obj, 0)
            if isinstance(error, GoneError | TooLargeError):
                raise error
            message = str(obj.get("message") or obj.get("reason") or "")[:200]
            raise ApiError("error_event", f"watch ERROR event {obj.get('code')}: {message}")
        new_rv = resource_version(obj) or rv
        if kind == "BOOKMARK":
            return new_rv
        uid = _uid(obj)
        if uid is None:
            raise StreamError("malformed", f"{kind} event for an object without metadata.uid")
        if kind == "DELETED":
            self.pods.pop(uid, None)
        else:
            self.pods[uid] = obj
        self._on_change(self.pods)
        return new_rv
