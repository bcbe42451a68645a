"""The agent's wiring: each source on its own schedule, nothing stale, clean start and stop."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import httpx
import pytest
from aiohttp import web

from kvwatch.agent import Agent
from kvwatch.config import Config, HostPort, IntervalsConfig, NvmlConfig, ReplicaConfig, ScrapeConfig
from kvwatch.gpu.fake import FakeNvml
from kvwatch.sim.node import SimNode, h200_node
from tests.local import kvwatch_run_refused, serve_app, until

LISTEN = HostPort("127.0.0.1", 0)


async def _sim(replicas: int = 2) -> SimNode:
    node = SimNode(h200_node("llama-3.1-8b", gpus=replicas, speed=20))
    await node.start()
    return node


def _config(node: SimNode, extra: tuple[ReplicaConfig, ...] = (), **kw) -> Config:
    reps = tuple(
        ReplicaConfig(name=f"sim-{i}", metrics_url=f"{url}/metrics", api_url=url, gpus=(str(i),))
        for i, url in enumerate(node.replica_urls)
    )
    return Config(
        replicas=reps + extra,
        listen=LISTEN,
        intervals=IntervalsConfig(engine_s=0.5, gpu_s=0.5),
        scrape=ScrapeConfig(timeout_s=1.0, backoff_max_s=1.0),
        nvml=NvmlConfig(fake_gpus=0),
        **kw,
    )


async def _metrics(agent: Agent) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"http://127.0.0.1:{agent.port}/metrics", timeout=5)).text


async def test_a_hanging_replica_delays_neither_the_others_nor_the_scrape():
    release = asyncio.Event()

    async def hang(_request):
        await release.wait()
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", hang)
    runner, port = await serve_app(app)
    node = await _sim()
    agent = Agent(
        _config(node, (ReplicaConfig(name="stuck", metrics_url=f"http://127.0.0.1:{port}/metrics"),)),
        nvml=FakeNvml(2),
    )
    await agent.start()
    try:
        timed_out = 'kvwatch_target_scrape_errors_total{reason="timeout",replica="stuck"} 1.0'
        await _shown(agent, timed_out)
        seen = agent.state.target("sim-0").last_success_ts
        # still scraped on schedule while "stuck" hangs
        await until(lambda: agent.state.target("sim-0").last_success_ts > seen, 15, "sim-0 scraped again")
        started = time.perf_counter()
        body = await _metrics(agent)
        assert time.perf_counter() - started < 1.0
        assert 'kvwatch_target_up{backend="unknown",replica="stuck"} 0.0' in body
        assert 'kvwatch_target_up{backend="vllm",replica="sim-1"} 1.0' in body
        assert agent.ready()  # every source tried once; a down engine does not block readiness
    finally:
        release.set()
        await agent.stop()
        await node.stop()
        await runner.cleanup()


async def _contains(agent: Agent, text: str) -> bool:
    return text in await _metrics(agent)


async def _shown(agent: Agent, text: str) -> None:
    """Until the agent's /metrics holds ``text`` (15 s: the machine is shared)."""
    await until(lambda: _contains(agent, text), 15, f"{text} on /metrics", interval_s=0.2)


async def test_a_vanished_replica_drops_out_and_comes_back():
    node = await _sim()
    agent = Agent(_config(node), nvml=FakeNvml(2))
    await agent.start()
    try:
        await _shown(agent, 'kvwatch_kv_capacity_tokens{backend="vllm",dp_rank="1"')
        server = node.servers[1]
        port = int(server.url.rsplit(":", 1)[1])
        await server.stop()
        await _shown(agent, 'kvwatch_target_up{backend="vllm",replica="sim-1"} 0.0')
        body = await _metrics(agent)
        assert 'replica="sim-1"' not in body.split("kvwatch_kv_capacity_tokens", 1)[1].split("# HELP", 1)[0]
        assert 'kvwatch_target_scrape_errors_total{reason="connect",replica="sim-1"}' in body
        await server.start("127.0.0.1", port)
        await _shown(agent, 'kvwatch_target_up{backend="vllm",replica="sim-1"} 1.0')
    finally:
        await agent.stop()
        await node.stop()


