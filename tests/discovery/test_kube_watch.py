"""The pod list/watch protocol against a fake API server with kube-apiserver's semantics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import pytest

from kvwatch.config import KubernetesDiscoveryConfig
from kvwatch.discovery.kube_api import (
    ApiError,
    PodWatch,
    StreamError,
    decode_event,
    in_cluster_url,
    split_lines,
)
from tests.discovery.fake_apiserver import (
    GZIP_THRESHOLD_BYTES,
    FakeApiServer,
    make_pod,
    vllm_container,
    with_managed_fields,
)
from tests.local import free_port


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
    settings = dict(enabled=True, api_url=url or server.url, token_file=str(token), ca_file=None,
                    watch_timeout_s=2.0, backoff_max_s=0.3)
    settings.update(overrides)
    sinks = Sinks()
    watch = PodWatch(KubernetesDiscoveryConfig(**settings), "node-a", sinks.on_change, sinks.count,
                     sinks.report)
    task = asyncio.create_task(watch.run())
    try:
        yield watch, sinks
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


def names(watch: PodWatch) -> set[str]:
    return {p["metadata"]["name"] for p in watch.pods.values()}


async def test_list_then_watch_from_the_lists_resource_version_with_bookmarks(tmp_path):
    server = FakeApiServer(bookmark_interval_s=0.2)
    await server.start()
    await server.create(make_pod("before", containers=[vllm_container()]))
    await server.create(make_pod("elsewhere", node="node-b"))
    try:
        async with watching(server, tmp_path) as (watch, sinks):
            await until(lambda: watch.status.synced)
            assert names(watch) == {"before"}  # the field selector keeps other nodes' pods out
            listed_rv = server.requests[0]
            assert listed_rv == {"fieldSelector": "spec.nodeName=node-a"}
            uid = await server.create(make_pod("after"))
            await server.run(uid, "10.1.0.7")
            await until(lambda: watch.pods.get(uid, {}).get("status", {}).get("phase") == "Running")
            assert names(watch) == {"before", "after"}
            watch_request = server.requests[1]
            assert watch_request["watch"] == "1" and watch_request["allowWatchBookmarks"] == "true"
            assert watch_request["resourceVersion"] == "102"  # the list's version, not a fresh one
            await server.create(make_pod("other-node", node="node-b"))  # filtered out, still moves rv
            await until(lambda: sinks.counts[("kvwatch_discovery_watch_events", "BOOKMARK")] >= 1
                        and watch.status.resource_version == str(server.rv))
            assert sinks.counts[("kvwatch_discovery_relists",)] == 0
    finally:
        await server.stop()


async def test_a_watch_the_server_ends_resumes_without_a_relist(tmp_path):
    server = FakeApiServer()
    await server.start()
    try:
        async with watching(server, tmp_path, watch_timeout_s=1.0) as (watch, _sinks):
            await until(lambda: watch.status.synced)
            await asyncio.sleep(1.5)  # the first watch ended by timeoutSeconds, the next one running
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


@pytest.mark.parametrize(("raw", "reason"), [
    (b'{"type": "ADDED", "object": {"metadata": \n', "malformed"),
    (b'{"type": "UPSERTED", "object": {}}\n', "malformed"),
    (b"[1, 2, 3]\n", "malformed"),
    (b'{"type": "ADDED", "object": {"metadata": {"name": "' + b"x" * 5000 + b'"}}}\n', "too_large"),
])
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
    assert split_lines(buffer, b': 2}\n\n', 64) == [b'{"b": 2}']
    with pytest.raises(StreamError):
        split_lines(bytearray(), b"x" * 65, 64)
    with pytest.raises(StreamError):
        decode_event(b'{"type": "ADDED", "object": []}')


def test_the_in_cluster_address_is_the_one_the_kubelet_injects():
    assert in_cluster_url({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}) \
        == "https://10.96.0.1:443"
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
