"""A Kubernetes API server for pods, faithful to what kvwatch's watch relies on.

What it does as kube-apiserver does:

- ``GET /api/v1/pods`` with ``fieldSelector=spec.nodeName=<node>`` (other selectors: 400, as the
  server refuses unsupported field selectors); bearer token checked (401 without it). The list's
  ``resourceVersion`` parameter means what it means to kube-apiserver (its "Resource versions"
  semantics, served by ``storage/cacher``): unset or ``""`` is a consistent read (the store now,
  ``list_sources`` records ``"etcd"``); ``"0"`` is "any", served from the watch cache as it stands;
  ``N`` is "not older than N", from the watch cache, which waits up to ``blockTimeout`` (3 s,
  ``cacher/watch_cache.go``) for itself to reach N and then answers ``504`` with the Status of
  ``storage.NewTooLargeResourceVersionError`` (``apiserver/pkg/storage/errors.go``): reason
  ``Timeout``, message ``Timeout: Too large resource version: N, current: M``, a cause
  ``ResourceVersionTooLarge`` and ``retryAfterSeconds: 1``. ``lag_cache(rv)`` holds the watch cache at
  an older version (an API server whose cache is behind the one that served the agent before);
  ``catch_up()`` lets it follow the store again. A list is never answered 410: without pagination a
  "not older than" list is served from the cache whatever N is.
- ``watch=1&resourceVersion=<rv>``: HTTP 200, ``Transfer-Encoding: chunked``, one JSON event per line:
  every change after ``rv`` (replayed from the event history, then live) until ``timeoutSeconds``.
  A filtered watch turns changes into what the filter sees: an object that starts matching is
  ``ADDED``, one that stops matching is ``DELETED`` (kube-apiserver's cacher does the same).
- a version older than the history kept (``compact()``): HTTP 200 and one ``ERROR`` event carrying a
  ``Status`` with ``code: 410`` and ``reason: Expired`` ("too old resource version"), then the end;
  with ``gone_as_http`` the request is answered ``410 Gone`` with the Status as body instead.
- ``allowWatchBookmarks=true``: ``BOOKMARK`` events (an object with only ``metadata.resourceVersion``)
  as the cacher sends them (``cacher/cache_watcher.go`` ``nextBookmarkTime``): every minute
  (``defaultBookmarkFrequency``, ``cacher/cacher.go``) and once more 2 s before the watch's deadline.
  ``clock_scale`` shortens every server-side duration alike (bookmark period, the 2 s, blockTimeout and
  ``timeoutSeconds`` itself), so a test can run the clock faster and keep the ratios.
- each write bumps the object's ``metadata.resourceVersion`` (a global counter, as etcd's revision).

Pods are built as the API returns them: ``Pending`` with ``PodScheduled``, then the kubelet's
updates (``Running`` with ``Ready``/``ContainersReady`` ``False``, then ``True``; a container
restart bumps ``restartCount`` and takes ``Ready`` away while it restarts); a graceful delete sets
``deletionTimestamp`` (``MODIFIED``), then removes the object (``DELETED``).

Test levers: ``break_next_event()`` writes half of the next event and cuts the connection;
``inject(line)`` sends raw bytes down every open watch; ``stop()``/``start()`` take it off and on
the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gzip
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tests.local import serve_app

BOOKMARK_FREQUENCY_S = 60.0  # cacher.go defaultBookmarkFrequency
PRETIMEOUT_BOOKMARK_S = 2.0  # cache_watcher.go: "right before the watcher timeout ... 2s before the deadline"
BLOCK_TIMEOUT_S = 3.0  # watch_cache.go blockTimeout
TOO_LARGE_RETRY_S = 1  # watch_cache.go resourceVersionTooHighRetrySeconds
# kube-apiserver's defaultGzipThresholdBytes (responsewriters/writers.go)
GZIP_THRESHOLD_BYTES = 128 * 1024


def make_pod(
    name: str,
    namespace: str = "llm",
    node: str = "node-a",
    *,
    containers: list[dict] | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod as the API returns it right after scheduling: Pending, bound to ``node``."""
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "labels": labels or {},
            "annotations": annotations or {},
            "creationTimestamp": "2026-12-01T18:00:00Z",
        },
        "spec": {"nodeName": node, "containers": containers or [{"name": "main", "image": "busybox"}]},
        "status": {
            "phase": "Pending",
            "qosClass": "Burstable",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
        },
    }


