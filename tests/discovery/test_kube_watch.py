"""The pod list/watch protocol against a fake API server with kube-apiserver's semantics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter

import httpx
import pytest
from aiohttp import web

from kvwatch.config import KubernetesDiscoveryConfig
from kvwatch.discovery.kube_api import (
    BACKOFF_BASE_S,
    BACKOFF_RESET_S,
    ApiError,
    Backoff,
    GoneError,
    PodWatch,
    StreamError,
    TooLargeError,
    backoff_delay,
    decode_event,
    in_cluster_url,
    split_lines,
    status_error,
)
from tests.discovery.fake_apiserver import (
    GZIP_THRESHOLD_BYTES,
    FakeApiServer,
    make_pod,
    vllm_container,
    with_managed_fields,
)
from tests.local import free_port, serving, until


class Sinks:
    def __init__(self) -> None:
        self.counts: Counter[tuple[str, ...]] = Counter()
        self.reports: list[tuple[str, bool]] = []
        self.snapshots: list[set[str]] = []

    def count(self, family: str, *labels: str, amount: float = 1) -> None:
        self.counts[(family, *labels)] += amount

    def report(self, collector: str, success: bool, *_args, **_kw) -> None:
        self.reports.append((collector, success))

    def on_change(self, pods) -> None:
        self.snapshots.append({p["metadata"]["name"] for p in pods.values()})


@contextlib.asynccontextmanager
async def watching(server: FakeApiServer, tmp_path, url: str | None = None, **overrides):
    token = tmp_path / "token"
    token.write_text("test-token\n")
    settings = dict(
        enabled=True,
        api_url=url or server.url,
        token_file=str(token),
        ca_file=None,
        watch_timeout_s=2.0,
        backoff_max_s=0.3,
    )
    settings.update(overrides)
    sinks = Sinks()
    watch = PodWatch(
        KubernetesDiscoveryConfig(**settings), "node-a", sinks.on_change, sinks.count, sinks.report
    )
    task = asyncio.create_task(watch.run())
    try:
        yield watch, sinks
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def names(watch: PodWatch) -> set[str]:
    return {p["metadata"]["name"] for p in watch.pods.values()}


async def test_list_then_watch_from_the_lists_resource_version_with_bookmarks(tmp_path):
    server = FakeApiServer(clock_scale=0.01)  # bookmarks every 0.6 s, watches of 3 to 6 s
    await server.start()
    await server.create(make_pod("before", containers=[vllm_container()]))
    await server.create(make_pod("elsewhere", node="node-b"))
    try:
        async with watching(server, tmp_path, watch_timeout_s=300.0) as (watch, sinks):
            await until(lambda: watch.status.synced)
            assert names(watch) == {"before"}  # the field selector keeps other nodes' pods out
            # the first list is resourceVersion=0, served from the watch cache, not a quorum read of etcd
            assert server.requests[0] == {"fieldSelector": "spec.nodeName=node-a", "resourceVersion": "0"}
            assert server.list_sources == ["cache"]
            uid = await server.create(make_pod("after"))
            await server.run(uid, "10.1.0.7")
            await until(lambda: watch.pods.get(uid, {}).get("status", {}).get("phase") == "Running")
            assert names(watch) == {"before", "after"}
            watch_request = server.requests[1]
            assert watch_request["watch"] == "1" and watch_request["allowWatchBookmarks"] == "true"
            assert watch_request["resourceVersion"] == "102"  # the list's version, not a fresh one
            await server.create(make_pod("other-node", node="node-b"))  # filtered out, still moves rv
            await until(
                lambda: (
                    sinks.counts[("kvwatch_discovery_watch_events", "BOOKMARK")] >= 1
                    and watch.status.resource_version == str(server.rv)
                )
            )
            assert sinks.counts[("kvwatch_discovery_relists",)] == 0
    finally:
        await server.stop()


async def test_a_watch_the_server_ends_resumes_without_a_relist(tmp_path):
    server = FakeApiServer()
    await server.start()
    try:
        async with watching(server, tmp_path, watch_timeout_s=1.0) as (watch, _sinks):
            await until(lambda: watch.status.synced)
            # the first watch ended by timeoutSeconds, the next one running
            await until(
                lambda: sum("watch" in r for r in server.requests) >= 2,
                what="a second watch once the first one's timeoutSeconds ran out",
            )
            await server.create(make_pod("late"))
            await until(lambda: names(watch) == {"late"})
            lists = [r for r in server.requests if "watch" not in r]
            assert len(lists) == 1
            assert len(server.requests) >= 3
    finally:
        await server.stop()


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event-410", "http-410"])
async def test_410_gone_relists_and_drops_pods_deleted_meanwhile(tmp_path, gone_as_http):
    port = free_port()
    server = FakeApiServer(gone_as_http=gone_as_http)
    await server.start(port)
    keep = await server.create(make_pod("keep"))
    lost = await server.create(make_pod("lost"))
    try:
        async with watching(server, tmp_path) as (watch, sinks):
            await until(lambda: names(watch) == {"keep", "lost"})
            await server.stop()  # the agent loses the API, and meanwhile
            await until(lambda: watch.status.stale)
            await server.delete(lost)  # a pod goes, and the history is compacted past the agent's rv
            await server.update(keep, lambda p: p["metadata"]["labels"].update(v="2"))
            server.compact()
            assert names(watch) == {"keep", "lost"}  # kept while unreachable, marked stale
            await server.start(port)
            await until(lambda: names(watch) == {"keep"} and not watch.status.stale)
            assert watch.pods[keep]["metadata"]["labels"] == {"v": "2"}
            # the relist asks for the last version synced (the watch cache serves it, "at least as
            # fresh"), not a consistent read of etcd
            lists = [r.get("resourceVersion") for r in server.requests if "watch" not in r]
            assert lists == ["0", "102"] and server.list_sources == ["cache", "cache"]
            assert sinks.counts[("kvwatch_discovery_relists",)] == 1
            assert sinks.counts[("kvwatch_discovery_watch_errors", "gone")] == 1
            assert sinks.counts[("kvwatch_discovery_watch_errors", "unreachable")] >= 1
            if not gone_as_http:
                assert sinks.counts[("kvwatch_discovery_watch_events", "ERROR")] == 1
    finally:
        await server.stop()


async def test_a_stream_broken_mid_event_loses_nothing(tmp_path):
    server = FakeApiServer()
    await server.start()
    uid = await server.create(make_pod("p"))
    try:
        async with watching(server, tmp_path) as (watch, sinks):
            await until(lambda: watch.status.synced)
            server.break_next_event()
            await server.run(uid, "10.1.0.9")  # this event arrives half written, then the connection dies
            await until(lambda: watch.pods[uid]["status"].get("podIP") == "10.1.0.9")
            assert sinks.counts[("kvwatch_discovery_watch_errors", "truncated")] == 1
            assert sinks.counts[("kvwatch_discovery_relists",)] == 0
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"type": "ADDED", "object": {"metadata": \n', "malformed"),
        (b'{"type": "UPSERTED", "object": {}}\n', "malformed"),
        (b"[1, 2, 3]\n", "malformed"),
        (b'{"type": "ADDED", "object": {"metadata": {"name": "' + b"x" * 5000 + b'"}}}\n', "too_large"),
    ],
)
async def test_a_malformed_or_oversized_event_is_counted_and_the_watch_goes_on(tmp_path, raw, reason):
    server = FakeApiServer()
    await server.start()
    try:
        async with watching(server, tmp_path, max_event_bytes=4096) as (watch, sinks):
            await until(lambda: any(r.get("watch") for r in server.requests))  # a watch is open
            await server.inject(raw)
            await until(lambda: sinks.counts[("kvwatch_discovery_watch_errors", reason)] >= 1)
            server._injected.clear()
            await server.create(make_pod("after"))
            await until(lambda: names(watch) == {"after"})
    finally:
        await server.stop()


async def test_list_items_that_are_no_pod_objects_are_skipped_and_the_watch_goes_on(tmp_path):
    """An item whose metadata is not an object (or whose uid is not a string) raised AttributeError out
    of the list, which no handler of the watch loop caught: discovery stopped for good (the agent
    logged "kubernetes discovery stopped" once and showed the collector failed)."""
    good = make_pod("good", containers=[vllm_container(8100)])
    good["metadata"]["uid"] = "uid-good"
    items = [good, {"metadata": [1]}, 5, {"metadata": {"uid": 10**50}}, {"metadata": None}]
    lists, watches = [], []

    async def pods(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") in ("1", "true"):
            watches.append(request.query.get("resourceVersion"))
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await asyncio.sleep(1.0)  # a watch with no events, ended by the server
            return response
        lists.append(time.monotonic())
        return web.json_response({"kind": "PodList", "metadata": {"resourceVersion": "7"}, "items": items})

    app = web.Application()
    app.router.add_get("/api/v1/pods", pods)
    async with serving(app) as url, watching(FakeApiServer(), tmp_path, url=url) as (watch, sinks):
        await until(lambda: watch.status.synced)
        assert names(watch) == {"good"} and sinks.snapshots[-1] == {"good"}
        await until(lambda: len(watches) >= 2)  # the watch ended and was opened again: the task lives
        assert len(lists) == 1 and watches[:2] == ["7", "7"]


async def test_an_unexpected_error_reading_the_api_is_counted_and_lists_again(tmp_path, monkeypatch):
    """The last handler of the watch loop: whatever reading an answer raises (a bug) is an ``internal``
    watch error and a relist, never the end of discovery."""
    from kvwatch.discovery import kube_api

    real, calls = kube_api._uid, []

    def fails_once(obj):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a reader bug")
        return real(obj)

    monkeypatch.setattr(kube_api, "_uid", fails_once)
    server = FakeApiServer()
    await server.start()
    try:
        await server.create(make_pod("p"))
        async with watching(server, tmp_path) as (watch, sinks):
            await until(lambda: names(watch) == {"p"})
            assert sinks.counts[("kvwatch_discovery_watch_errors", "internal")] == 1
            await server.create(make_pod("q"))  # and the watch after the relist works
            await until(lambda: names(watch) == {"p", "q"})
    finally:
        await server.stop()


async def test_the_api_down_at_start_is_stale_with_backoff_until_it_answers(tmp_path):
    port = free_port()
    server = FakeApiServer()
    await server.create(make_pod("p"))
    async with watching(server, tmp_path, url=f"http://127.0.0.1:{port}") as (watch, sinks):
        await until(lambda: sinks.counts[("kvwatch_discovery_watch_errors", "unreachable")] >= 2)
        assert watch.status.stale and not watch.status.synced and watch.pods == {}
        await asyncio.sleep(1.0)
        assert sinks.counts[("kvwatch_discovery_watch_errors", "unreachable")] < 12  # backoff, no spin
        await server.start(port)
        try:
            await until(lambda: names(watch) == {"p"} and not watch.status.stale)
            assert ("kubernetes", False) in sinks.reports and sinks.reports[-1] == ("kubernetes", True)
        finally:
            await server.stop()


async def test_a_missing_token_is_an_http_status_error_naming_the_rbac(tmp_path, caplog):
    server = FakeApiServer(token="other")
    await server.start()
    try:
        async with watching(server, tmp_path) as (watch, sinks):
            await until(lambda: sinks.counts[("kvwatch_discovery_watch_errors", "http_status")] >= 1)
            assert watch.status.stale
            assert "list and watch on pods" in (watch.status.last_error or "")
    finally:
        await server.stop()


def test_split_lines_is_bounded_and_keeps_partial_lines():
    buffer = bytearray()
    assert split_lines(buffer, b'{"a": 1}\n{"b"', 64) == [b'{"a": 1}']
    assert bytes(buffer) == b'{"b"'
    assert split_lines(buffer, b": 2}\n\n", 64) == [b'{"b": 2}']
    with pytest.raises(StreamError):
        split_lines(bytearray(), b"x" * 65, 64)
    with pytest.raises(StreamError):
        decode_event(b'{"type": "ADDED", "object": []}')


def test_the_in_cluster_address_is_the_one_the_kubelet_injects():
    assert (
        in_cluster_url({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
        == "https://10.96.0.1:443"
    )
    assert in_cluster_url({"KUBERNETES_SERVICE_HOST": "fd00::1"}) == "https://[fd00::1]:443"
    with pytest.raises(ApiError, match="KUBERNETES_SERVICE_HOST is not set"):
        in_cluster_url({})


async def test_a_list_over_128_kib_comes_gzipped_and_syncs(tmp_path):
    """kube-apiserver gzips a list past 128 KiB when the client offers gzip (httpx does): read raw,
    the compressed bytes were taken for JSON and the watch never synced."""
    server = FakeApiServer()
    await server.start()
    for i in range(30):
        await server.create(with_managed_fields(make_pod(f"operator-{i}", containers=[vllm_container()])))
    try:
        async with watching(server, tmp_path) as (watch, sinks):
            await until(lambda: watch.status.synced)
            assert server.list_bytes[-1] > GZIP_THRESHOLD_BYTES  # the case under test
            assert server.list_encodings[-1] == "gzip"
            # only what it inflates: a proxy in front of the API could answer deflate or br otherwise
            assert set(server.offered_encodings) == {"gzip"}
            assert len(names(watch)) == 30
            assert sinks.counts[("kvwatch_discovery_relists",)] == 0
    finally:
        await server.stop()


async def test_a_gzipped_list_is_bounded_by_its_decoded_size(tmp_path):
    """max_list_bytes counts what the body inflates to: a list that compresses 50x past the budget is
    too_large, not read whole into memory."""
    server = FakeApiServer()
    await server.start()
    for i in range(30):
        await server.create(with_managed_fields(make_pod(f"operator-{i}")))
    try:
        async with watching(server, tmp_path, max_list_bytes=64 * 1024) as (watch, _sinks):
            await until(lambda: "max_list_bytes" in (watch.status.last_error or ""))
            assert "decoded" in (watch.status.last_error or "")
            assert not watch.status.synced
            assert server.list_encodings[-1] == "gzip"
    finally:
        await server.stop()


async def test_a_version_this_api_servers_cache_has_not_reached_relists_with_a_consistent_read(tmp_path):
    """After a 410 the reflector lists at its last version; an API server whose watch cache is behind
    that answers 504 "Too large resource version" after blockTimeout, and the list is retried at once
    with resourceVersion "" (a consistent read), as client-go's Reflector.list does."""
    port = free_port()
    server = FakeApiServer(clock_scale=0.1)  # blockTimeout 0.3 s
    await server.start(port)
    keep = await server.create(make_pod("keep"))
    lost = await server.create(make_pod("lost"))
    try:
        async with watching(server, tmp_path, watch_timeout_s=60.0) as (watch, sinks):
            await until(lambda: names(watch) == {"keep", "lost"})
            synced = int(watch.status.resource_version or 0)
            await server.stop()
            await until(lambda: watch.status.stale)
            await server.delete(lost)
            server.lag_cache(synced - 1)  # the server it reaches next has a cache one version behind it
            server.compact()  # and its history does not reach the agent's version: 410
            await server.start(port)
            await until(lambda: names(watch) == {"keep"} and not watch.status.stale)
            lists = [r.get("resourceVersion") for r in server.requests if "watch" not in r]
            assert lists == ["0", str(synced), None]  # None: no parameter, i.e. ""
            assert server.list_sources == ["cache", "etcd"]  # the 504 was no list
            assert watch.status.resource_version == str(server.rv)
            assert sinks.counts[("kvwatch_discovery_watch_errors", "gone")] == 1
            assert sinks.counts[("kvwatch_discovery_watch_errors", "too_large_resource_version")] == 1
            assert sinks.counts[("kvwatch_discovery_relists",)] == 2
            await server.catch_up()  # the watch from the new version waits for the cache, then goes on
            await server.update(keep, lambda p: p["metadata"]["labels"].update(v="3"))
            await until(lambda: watch.pods[keep]["metadata"]["labels"] == {"v": "3"})
            # the next list (after a later 410) is at the last version again, not another consistent read
            assert not watch._version_unavailable
    finally:
        await server.stop()


