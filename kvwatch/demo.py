"""``kvwatch demo``'s node: simulated engine replicas, fake GPUs, a reasoning workload, the real agent.

Wiring only. The numbers come from the simulator (``kvwatch/sim``): a paged-KV engine per replica
speaking vLLM's ``/metrics`` and OpenAI API; the agent scrapes them, its proxies relay every request
of the load generator, and a fake NVML reports GPUs whose memory and PCIe traffic follow the
simulated engines. Time runs ``speed``× faster than the wall clock, and the agent runs on the
node's time: latencies, headroom and rates kvwatch derives are in simulated seconds (its timestamps
are the start time plus simulated time, so they run ahead of the wall clock). Prometheus' own
``rate()`` over the demo is per wall second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass

from kvwatch.agent import Agent
from kvwatch.config import (
    Config,
    HostPort,
    IntervalsConfig,
    MetricsConfig,
    NvmlConfig,
    ReplicaConfig,
    parse_host_port,
)
from kvwatch.config.schema import LEAN_PROFILE
from kvwatch.gpu.fake import FakeGpu, FakeNvml
from kvwatch.sim.loadgen import LoadGenConfig, LoadGenerator, LoadReport
from kvwatch.sim.node import NodeConfig, SimNode, h200_node
from kvwatch.sim.presets import DEMO_MODEL, demo_router, demo_workload
from kvwatch.sim.routing import RouterSpec
from kvwatch.sim.workload import generate
from kvwatch.status.page import make_status_routes

log = logging.getLogger(__name__)

#: a fake H200 at rest (``FakeGpu``'s defaults, from an idle H200) and decoding (illustrative: the
#: SM clock at the H200's 1,980 MHz boost, power rising with the KV traffic of the batch)
_IDLE = FakeGpu(0, "")
_BUSY_SM_CLOCK_MHZ = 1980
_BUSY_TEMPERATURE_C = 65  # at the power limit
_TEMPERATURE_STEP = 0.1  # share of the way to the load's temperature per sync (a heat sink lags)


def _follow_load(device: FakeGpu, busy: bool, kv_usage: float) -> None:
    """Utilization, power, clocks, clock-event reasons and temperature that agree with the engine's
    batch, so the demo's GPU panels do not show a GPU at 100% that is idle at 345 MHz and 75 W."""
    if busy:
        share = 0.4 + 0.5 * min(max(kv_usage, 0.0), 1.0)  # decode power follows memory traffic
        device.utilization_gpu = 100
        device.utilization_memory = min(100, int(100 * kv_usage))
        device.power_mw = int(_IDLE.power_mw + share * (device.power_limit_mw - _IDLE.power_mw))
        device.sm_clock_mhz = _BUSY_SM_CLOCK_MHZ
        device.clock_event_reasons = 0  # none: running at the clock it was asked for
    else:
        device.utilization_gpu = device.utilization_memory = 0
        device.power_mw, device.sm_clock_mhz = _IDLE.power_mw, _IDLE.sm_clock_mhz
        device.clock_event_reasons = _IDLE.clock_event_reasons
    heat = device.power_mw / device.power_limit_mw
    gap = _IDLE.temperature_c + heat * (_BUSY_TEMPERATURE_C - _IDLE.temperature_c) - device.temperature_c
    if abs(gap) >= 1:  # at least a degree a step, so whole degrees still reach the target
        device.temperature_c += int(math.copysign(max(1.0, abs(gap) * _TEMPERATURE_STEP), gap))
    device.memory_temperature_c = device.temperature_c - (_IDLE.temperature_c - _IDLE.memory_temperature_c)


GPU_SYNC_S = 0.5  # wall seconds between pushes of simulated GPU state into the fake NVML


@dataclass(frozen=True, slots=True)
class DemoSettings:
    replicas: int = 8
    model: str = DEMO_MODEL
    tp: int = 1
    speed: float = 20.0  # simulated seconds per wall second
    tick_s: float = 0.05  # wall seconds per simulator tick (= SSE chunk cadence)
    listen: HostPort = dataclasses.field(default_factory=lambda: parse_host_port("127.0.0.1:9477"))
    rate: float | None = None  # requests per simulated second; None = the preset's
    router: str = "skewed"  # skewed | least_loaded | round_robin | random
    seed: int = 0
    ledger: str | None = None
    scrape_interval_s: float = 1.0
    metrics_profile: str = LEAN_PROFILE  # metrics.profile of the demo's agent


def node_config(settings: DemoSettings) -> NodeConfig:
    gpus = settings.replicas * settings.tp
    cfg = h200_node(
        settings.model, tp=settings.tp, gpus=gpus, speed=settings.speed, enable_prefix_caching=False
    )
    return dataclasses.replace(cfg, tick_s=settings.tick_s, seed=settings.seed)