def with_managed_fields(pod: dict[str, Any], containers: int = 6) -> dict[str, Any]:
    """``pod`` with the managedFields server-side apply writes for a controller-made pod: one
    FieldsV1 entry per manager, each naming every container field it owns (about 1.5 KiB per
    container, as in a GPU operator daemonset's pods)."""
    owned = {
        f'k:{{"name":"c{i}"}}': {
            ".": {},
            "f:args": {},
            "f:env": {f'k:{{"name":"VAR_{j}"}}': {".": {}, "f:name": {}, "f:value": {}} for j in range(12)},
            "f:image": {},
            "f:imagePullPolicy": {},
            "f:name": {},
            "f:resources": {"f:limits": {}, "f:requests": {}},
            "f:securityContext": {"f:privileged": {}},
            "f:terminationMessagePath": {},
            "f:volumeMounts": {},
        }
        for i in range(containers)
    }
    pod["metadata"]["managedFields"] = [
        {
            "manager": manager,
            "operation": "Update",
            "apiVersion": "v1",
            "time": "2026-12-01T18:00:00Z",
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:spec": {"f:containers": owned}},
        }
        for manager in ("kube-controller-manager", "kubelet")
    ]
    return pod


def vllm_container(port: int = 8000, image: str = "vllm/vllm-openai:v0.11.0") -> dict[str, Any]:
    return {
        "name": "vllm",
        "image": image,
        "args": ["--model", "Qwen/Qwen3-8B", "--host", "0.0.0.0", "--port", str(port)],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
    }


def pod_conditions(ready: bool) -> list[dict[str, str]]:
    """A pod's status.conditions as the kubelet writes them, Ready or not."""
    flag = "True" if ready else "False"
    return [
        {"type": "PodReadyToStartContainers", "status": "True"},
        {"type": "Initialized", "status": "True"},
        {"type": "Ready", "status": flag},
        {"type": "ContainersReady", "status": flag},
        {"type": "PodScheduled", "status": "True"},
    ]


