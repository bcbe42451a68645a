"""Relay worker processes (``proxy.workers``): real processes, real sockets, the real agent.

Two workers behind one port relay many concurrent streams from the ``openai`` SDK; what the agent
exports and writes to its ledger must equal what the clients counted, exactly. A worker killed
with SIGKILL is restarted and counted, its cut requests are counted as lost, and the agent keeps
serving. The accounting channel refuses a malformed datagram and goes on. The CPU count for
``auto`` is read from cgroup files like the kernel's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.agent import Agent
from kvwatch.config import (
    Config,
    ConfigError,
    HostPort,
    LedgerConfig,
    MetricsConfig,
    NvmlConfig,
    ProxyConfig,
    ReplicaConfig,
)
from kvwatch.config.loader import config_from_mapping
from kvwatch.model import InFlightRequest, LengthBands, Outcome, RequestRecord
from kvwatch.requests.proxy import channel, seams
from kvwatch.requests.proxy.channel import ChannelReceiver, WorkerChannel
from kvwatch.requests.proxy.cpus import cgroup_cpu_limit, parse_cpu_max, relay_workers, usable_cpus
from kvwatch.requests.proxy.workers import WorkerGroup, worker_share
from kvwatch.state import InFlightTracker
from tests.local import free_port, kvwatch_run, serve_app, until, wait_until
from tests.requests.scripted import DONE, text_chunk, usage_chunk

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SO_REUSEPORT and SOCK_SEQPACKET: Linux")

LISTEN = HostPort("127.0.0.1", 0)
BANDS = LengthBands((4, 16, 64))
PROMPT_TOKENS = 7


class LengthEngine:
    """An OpenAI-compatible streaming engine that writes ``max_tokens`` content events (one token
    each, vLLM's shape: ``scripted.text_chunk``), a finish event, the usage chunk, ``[DONE]``;
    ``pause`` seconds after each of the first events keeps streams open while the test looks."""

    def __init__(self, pause: float = 0.0) -> None:
        self.pause = pause
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        self.runner, port = await serve_app(app, access_log=None)
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        n = int(doc["max_tokens"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        try:
            for i in range(n):
                await response.write(text_chunk("t"))
                if i < 3 and self.pause:
                    await asyncio.sleep(self.pause)
            tail = text_chunk("", "length")
            if (doc.get("stream_options") or {}).get("include_usage"):
                tail += usage_chunk(PROMPT_TOKENS, n, "text_completion")
            await response.write(tail + DONE)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response


def _agent_config(engine_url: str, ledger: Path, workers: int | None) -> Config:
    return Config(
        replicas=(
            ReplicaConfig(
                name="r0",
                metrics_url=f"{engine_url}/metrics",
                api_url=engine_url,
                proxy_listen=LISTEN,
                model_name="tiny",
            ),
        ),
        listen=LISTEN,
        nvml=NvmlConfig(fake_gpus=0),
        proxy=ProxyConfig(workers=workers),
        ledger=LedgerConfig(path=str(ledger)),
        length_bands=BANDS,
        metrics=MetricsConfig(profile="full"),  # every request series per replica
    )


async def _stream(client: openai.AsyncOpenAI, n: int) -> int:
    """One streaming completion of ``n`` tokens; the tokens the engine's usage said (as the SDK read it)."""
    stream = await client.completions.create(
        model="tiny", prompt="hi", max_tokens=n, stream=True, stream_options={"include_usage": True}
    )
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    out: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


async def _scrape(agent: Agent) -> dict:
    async with httpx.AsyncClient() as http:
        return _samples((await http.get(f"http://127.0.0.1:{agent.port}/metrics")).text)


def _established_inodes(port: int) -> set[str]:
    """Socket inodes of ESTABLISHED TCP connections whose local port is ``port`` (the accepted side)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "01":
                    inodes.add(cols[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[8:-1])
    return found


@contextlib.asynccontextmanager
async def _two_workers(engine: LengthEngine, ledger: Path) -> AsyncIterator[tuple[Agent, WorkerGroup]]:
    """The agent with two relay workers in front of ``engine``, stopped (with the engine) on the way out."""
    await engine.start()
    agent = Agent(_agent_config(engine.url, ledger, workers=2))
    await agent.start()
    try:
        assert agent._proxy_workers is not None and len(agent._proxy_workers.pids) == 2
        yield agent, agent._proxy_workers
    finally:
        await agent.stop()
        await engine.stop()


async def test_two_workers_account_exactly_what_the_clients_counted(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    async with _two_workers(LengthEngine(pause=0.05), ledger) as (agent, group):
        port = agent.proxy_ports["r0"]
        lengths = [1 + (i * 7) % 90 for i in range(240)]  # every band, 2..90 tokens
        sent_by_band: collections.Counter[str] = collections.Counter()
        tokens_by_band: collections.Counter[str] = collections.Counter()
        clients = [
            openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1",
                api_key="unused",
                max_retries=0,
                http_client=httpx.AsyncClient(timeout=60),  # a client each: connections hash apart
            )
            for _ in range(24)
        ]

        async def load() -> list[int]:
            return await asyncio.gather(
                *(_stream(clients[i % len(clients)], n) for i, n in enumerate(lengths))
            )

        running = asyncio.ensure_future(load())
        per_worker = [0, 0]  # the most client connections each worker held at once
        while not running.done():  # the first events of each stream are paced: they stay open
            accepted = _established_inodes(port)
            held = [len(_socket_inodes(pid) & accepted) for pid in group.pids]
            per_worker = [max(a, b) for a, b in zip(per_worker, held, strict=True)]
            await asyncio.sleep(0.05)
        counted = await running
        assert counted == lengths  # the SDK read every stream whole, with the engine's usage
        for n in counted:
            sent_by_band[BANDS.band_for(n)] += 1
            tokens_by_band[BANDS.band_for(n)] += n
        assert all(per_worker), f"client connections per worker: {per_worker}"

        await until(lambda: sum(1 for _ in ledger.open()) >= len(lengths) if ledger.exists() else False, 30)
        samples = await _scrape(agent)
        for band in BANDS.names:
            labels = {"replica": "r0", "length_band": band, "source": "proxy"}
            assert (
                _value(samples, "kvwatch_requests_total", outcome="truncated", **labels) == sent_by_band[band]
            )
            assert _value(samples, "kvwatch_request_output_tokens_count", **labels) == sent_by_band[band]
            assert _value(samples, "kvwatch_request_output_tokens_sum", **labels) == tokens_by_band[band]
        assert _value(samples, "kvwatch_requests_total") == len(lengths)
        assert _value(samples, "kvwatch_requests_in_flight") == 0
        assert _value(samples, "kvwatch_proxy_worker_records_lost_total") == 0
        lines = [json.loads(line) for line in ledger.read_text().splitlines()]
        assert sorted(line["output_tokens"] for line in lines) == sorted(lengths)
        assert collections.Counter(line["length_band"] for line in lines) == sent_by_band
        assert {line["prompt_tokens"] for line in lines} == {PROMPT_TOKENS}
        for client in clients:
            await client.close()
    assert group.pids == []  # stopped with the agent


async def test_a_killed_worker_is_restarted_counted_and_its_cut_requests_counted_lost(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    engine = LengthEngine(pause=0.5)  # streams stay open while the worker is killed
    async with _two_workers(engine, ledger) as (agent, group):
        port = agent.proxy_ports["r0"]
        victim, survivor = group.pids
        http = [httpx.AsyncClient(timeout=30) for _ in range(16)]
        clients = [
            openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, http_client=h
            )
            for h in http
        ]

        async def attempt(client: openai.AsyncOpenAI) -> bool:
            try:
                await _stream(client, 8)
            except (openai.APIError, httpx.HTTPError):
                return False
            return True

        running = asyncio.gather(*(attempt(c) for c in clients for _ in range(2)))
        # every stream read and metered (the agent has it in flight), waiting on the engine's pace
        await until(lambda: len(agent.state.in_flight.current()) == 2 * len(clients), 10)
        on_victim = len(_socket_inodes(victim) & _established_inodes(port))
        assert on_victim > 0
        os.kill(victim, signal.SIGKILL)
        outcomes = await running
        failed = outcomes.count(False)
        assert failed >= on_victim // 2 > 0  # the victim's streams were cut (their clients saw it)

        await until(lambda: len(group.pids) == 2 and victim not in group.pids, 30)
        assert survivor in group.pids
        samples = await _scrape(agent)
        assert _value(samples, "kvwatch_proxy_worker_restarts_total") == 1
        lost = _value(samples, "kvwatch_proxy_worker_records_lost_total", replica="r0", reason="worker_died")
        # every request the clients saw cut was one the dead worker had started: counted lost, not
        # recorded; every request that finished is recorded; nothing is left in flight
        assert lost == failed, (lost, failed, on_victim, sorted(agent.state.counters.items()))
        assert _value(samples, "kvwatch_requests_total") == outcomes.count(True)
        assert _value(samples, "kvwatch_requests_in_flight") == 0

        engine.pause = 0.0
        await asyncio.sleep(1.0)  # the restarted worker listens
        after = await asyncio.gather(*(_stream(c, 5) for c in clients))
        assert after == [5] * len(clients)  # the agent keeps serving
        await until(lambda: len(ledger.read_text().splitlines()) == outcomes.count(True) + len(clients), 30)
        for h in http:
            await h.aclose()


async def test_a_malformed_datagram_is_refused_counted_and_the_channel_goes_on() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    records: list[RequestRecord] = []
    counters: collections.Counter = collections.Counter()

    def count(family: str, *labels: str, amount: float = 1) -> None:
        counters[(family, *labels)] += amount

    tracker = InFlightTracker()
    receiver = ChannelReceiver(ours, ["r0"], records.append, count, tracker)
    loop = asyncio.get_running_loop()
    worker = WorkerChannel(theirs, loop)
    record = RequestRecord(
        "r0", "tiny", "proxy", Outcome.COMPLETED, 1.7e9, output_tokens=3, gap_counts=(1, 2)
    )
    for bad in (
        b"\xff\x00 not json",
        b'{"not": "a list"}',
        b"[" * 5_000 + b"]" * 5_000,  # nested deeper than json.loads can recurse
        b'[["r", ["r0"]]]',  # a record with fields missing
        b'[["c", "kvwatch_build", ["r0"], 1]]',  # a family a worker may not count
        json.dumps([["r", [*json.loads(json.dumps(_fields(record)))[:-1], ["x" * 300]]]]).encode(),
        json.dumps([["c", "kvwatch_proxy_requests_shed", ["other-replica", "buffer"], 1]]).encode(),
        # a good message with a bad one in the same datagram: nothing of it is applied
        json.dumps([["c", "kvwatch_proxy_requests_shed", ["r0", "buffer"], 1], ["f", -1]]).encode(),
        b'[["f", 1, "many"]]',  # a finished request's exact prompt that is not a count
        b'[["f", 1, 2, 3]]',
    ):
        theirs.send(bad)
    worker.count("kvwatch_proxy_requests_shed", "r0", "buffer")
    handle = worker.start(InFlightRequest("r0", "tiny", "0-4", 3, 0, 1.7e9, 4))
    worker.sink(record)
    worker.finish(handle, prompt_tokens=6)  # its usage said 6 prompt tokens: twice the body's estimate
    await until(lambda: len(records) == 1, 5)
    assert records == [record]  # decoded field for field, tuples and the enum included
    assert counters[("kvwatch_proxy_worker_datagrams_refused",)] == 10
    assert counters[("kvwatch_proxy_requests_shed", "r0", "buffer")] == 1
    assert tracker.current() == []
    handle = worker.start(InFlightRequest("r0", "tiny", "0-4", 5, 0, 1.7e9, 4))
    await until(lambda: [r.prompt_tokens_estimate for r in tracker.current()] == [10], 5)
    worker.finish(handle)
    await until(lambda: tracker.current() == [], 5)
    theirs.close()
    await asyncio.wait_for(receiver.closed, 5)


def _fields(record: RequestRecord) -> list:
    from kvwatch.requests.proxy.channel import encode_record

    return encode_record(record)


# -- how many workers ------------------------------------------------------------------------------


def _cgroup(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(membership)
    return root, proc


def test_cpu_max_of_cgroup_v2() -> None:
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("150000 100000\n") == 1.5
    assert parse_cpu_max("400000 100000") == 4.0
    assert parse_cpu_max("garbage") is None


def test_a_cgroup_v2_quota_caps_the_cpus_rounded_up(tmp_path: Path) -> None:
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": "150000 100000\n"})
    assert cgroup_cpu_limit(root, proc) == 1.5
    assert usable_cpus(root, proc, available=16) == 2  # 1.5 CPUs: two loops can use them, one cannot
    root, proc = _cgroup(tmp_path / "b", "0::/\n", {"cpu.max": "max 100000\n"})
    assert usable_cpus(root, proc, available=16) == 16


def test_the_tightest_quota_up_the_v2_hierarchy_wins(tmp_path: Path) -> None:
    root, proc = _cgroup(
        tmp_path,
        "0::/kubepods/pod1/agent\n",
        {
            "kubepods/pod1/cpu.max": "300000 100000\n",
            "kubepods/pod1/agent/cpu.max": "max 100000\n",
            "kubepods/cpu.max": "800000 100000\n",
        },
    )
    assert cgroup_cpu_limit(root, proc) == 3.0
    assert usable_cpus(root, proc, available=2) == 2  # the affinity mask is tighter still


def test_a_cgroup_v1_cfs_quota(tmp_path: Path) -> None:
    membership = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n"
    root, proc = _cgroup(
        tmp_path,
        membership,
        {
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_limit(root, proc) == 2.5
    assert usable_cpus(root, proc, available=64) == 3
    # inside the container's own cgroup namespace v1 shows the host path, the mount is the container's
    root, proc = _cgroup(
        tmp_path / "ns",
        membership,
        {"cpu,cpuacct/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )
    assert cgroup_cpu_limit(root, proc) == 2.0
    root, proc = _cgroup(
        tmp_path / "unlimited",
        membership,
        {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )
    assert cgroup_cpu_limit(root, proc) is None


def test_auto_is_one_worker_per_proxied_replica_capped_by_the_cpus() -> None:
    assert relay_workers(None, proxied_replicas=8, cpus=3) == 3
    assert relay_workers(None, proxied_replicas=2, cpus=16) == 2
    assert relay_workers(None, proxied_replicas=1, cpus=16) == 0  # one replica: in process, as before
    assert relay_workers(None, proxied_replicas=8, cpus=1) == 0
    assert relay_workers(1, proxied_replicas=8, cpus=16) == 0
    assert relay_workers(0, proxied_replicas=8, cpus=16) == 0
    assert relay_workers(4, proxied_replicas=1, cpus=2) == 4  # as set


def test_proxy_workers_key_reads_auto_or_a_count_and_names_itself_when_bad() -> None:
    assert config_from_mapping({}).proxy.workers is None
    assert config_from_mapping({"proxy": {"workers": "auto"}}).proxy.workers is None
    assert config_from_mapping({"proxy": {"workers": 4}}).proxy.workers == 4
    assert config_from_mapping({"proxy": {"workers": "2"}}).proxy.workers == 2  # a KVWATCH_* value
    for bad in ("many", -1, 2.5, True):
        with pytest.raises(ConfigError) as err:
            config_from_mapping({"proxy": {"workers": bad}})
        assert "proxy.workers: expected auto or a whole number" in str(err.value)


def test_limits_divide_among_workers() -> None:
    share = worker_share(ProxyConfig(max_connections=1000, max_buffered_bytes=64 << 20), 3)
    assert share.max_connections == 334  # ceil: 3 x 334 >= 1000
    assert share.max_buffered_bytes == (64 << 20) // 3  # floor: the node-wide budget holds
    tight = worker_share(ProxyConfig(max_body_bytes=8 << 20, max_buffered_bytes=10 << 20), 4)
    assert tight.max_buffered_bytes == 8 << 20  # any allowed body still fits one worker


async def test_a_backed_up_channel_never_blocks_and_every_record_is_applied_or_counted_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent does not read for a while: the worker keeps going (sink never blocks), queues what
    the socket will not take up to the bound, then counts what it drops; once the agent reads, the
    records applied plus those counted lost are exactly the records made."""
    from kvwatch.requests.proxy import channel

    monkeypatch.setattr(channel, "MAX_BACKLOG_BYTES", 256 * 1024)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    loop = asyncio.get_running_loop()
    worker = WorkerChannel(theirs, loop)
    made = 0
    for _ in range(40):  # 40 loop turns of 200 records each, nobody reading
        for _ in range(200):
            handle = worker.start(InFlightRequest("r0", "tiny", "0-4", 3, 0, 1.7e9, 4))
            worker.sink(RequestRecord("r0", "tiny", "proxy", Outcome.COMPLETED, 1.7e9, output_tokens=made))
            worker.finish(handle)
            made += 1
        await asyncio.sleep(0)
    assert worker.backlog  # the socket's buffer filled; the rest waits in the worker
    records: list[RequestRecord] = []
    counters: collections.Counter = collections.Counter()

    def count(family: str, *labels: str, amount: float = 1) -> None:
        counters[(family, *labels)] += amount

    tracker = InFlightTracker()
    ChannelReceiver(ours, ["r0"], records.append, count, tracker)
    lost = ("kvwatch_proxy_worker_records_lost", "r0", "backlog")
    await until(lambda: not worker.backlog and len(records) + counters[lost] == made, 10)
    assert counters[lost] > 0  # the bound was reached: some were dropped, and counted
    assert len({r.output_tokens for r in records}) == len(records)  # none applied twice
    assert tracker.current() == []  # every start that was sent was finished
    theirs.close()


def test_every_relay_counter_may_cross_the_worker_channel():
    """A counter the relay gains in seams.py but the channel does not accept would be refused as a
    malformed datagram in every worker: RELAY_COUNTERS must name each of them."""
    families = {
        v for k, v in vars(seams).items() if k.isupper() and isinstance(v, str) and v.startswith("kvwatch_")
    }
    assert families and families == seams.RELAY_COUNTERS
    assert seams.RELAY_COUNTERS < channel.WORKER_FAMILIES


def test_a_proxy_port_another_process_holds_is_refused_not_shared() -> None:
    # another agent's relay workers hold the port with SO_REUSEPORT, as these would: joining it was
    # allowed (same user), and the kernel split the clients between the two agents
    from kvwatch.config import HostPort
    from kvwatch.requests.proxy.workers import reserve_port

    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"127.0.0.1:{port} is held by another process"):
            reserve_port(HostPort("127.0.0.1", port))
    finally:
        other.close()
    reserve_port(HostPort("127.0.0.1", port)).close()  # free again: taken
    reserve_port(HostPort("127.0.0.1", 0)).close()  # any port: nothing to probe