async def test_a_too_large_error_event_on_the_watch_relists_with_a_consistent_read(tmp_path):
    server = FakeApiServer()
    await server.start()
    await server.create(make_pod("p"))
    try:
        async with watching(server, tmp_path) as (watch, sinks):
            await until(lambda: any(r.get("watch") for r in server.requests))
            status = server._too_large(int(watch.status.resource_version or 0) + 5)
            await server.inject(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            await until(lambda: len(server.list_sources) == 2)
            server._injected.clear()
            assert server.list_sources == ["cache", "etcd"]
            assert sinks.counts[("kvwatch_discovery_watch_errors", "too_large_resource_version")] == 1
            assert sinks.counts[("kvwatch_discovery_watch_errors", "error_event")] == 0
    finally:
        await server.stop()


async def test_a_410_sent_to_every_agent_at_once_spreads_their_relists(tmp_path):
    """The cacher ends every watch that fell out of its window together; had each agent relisted at
    once, the API server would take them all in the same instant. The relist waits client-go's first
    backoff step with its jitter: [0.8 s, 1.6 s), capped by backoff_max."""
    server = FakeApiServer()
    await server.start()
    await server.create(make_pod("p"))
    agents = 6
    try:
        async with contextlib.AsyncExitStack() as stack:
            watches = [
                await stack.enter_async_context(watching(server, tmp_path, backoff_max_s=30.0))
                for _ in range(agents)
            ]
            await until(lambda: sum(1 for r in server.requests if r.get("watch")) >= agents)
            listed = len(server.list_sources)
            gone = server._status(410, "Expired", "too old resource version: 1 (2)")
            sent = time.monotonic()
            await server.inject(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            await until(lambda: len(server.list_sources) >= listed + agents, timeout_s=10)
            server._injected.clear()
            relisted = [t - sent for t in server.list_times[listed:]]
            assert min(relisted) >= BACKOFF_BASE_S * 0.9, relisted  # none at once
            assert max(relisted) - min(relisted) >= 0.1, relisted  # and not all together
            for watch, sinks in watches:
                assert sinks.counts[("kvwatch_discovery_relists",)] == 1
                assert watch.status.synced and not watch.status.stale
    finally:
        await server.stop()


async def test_a_configured_ca_file_that_is_missing_is_an_error_naming_the_key(tmp_path):
    """Once the system's CAs were used silently instead: with a private cluster CA that fails every
    handshake, logged as "unreachable", with nothing naming the file."""
    server = FakeApiServer()
    await server.start()
    missing = tmp_path / "ca.crt"
    config = KubernetesDiscoveryConfig(
        enabled=True, api_url=f"https://127.0.0.1:{server.port}", ca_file=str(missing), backoff_max_s=0.3
    )
    sinks = Sinks()

    def agent() -> PodWatch:
        return PodWatch(config, "node-a", sinks.on_change, sinks.count, sinks.report)

    try:
        with pytest.raises(ApiError, match=r"discovery\.kubernetes\.ca_file '.*ca\.crt' does not exist"):
            await asyncio.wait_for(agent().run(), 5)
        missing.write_text("not a certificate\n")
        with pytest.raises(ApiError, match="cannot be read as PEM"):
            await asyncio.wait_for(agent().run(), 5)
        assert not server.requests and not sinks.counts  # nothing sent, nothing counted as unreachable
    finally:
        await server.stop()


async def test_the_fake_sends_bookmarks_every_minute_and_two_seconds_before_the_deadline(tmp_path):
    """cacher.go's defaultBookmarkFrequency (1 min) and cache_watcher.go's pre-timeout bookmark, on a
    clock 25 times faster: timeoutSeconds=100 is 4 s, a bookmark at 2.4 s (60 s) and 3.92 s (98 s)."""
    server = FakeApiServer(clock_scale=0.04)
    await server.start()
    await server.create(make_pod("p"))
    try:
        async with httpx.AsyncClient(base_url=server.url) as client:
            params = {
                "fieldSelector": "spec.nodeName=node-a",
                "watch": "1",
                "resourceVersion": str(server.rv),
                "allowWatchBookmarks": "true",
                "timeoutSeconds": "100",
            }
            started = time.monotonic()
            response = await client.get(
                "/api/v1/pods", params=params, headers={"Authorization": "Bearer test-token"}, timeout=10
            )
            ended = time.monotonic() - started
        events = [json.loads(line) for line in response.text.splitlines()]
        assert [e["type"] for e in events] == ["BOOKMARK"] * 2
        times = [t for t, kind in server.watch_log if kind == "BOOKMARK"]
        assert times == pytest.approx([2.4, 3.92], abs=0.3)  # loose: the machine may be busy
        assert ended == pytest.approx(4.0, abs=0.5)
    finally:
        await server.stop()


async def test_a_watch_resumes_from_the_pre_timeout_bookmark_past_other_nodes_writes(tmp_path):
    server = FakeApiServer(clock_scale=0.01)
    await server.start()
    try:
        async with watching(server, tmp_path, watch_timeout_s=200.0) as (_watch, sinks):
            await until(lambda: any(r.get("watch") for r in server.requests))
            for i in range(3):
                await server.create(make_pod(f"elsewhere-{i}", node="node-b"))  # filtered out here
            await until(lambda: sum(1 for r in server.requests if r.get("watch")) >= 2, timeout_s=10)
            rewatch = [r for r in server.requests if r.get("watch")][1]
            assert rewatch["resourceVersion"] == str(server.rv)  # not the list's version: no replay
            assert sinks.counts[("kvwatch_discovery_watch_events", "BOOKMARK")] >= 1
    finally:
        await server.stop()


def test_a_504_status_is_told_apart_as_client_go_does():
    wanted = FakeApiServer()._too_large(105)
    assert wanted["message"].startswith("Timeout: Too large resource version: 105, current: 100")
    assert isinstance(status_error(wanted, 504), TooLargeError)
    # Kubernetes 1.17.0-1.18.5: no cause type, only the cause message; before 1.17: only the message
    legacy = {
        "code": 504,
        "reason": "Timeout",
        "details": {"causes": [{"message": "Too large resource version"}]},
    }
    assert isinstance(status_error(legacy, 504), TooLargeError)
    assert isinstance(
        status_error({"code": 504, "message": "Timeout: Too large resource version: 9"}, 504), TooLargeError
    )
    plain = status_error(
        {"code": 504, "reason": "Timeout", "message": "Timeout: request did not complete"}, 504
    )
    assert not isinstance(plain, TooLargeError) and plain.reason == "http_status"
    assert isinstance(status_error({"code": 410, "reason": "Expired"}, 0), GoneError)
    assert isinstance(status_error({}, 410), GoneError)


def test_backoff_is_client_gos_with_its_jitter_and_never_past_the_cap():
    for failures in range(1, 12):
        step = min(15.0, BACKOFF_BASE_S * 2 ** (failures - 1))
        waits = [backoff_delay(failures, 30.0) for _ in range(200)]
        assert all(step <= w < 2 * step for w in waits) and max(waits) <= 30.0
        assert max(waits) - min(waits) > step / 2  # spread, not a fixed delay


def test_the_backoff_forgets_failures_only_after_two_minutes_without_a_retry():
    """client-go's ExponentialBackoffManager(800ms, 30s, 2min): the step doubles while retries come
    within two minutes of each other, whatever answered between them, and starts over after that."""
    backoff = Backoff(cap_s=30.0)
    now = 1000.0
    steps = []
    for _ in range(7):
        now += backoff.next_wait(now)  # each retry as soon as its wait is over
        steps.append(backoff.failures)
    assert steps == [1, 2, 3, 4, 5, 6, 7]
    assert backoff.next_wait(now + 5.0) >= 15.0  # the step stopped at the cap's half: [15 s, 30 s)
    assert backoff.next_wait(now + 5.0 + BACKOFF_RESET_S + 1.0) < 2 * BACKOFF_BASE_S  # a quiet spell
    assert backoff.failures == 1


async def test_an_api_that_accepts_each_watch_and_fails_it_at_once_is_retried_ever_more_slowly(tmp_path):
    """Each watch answers 200, then an ERROR event. The 200 once reset the failure count, so every
    agent of a fleet retried such an API server every 0.8 to 1.6 s, forever; as client-go's reflector,
    the waits now double up to backoff_max."""
    server = FakeApiServer()
    await server.start()
    server.failing_watches = server._status(500, "InternalError", "Internal error occurred: watch chan error")
    token = tmp_path / "token"
    token.write_text("test-token\n")
    config = KubernetesDiscoveryConfig(
        enabled=True, api_url=server.url, token_file=str(token), ca_file=None, backoff_max_s=30.0
    )
    waits: list[float] = []

    async def no_wait(seconds: float) -> None:  # the waits are recorded, not slept
        waits.append(seconds)
        await asyncio.sleep(0)

    sinks = Sinks()
    watch = PodWatch(config, "node-a", sinks.on_change, sinks.count, sinks.report, sleep=no_wait)
    task = asyncio.create_task(watch.run())
    try:
        await until(lambda: len(waits) >= 7)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.stop()
    assert sinks.counts[("kvwatch_discovery_watch_errors", "error_event")] >= 7
    for n, wait in enumerate(waits[:7], start=1):  # [0.8, 1.6), [1.6, 3.2), ..., then [15, 30)
        step = min(15.0, BACKOFF_BASE_S * 2 ** (n - 1))
        assert step <= wait < 2 * step, waits


async def test_each_watch_asks_for_a_timeout_drawn_from_t_to_2t(tmp_path):
    """client-go's reflector: timeoutSeconds = minWatchTimeout * (rand + 1), so a fleet's watches,
    started together, do not all end and restart together."""
    server = FakeApiServer(clock_scale=0.002)  # 300 s of the agent's clock is 0.6 s here
    await server.start()
    try:
        async with watching(server, tmp_path, watch_timeout_s=300.0):
            await until(lambda: sum(1 for r in server.requests if r.get("watch")) >= 5, timeout_s=15)
        asked = [int(r["timeoutSeconds"]) for r in server.requests if r.get("watch")]
        assert all(300 <= t < 600 for t in asked), asked
        assert len(set(asked)) > 1, asked
        assert len(server.list_sources) == 1  # each watch resumed; none relisted
    finally:
        await server.stop()