class FakeApiServer:
    def __init__(
        self, token: str | None = "test-token", clock_scale: float = 1.0, gone_as_http: bool = False
    ) -> None:
        self.token = token
        self.clock_scale = clock_scale
        self.gone_as_http = gone_as_http
        #: the watch cache's (version, pods) while it lags behind the store; None: it follows the store
        self._cache: tuple[int, dict[str, dict[str, Any]]] | None = None
        self.list_sources: list[str] = []  # "etcd" (consistent read) or "cache", per list answered
        self.list_times: list[float] = []  # and when (time.monotonic())
        self.watch_log: list[tuple[float, str]] = []  # (seconds since its watch began, event type)
        self.rv = 100
        self.pods: dict[str, dict[str, Any]] = {}
        #: (rv, type, object before, object after) for every write, oldest first
        self.history: list[tuple[int, str, dict | None, dict | None]] = []
        self.oldest_rv = self.rv  # watches from before this get 410
        #: a Status every watch answers at once as an ERROR event, and ends (kube-apiserver's
        #: apiserver/pkg/endpoints/handlers/watch.go writes a failed watch's Status so, after its
        #: 200); None: watches serve events
        self.failing_watches: dict[str, Any] | None = None
        self.requests: list[dict[str, str]] = []
        self.list_bytes: list[int] = []  # each list answer, before compression
        self.list_encodings: list[str] = []  # and the Content-Encoding it went out with
        self.offered_encodings: list[str] = []  # each list request's Accept-Encoding
        self._changed = asyncio.Condition()
        self._break_next = False
        self._injected: list[bytes] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._pods)
        self._runner, self.port = await serve_app(
            app, port or self.port, access_log=None, shutdown_timeout=0.1
        )
        return self.url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            async with self._changed:
                self._changed.notify_all()
            await self._runner.cleanup()
            self._runner = None

    # -- the store (what controllers and the kubelet would write) ----------------------------------
    async def _write(self, kind: str, uid: str, after: dict[str, Any] | None) -> None:
        self.rv += 1
        before = copy.deepcopy(self.pods.get(uid))
        if after is None:
            self.history.append((self.rv, kind, self.pods.pop(uid), None))
        else:
            after["metadata"]["resourceVersion"] = str(self.rv)
            self.pods[uid] = after
            self.history.append((self.rv, kind, before, copy.deepcopy(after)))
        async with self._changed:
            self._changed.notify_all()

    async def create(self, pod: dict[str, Any]) -> str:
        uid = pod["metadata"]["uid"]
        await self._write("ADDED", uid, copy.deepcopy(pod))
        return uid

    async def update(self, uid: str, change: Callable[[dict[str, Any]], None]) -> None:
        pod = copy.deepcopy(self.pods[uid])
        change(pod)
        await self._write("MODIFIED", uid, pod)

    async def run(self, uid: str, pod_ip: str) -> None:
        """The kubelet started the containers: Running, not ready yet."""

        def started(pod: dict[str, Any]) -> None:
            pod["status"].update(
                phase="Running",
                podIP=pod_ip,
                podIPs=[{"ip": pod_ip}],
                hostIP="10.0.0.1",
                conditions=pod_conditions(False),
                containerStatuses=[
                    {
                        "name": c["name"],
                        "ready": False,
                        "restartCount": 0,
                        "started": True,
                        "state": {"running": {}},
                    }
                    for c in pod["spec"]["containers"]
                ],
            )

        await self.update(uid, started)

    async def set_ready(self, uid: str, ready: bool = True) -> None:
        def flag(pod: dict[str, Any]) -> None:
            pod["status"]["conditions"] = pod_conditions(ready)
            for status in pod["status"].get("containerStatuses", []):
                status["ready"] = ready

        await self.update(uid, flag)

    async def restart_container(self, uid: str) -> None:
        """A container crashed and restarted: not ready meanwhile, restartCount + 1, same pod IP."""

        def crashed(pod: dict[str, Any]) -> None:
            pod["status"]["conditions"] = pod_conditions(False)
            for status in pod["status"].get("containerStatuses", []):
                status.update(
                    ready=False,
                    restartCount=status["restartCount"] + 1,
                    lastState={"terminated": {"exitCode": 1, "reason": "Error"}},
                )

        await self.update(uid, crashed)

    async def finish(self, uid: str, phase: str = "Succeeded") -> None:
        """Every container exited (0 for Succeeded): the kubelet reports the terminal phase; the pod
        object stays until something deletes it (a Job's pods stay for their logs)."""

        def ended(pod: dict[str, Any]) -> None:
            pod["status"]["phase"] = phase
            pod["status"]["conditions"] = pod_conditions(False)
            pod["status"]["containerStatuses"] = [
                {
                    "name": c["name"],
                    "ready": False,
                    "restartCount": 0,
                    "state": {
                        "terminated": {
                            "exitCode": 0 if phase == "Succeeded" else 1,
                            "reason": "Completed" if phase == "Succeeded" else "Error",
                        }
                    },
                }
                for c in pod["spec"]["containers"]
            ]

        await self.update(uid, ended)

    async def delete(self, uid: str) -> None:
        """Graceful delete: deletionTimestamp first (the pod is terminating), then gone."""

        def terminating(pod: dict[str, Any]) -> None:
            pod["metadata"]["deletionTimestamp"] = "2026-12-01T18:30:00Z"
            pod["metadata"]["deletionGracePeriodSeconds"] = 30

        await self.update(uid, terminating)
        await self._write("DELETED", uid, None)

    @property
    def cache_rv(self) -> int:
        return self._cache[0] if self._cache is not None else self.rv

    def lag_cache(self, rv: int) -> None:
        """Hold the watch cache at ``rv`` (older than the store, within the history kept): lists at a
        later version wait blockTimeout and get 504 "Too large resource version"."""
        pods = copy.deepcopy(self.pods)
        for version, _kind, before, after in reversed(self.history):
            if version <= rv:
                break
            uid = (after or before or {})["metadata"]["uid"]
            if before is None:
                pods.pop(uid, None)
            else:
                pods[uid] = copy.deepcopy(before)
        else:
            assert rv >= self.oldest_rv, "the history no longer reaches that version"
        self._cache = (rv, pods)

    async def catch_up(self) -> None:
        self._cache = None
        async with self._changed:
            self._changed.notify_all()

    def compact(self) -> None:
        """Forget the event history, as etcd compaction and the watch cache's window do."""
        self.history.clear()
        self.oldest_rv = self.rv

    def break_next_event(self) -> None:
        self._break_next = True

    async def inject(self, raw: bytes) -> None:
        self._injected.append(raw)
        async with self._changed:
            self._changed.notify_all()

    # -- HTTP --------------------------------------------------------------------------------------
    def _node(self, request: web.Request) -> str | None:
        selector = request.query.get("fieldSelector", "")
        if not selector.startswith("spec.nodeName="):
            return None
        return selector.split("=", 1)[1]

    @staticmethod
    def _status(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
        status = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        }
        return {**status, "details": details} if details else status

    def _too_large(self, wanted: int) -> dict[str, Any]:
        """storage.NewTooLargeResourceVersionError: apierrors.NewTimeoutError (504, reason Timeout,
        "Timeout: " + message) with one cause; a StatusCause's type is serialized as ``reason``."""
        return self._status(
            504,
            "Timeout",
            f"Timeout: Too large resource version: {wanted}, current: {self.cache_rv}",
            causes=[{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
            retryAfterSeconds=TOO_LARGE_RETRY_S,
        )

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(dict(request.query))
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(self._status(401, "Unauthorized", "Unauthorized"), status=401)
        node = self._node(request)
        if node is None:
            refused = self._status(400, "BadRequest", "unsupported field selector")
            return web.json_response(refused, status=400)
        if request.query.get("watch") in ("1", "true"):
            return await self._watch(request, node)
        wanted = request.query.get("resourceVersion", "")
        if wanted and not wanted.isdigit():
            return web.json_response(
                self._status(400, "BadRequest", f"invalid resource version: {wanted[:40]}"), status=400
            )
        if wanted == "":
            self.list_sources.append("etcd")
            version, pods = self.rv, self.pods
        else:
            if int(wanted) > self.cache_rv:  # the cache waits for itself to catch up, then gives up
                with contextlib.suppress(TimeoutError):
                    async with self._changed:
                        await asyncio.wait_for(
                            self._changed.wait_for(lambda: int(wanted) <= self.cache_rv),
                            BLOCK_TIMEOUT_S * self.clock_scale,
                        )
                if int(wanted) > self.cache_rv:
                    return web.json_response(self._too_large(int(wanted)), status=504)
            self.list_sources.append("cache")
            version, pods = self._cache if self._cache is not None else (self.rv, self.pods)
        self.list_times.append(time.monotonic())
        items = [p for p in pods.values() if p["spec"].get("nodeName") == node]
        body = json.dumps(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(version)},
                "items": items,
            }
        ).encode()
        return self._list_response(request, body)

    def _list_response(self, request: web.Request, body: bytes) -> web.Response:
        """As kube-apiserver's responsewriters/writers.go answers a list: gzip at level 1 once the body
        passes 128 KiB and the client offers exactly the token ``gzip`` (APIResponseCompression, on by
        default since 1.16), with ``Vary: Accept-Encoding``. Watches are never compressed."""
        self.offered_encodings.append(request.headers.get("Accept-Encoding", ""))
        offered = [token.strip() for token in request.headers.get("Accept-Encoding", "").split(",")]
        headers = {"Content-Type": "application/json"}
        self.list_bytes.append(len(body))
        self.list_encodings.append("identity")
        if len(body) > GZIP_THRESHOLD_BYTES and "gzip" in offered:
            body = gzip.compress(body, compresslevel=1)
            headers.update({"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
            self.list_encodings[-1] = "gzip"
        return web.Response(body=body, headers=headers)

    async def _watch(self, request: web.Request, node: str) -> web.StreamResponse:
        injected = len(self._injected)  # raw lines injected from now on reach this watch
        since = int(request.query.get("resourceVersion") or self.rv)
        timeout = float(request.query.get("timeoutSeconds") or 1800)
        bookmarks = request.query.get("allowWatchBookmarks") == "true"
        if since < self.oldest_rv:
            status = self._status(410, "Expired", f"too old resource version: {since} ({self.oldest_rv})")
            if self.gone_as_http:
                return web.json_response(status, status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        failure = status if since < self.oldest_rv else self.failing_watches
        if failure is not None:
            await response.write(json.dumps({"type": "ERROR", "object": failure}).encode() + b"\n")
            return response
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + timeout * self.clock_scale
        frequency = BOOKMARK_FREQUENCY_S * self.clock_scale
        pretimeout = deadline - PRETIMEOUT_BOOKMARK_S * self.clock_scale
        first = min(began + frequency, pretimeout)
        next_bookmark: float | None = first if first > began else None
        sent = since
        while loop.time() < deadline and self._runner is not None:
            # the watch is served from the cache: nothing past the cache's version
            for rv, _kind, before, after in [h for h in self.history if sent < h[0] <= self.cache_rv]:
                event = self._filtered(rv, before, after, node)
                sent = rv
                if event is None:
                    continue
                line = json.dumps(event).encode() + b"\n"
                if self._break_next:
                    self._break_next = False
                    await response.write(line[: len(line) // 2])
                    request.transport.close()
                    return response
                await response.write(line)
                self.watch_log.append((loop.time() - began, event["type"]))
            for raw in self._injected[injected:]:
                await response.write(raw)
            injected = len(self._injected)
            if next_bookmark is not None and loop.time() >= next_bookmark:
                if bookmarks and sent <= self.cache_rv:  # a cache behind the watcher has none to give
                    # everything up to ``sent`` has been delivered (or filtered out): resume from there
                    mark = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(sent)}}
                    await response.write(json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n")
                    self.watch_log.append((loop.time() - began, "BOOKMARK"))
                # nextBookmarkTime: a minute on, or the pre-timeout one; none once that has passed
                upcoming = min(loop.time() + frequency, pretimeout)
                next_bookmark = upcoming if upcoming > loop.time() else None
            wait = max(0.01, min(deadline, next_bookmark or deadline) - loop.time())
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), wait)
        return response

    @staticmethod
    def _filtered(rv: int, before: dict | None, after: dict | None, node: str) -> dict[str, Any] | None:
        was = before is not None and before["spec"].get("nodeName") == node
        now = after is not None and after["spec"].get("nodeName") == node
        if now and not was:
            return {"type": "ADDED", "object": after}
        if now and was:
            return {"type": "MODIFIED", "object": after}
        if was:  # deleted, or no longer matching the selector: the watcher sees it go
            gone = copy.deepcopy(after or before)
            gone["metadata"]["resourceVersion"] = str(rv)  # a DELETED event carries the deletion's rv
            return {"type": "DELETED", "object": gone}
        return None