async def test_a_worker_that_exits_at_start_stops_the_agent_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a RuntimeError, which `kvwatch run` does not catch: a traceback instead of "cannot start: ..."
    from kvwatch.requests.proxy import workers

    monkeypatch.setattr(workers.sys, "executable", "/bin/false")  # the worker's interpreter: exits 1
    agent = Agent(_agent_config("http://127.0.0.1:9", tmp_path / "ledger.jsonl", workers=2))
    try:
        with pytest.raises(OSError, match="proxy worker 0 exited at start"):
            await agent.start()
    finally:
        monkeypatch.undo()
        await agent.stop()


def test_a_reloaded_log_level_reaches_the_relay_workers(tmp_path: Path) -> None:
    """Each worker took the agent's log level once, at its start, so a reload that turned logging up
    to find a fault on a busy node changed the agent's lines and none of its workers'."""
    agent_port, proxy_port = free_port(), free_port()
    config = tmp_path / "kvwatch.yaml"

    def write(level: str) -> None:
        config.write_text(
            f"listen: 127.0.0.1:{agent_port}\nnode: node-a\nnvml: {{enabled: false}}\n"
            "proxy: {workers: 2}\n"
            f"log_level: {level}\n"
            "replicas: [{name: r0, metrics_url: 'http://127.0.0.1:9/metrics', api_url: 'http://127.0.0.1:9', "
            f"proxy_listen: '127.0.0.1:{proxy_port}', model_name: tiny}}]\n"
        )

    write("warning")
    proc = kvwatch_run("--config", str(config))
    lines: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True)
    reader.start()
    try:

        def relaying() -> bool:  # the agent holds the port bound, not listening, until a worker listens
            httpx.get(f"http://127.0.0.1:{agent_port}/metrics", timeout=2)
            with socket.create_connection(("127.0.0.1", proxy_port), timeout=2):
                return True

        wait_until(relaying, 60, "the relay workers", interval_s=0.1, retry_on=(httpx.HTTPError, OSError))
        held_back = [line for line in lines if "[worker" in line and " INFO " in line]
        write("info")
        proc.send_signal(signal.SIGHUP)

        def told(level: str) -> list[str]:
            return [line for line in list(lines) if "[worker" in line and f"log level now {level}" in line]

        wait_until(lambda: len(told("INFO")) == 2, 30, "both workers to log at the reloaded level")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        reader.join(timeout=10)
    assert proc.returncode == 0, "".join(lines)[-3000:]
    assert held_back == [], held_back  # at warning, the workers' start lines were held back
    assert {line.split("[worker ")[1][0] for line in told("INFO")} == {"0", "1"}


def test_a_worker_takes_only_a_well_formed_log_level_from_the_agent() -> None:
    assert channel.read_log_level(channel.log_level_message(logging.DEBUG)) == logging.DEBUG
    for data in (
        b"",
        b"x",
        b'["log_level"]',
        b'["log_level", true]',
        b'["log_level", 20.0]',
        b'["log_level", 99]',
        b'["log_level", -1]',
        b'["other", 20]',
        b'{"log_level": 20}',
    ):
        assert channel.read_log_level(data) is None, data