async def test_xids_are_watched_once_nvml_answers_even_when_it_did_not_at_the_agents_start():
    """A GPU Operator's driver container often comes up after the agent's pod: the GPU metrics came
    back at the collector's next retry, but the XID watcher was only ever started at the agent's
    start, so no XID was counted and the XID alerts could never fire."""
    node = await _sim()
    fake = FakeNvml(2, library_missing=True)
    now = [time.time()]
    agent = Agent(_config(node), nvml=fake, clock=lambda: now[0])
    await agent.start()
    try:
        await _shown(agent, 'kvwatch_collector_success{collector="nvml"} 0.0')
        fake.library_missing = False  # the driver is in place now
        now[0] += 10.0  # past the collector's first retry (5 s)
        await _shown(agent, 'kvwatch_collector_success{collector="nvml"} 1.0')
        fake.inject_xid(1, 79)
        await _shown(agent, 'kvwatch_gpu_xid_errors_total{container="",gpu="1"')
        assert 'xid="79"} 1.0' in (await _metrics(agent)).split("kvwatch_gpu_xid_errors_total{", 1)[1]
    finally:
        await agent.stop()
        await node.stop()


async def test_gpus_follow_nvml_and_vanish_when_nvml_does():
    node = await _sim()
    fake = FakeNvml(2)
    agent = Agent(_config(node), nvml=fake)
    await agent.start()
    try:
        await _shown(agent, 'kvwatch_collector_success{collector="nvml"} 1.0')
        body = await _metrics(agent)
        assert 'kvwatch_replica_gpu_info{dp_rank="",gpu="1"' in body  # config mapping joins GPUs
        import pynvml

        fake.fail("nvmlDeviceGetMemoryInfo", pynvml.NVMLError_Unknown)
        await _shown(agent, 'kvwatch_gpu_nvml_errors_total{call="nvmlDeviceGetMemoryInfo"')
        fake.clear_failures()
        fake.set_lost(0)
        await _shown(agent, 'kvwatch_gpu_lost{container="",gpu="0"')
        assert 'kvwatch_target_up{backend="vllm",replica="sim-0"} 1.0' in await _metrics(agent)
    finally:
        await agent.stop()
        await node.stop()


def test_kvwatch_run_stops_cleanly_on_sigterm(tmp_path):
    config = tmp_path / "kvwatch.yaml"
    config.write_text(
        "listen: 127.0.0.1:0\nnvml: {enabled: false}\nreplicas:\n"
        "  - {name: gone, metrics_url: 'http://127.0.0.1:9/metrics'}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwatch", "run", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        lines = []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if "kvwatch running" in line:
                break
        assert any("kvwatch running" in line for line in lines), lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert "stopping" in err and "Traceback" not in err


def test_kvwatch_run_names_a_bad_config_and_exits_1(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("replicas: [{name: x, metrics_url: ftp://nope}]\n")
    result = kvwatch_run_refused("--config", str(config))
    assert result.returncode == 1 and "replicas[0].metrics_url" in result.stderr


async def test_the_status_page_reads_the_agents_own_clock():
    # `kvwatch demo` runs the agent on the simulator's clock, ahead of the wall: the page's time, the
    # samples' times and the agent's start must all be on it, or uptime and staleness read wrong
    from kvwatch.status.page import make_status_routes

    node = await _sim(1)
    ahead = 5_000.0
    agent = Agent(
        _config(node),
        nvml=FakeNvml(1),
        route_factories=[make_status_routes],
        clock=lambda: time.time() + ahead,
    )
    await agent.start()
    try:
        await until(lambda: agent.state.targets["sim-0"].up, 10, "a scrape")
        async with httpx.AsyncClient() as client:
            view = (await client.get(f"http://127.0.0.1:{agent.port}/status.json", timeout=5)).json()["view"]
    finally:
        await agent.stop()
        await node.stop()
    assert view["generated_at"] - time.time() == pytest.approx(ahead, abs=30)
    assert 0 <= view["generated_at"] - view["agent_started_at"] < 30
    (replica,) = view["replicas"]
    assert 0 <= view["generated_at"] - replica["last_success_at"] < 30