def agent_config(settings: DemoSettings, node: SimNode) -> Config:
    """The config a user would write for this node: one replica per simulated engine."""
    tp = node.config.engine.tp
    replicas = tuple(
        ReplicaConfig(
            name=f"replica-{i}",
            backend="vllm",
            metrics_url=f"{url}/metrics",
            api_url=url,
            proxy_listen=HostPort("127.0.0.1", 0),
            model_name=node.config.model_name,
            gpus=tuple(str(g) for g in range(i * tp, (i + 1) * tp)),
        )
        for i, url in enumerate(node.replica_urls)
    )
    interval = settings.scrape_interval_s
    return Config(
        replicas=replicas,
        listen=settings.listen,
        node="demo-h200-node",
        intervals=IntervalsConfig(engine_s=interval, gpu_s=interval, process_map_s=5.0),
        nvml=NvmlConfig(enabled=True, fake_gpus=0, events=True),
        ledger=dataclasses.replace(Config().ledger, path=settings.ledger),
        metrics=MetricsConfig(settings.metrics_profile),
    )


def router_spec(settings: DemoSettings) -> RouterSpec:
    if settings.router == "skewed":
        return demo_router(settings.seed)
    return RouterSpec(settings.router, seed=settings.seed)


class DemoNode:
    """Start/stop the whole simulated node. ``await run(duration)`` drives the workload."""

    def __init__(self, settings: DemoSettings) -> None:
        self.settings = settings
        self.node = SimNode(node_config(settings))
        self.fake = FakeNvml(self.node.config.gpus)
        self.agent: Agent | None = None
        self.loadgen: LoadGenerator | None = None
        self._tasks: list[asyncio.Task] = []
        self._pcie_seen: dict[int, tuple[float, float]] = {}

    @property
    def config(self) -> Config:
        assert self.agent is not None
        return self.agent.config

    async def start(self) -> None:
        await self.node.start()
        self._sync_gpus(0.0)
        config = agent_config(self.settings, self.node)
        epoch = time.time()
        self.agent = Agent(
            config,
            nvml=self.fake,
            route_factories=[make_status_routes],
            clock=lambda: epoch + self.node.now(),
            proxy_clock=self.node.now,
        )
        await self.agent.start()
        proxies = self.agent.proxy_ports
        base_urls = [f"http://127.0.0.1:{proxies[r.name]}" for r in config.replicas]
        self.loadgen = LoadGenerator(
            base_urls,
            model=self.node.config.model_name,
            router=router_spec(self.settings),
            config=LoadGenConfig(speed=self.settings.speed, seed=self.settings.seed),
        )
        self._tasks.append(asyncio.create_task(self._gpu_sync_loop(), name="kvwatch-demo-gpus"))

    async def run(self, duration_s: float | None, stop: asyncio.Event | None = None) -> LoadReport:
        """Send the workload until ``duration_s`` wall seconds pass (None: forever) or ``stop`` is set.

        The clients still waiting stay connected until ``stop()``, so what the run measured can be
        read first: their disconnects, which the proxy records as aborted, are the demo's teardown,
        not its workload.
        """
        assert self.loadgen is not None
        spec = demo_workload(self.settings.seed)
        if self.settings.rate is not None:
            spec = dataclasses.replace(spec, rate=self.settings.rate)
        sim_duration = None if duration_s is None else duration_s * self.settings.speed
        horizon = sim_duration if sim_duration is not None else 24 * 3600.0
        requests = generate(spec, duration=horizon)
        load = asyncio.create_task(self.loadgen.schedule(requests, duration=sim_duration))
        waiters: list[asyncio.Task[None] | asyncio.Task[bool]] = [load]
        if stop is not None:
            waiters.append(asyncio.create_task(stop.wait()))
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for task in waiters:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
        return self.loadgen.report

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.loadgen is not None:
            await self.loadgen.close()
        if self.agent is not None:
            await self.agent.stop()
        await self.node.stop()

    # -- fake GPUs follow the simulated engines ---------------------------------------------------
    async def _gpu_sync_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(GPU_SYNC_S)
            now = loop.time()
            self._sync_gpus(now - last)
            last = now

    def _sync_gpus(self, wall_elapsed: float) -> None:
        node, fake = self.node, self.fake
        for gpu in range(node.config.gpus):
            replica, _rank = node.gpu_replica(gpu)
            device = fake.gpu(gpu)
            device.memory_used_bytes = int(
                min(
                    node.gpu_memory_used_bytes(replica),
                    device.memory_total_bytes - device.memory_reserved_bytes,
                )
            )
            tx, rx = node.pcie_bytes(replica)
            seen_tx, seen_rx = self._pcie_seen.get(gpu, (0.0, 0.0))
            fake.add_pcie_traffic(gpu, int(max(tx - seen_tx, 0)), int(max(rx - seen_rx, 0)))
            self._pcie_seen[gpu] = (max(tx, seen_tx), max(rx, seen_rx))
            engine = node.engines[replica]
            _follow_load(device, bool(engine.running_ids()), engine.kv_usage)
        if wall_elapsed > 0:
            fake.advance(wall_elapsed * node.config.speed)
