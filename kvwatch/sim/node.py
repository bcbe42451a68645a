"""A simulated inference node: N engine replicas on a shared virtual clock, with or without HTTP.

HTTP mode (``SimNode.start()``): one vLLM-compatible server per replica (or one server holding
several DP ranks), and an asyncio task that advances every engine to
``sim_time = sim_start + wall_elapsed x speed`` every ``tick_s`` wall seconds. ``speed`` is simulated
seconds per wall second: at ``speed=50`` the node lives 50x faster, and every latency it reports
(``/metrics``, ground truth) is in simulated seconds, while a client measuring wall time sees them
divided by ``speed``. If the CPU cannot keep up, the clock slips (the node runs slower than asked)
instead of bursting; ``achieved_speed`` says by how much.

Headless mode (``run_headless``): the workload is fed straight into the engines in simulated time,
as fast as the CPU allows. Client patience is enforced the same way the HTTP load generator does it
(disconnect = abort), so both modes tell the same story.

Fake-GPU coupling: ``gpu_memory_used_bytes``, ``pcie_bytes`` and ``busy_seconds`` per replica give
the lead what to push into the fake NVML (replica ``r`` owns GPUs ``r*tp .. r*tp+tp-1``).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvwatch.sim.engine import EngineConfig, SimEngine
from kvwatch.sim.models import gpu_preset, model_preset
from kvwatch.sim.routing import Router, RouterSpec
from kvwatch.sim.server import SimServer
from kvwatch.sim.workload import REASONING, RequestClass, WorkloadRequest, output_sampler
from kvwatch.tasks import cancel_and_wait

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """The simulated node: one engine config shared by ``replicas`` DP replicas."""

    engine: EngineConfig
    replicas: int = 8
    ranks_per_server: int = 1  # 1: one server per replica (external LB); replicas: one API server
    speed: float = 1.0  # simulated seconds per wall second
    tick_s: float = 0.02  # wall seconds between clock advances (and SSE chunk cadence)
    max_catchup_ticks: float = 4.0  # a late tick advances at most this many ticks of sim time
    host: str = "127.0.0.1"
    ports: tuple[int, ...] = ()  # one per server; empty: free ports
    served_model_name: str | None = None  # default: the model's HF id
    output_class: RequestClass = REASONING  # output lengths of requests without a hint
    seed: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.ranks_per_server < 1 or self.replicas % self.ranks_per_server:
            raise ValueError(
                f"ranks_per_server ({self.ranks_per_server}) must divide replicas ({self.replicas})"
            )
        if self.speed <= 0 or self.tick_s <= 0:
            raise ValueError(f"speed and tick_s must be > 0, got speed={self.speed} tick_s={self.tick_s}")
        if self.ports and len(self.ports) != self.servers:
            raise ValueError(f"ports lists {len(self.ports)} ports for {self.servers} servers")

    @property
    def servers(self) -> int:
        return self.replicas // self.ranks_per_server

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model.served_name

    @property
    def gpus(self) -> int:
        return self.replicas * self.engine.gpus


def h200_node(
    model: str = "llama-3.1-8b",
    *,
    tp: int = 1,
    gpus: int = 8,
    speed: float = 1.0,
    **engine_options: Any,  # EngineConfig fields, each checked by its constructor and validate()
) -> NodeConfig:
    """An 8x H200 node (by default) split into ``gpus // tp`` replicas of ``model``.
    ``engine_options`` are ``EngineConfig`` fields (``enable_prefix_caching=True``, ...)."""
    if gpus % tp:
        raise ValueError(f"tp={tp} does not divide {gpus} GPUs")
    engine = EngineConfig(model=model_preset(model), gpu=gpu_preset("h200"), tp=tp, **engine_options)
    return NodeConfig(engine=engine, replicas=gpus // tp, speed=speed)


@dataclass(slots=True)
class HeadlessReport:
    """Outcome counts of a headless run (simulated time)."""

    arrived: int = 0
    rejected: int = 0  # did not fit max_model_len: a 400 in HTTP mode
    abandoned: int = 0  # aborted by client patience
    sim_seconds: float = 0.0
    completed: int = 0
    truncated: int = 0
    aborted: int = 0
    in_system: int = 0
    steps: int = 0
    preemptions: int = 0
    per_replica: list[dict] = field(default_factory=list)


def run_headless(
    engines: Sequence[SimEngine],
    requests: Iterable[WorkloadRequest],
    router: RouterSpec | Router | None = None,
    *,
    until: float | None = None,
    sample_every: float = 1.0,
    on_sample: Callable[[float], None] | None = None,
) -> HeadlessReport:
    """Feed ``requests`` (arrival order) into ``engines`` through ``router`` in simulated time.

    Without ``until`` the engines then drain until every request ended; with it, the run stops at
    that simulated time (requests still in the system stay there). Patience deadlines abort a request
    with no first token by ``arrival + first_token_patience``, or still running at
    ``arrival + total_patience``.

    ``on_sample(t)``, if given, is called every ``sample_every`` simulated seconds with every engine
    advanced to ``t`` (time-weighted KV and queue statistics), through the drain too."""
    if not isinstance(router, Router):
        router = Router(router or RouterSpec(), len(engines))
    report = HeadlessReport()
    deadlines: list[tuple[float, int, int, str, bool]] = []  # (time, seq, engine, rid, first_token_only)
    seq = 0
    next_sample = sample_every

    def sample_until(limit: float) -> None:
        nonlocal next_sample
        while on_sample is not None and next_sample <= limit:
            fire(next_sample)
            for e in engines:
                e.advance_to(next_sample)
            on_sample(next_sample)
            next_sample += sample_every

    def fire(limit: float) -> None:
        while deadlines and deadlines[0][0] <= limit:
            td, _, i, rid, first_only = heapq.heappop(deadlines)
            e = engines[i]
            e.advance_to(td)
            first = e.first_token_at(rid)
            if first is False:
                continue  # already ended
            if not first_only or first is None or first > td:
                e.abort(rid)
                report.abandoned += 1

    last_arrival = 0.0
    for wr in requests:
        t = wr.arrival
        if until is not None and t > until:
            break
        last_arrival = t
        sample_until(t)
        fire(t)
        for e in engines:
            e.advance_to(t)
        i = router.route(wr, [e.in_system for e in engines])
        try:
            engines[i].submit(
                wr.request_id,
                wr.prompt_tokens,
                wr.max_tokens,
                wr.output_tokens,
                arrival=t,
                prefix_id=wr.prefix_id,
                prefix_tokens=wr.prefix_tokens,
            )
        except ValueError:
            report.rejected += 1
            continue
        report.arrived += 1
        if wr.first_token_patience is not None:
            heapq.heappush(deadlines, (t + wr.first_token_patience, seq, i, wr.request_id, True))
            seq += 1
        if wr.total_patience is not None:
            heapq.heappush(deadlines, (t + wr.total_patience, seq, i, wr.request_id, False))
            seq += 1

    if until is None and on_sample is not None:
        while any(e.has_work() for e in engines):
            sample_until(next_sample)
        # each sample moves idle engines on to its time: the run ended when the last work did, not at
        # the next sample (or requests per GPU-hour would depend on --sample-every)
        end = max(last_arrival, *(e.busy_until for e in engines))
    elif until is None:
        while deadlines:
            if not any(e.has_work() for e in engines):
                break
            fire(deadlines[0][0])
        for e in engines:
            e.run_until_idle()
        end = max(e.now for e in engines)
    else:
        sample_until(until)
        fire(until)
        for e in engines:
            e.advance_to(until)
        end = until
    report.sim_seconds = end
    for e in engines:
        report.completed += e.completed
        report.truncated += e.truncated
        report.aborted += e.aborted
        report.in_system += e.in_system
        report.steps += e.steps
        report.preemptions += e.preemptions_total
        report.per_replica.append(
            {
                "replica": e.name,
                "completed": e.completed,
                "truncated": e.truncated,
                "aborted": e.aborted,
                "preemptions": e.preemptions_total,
                "steps": e.steps,
                "kv_usage": e.kv_usage,
            }
        )
    return report


class SimNode:
    """N simulated replicas, their HTTP servers and the clock that drives them.

    Usage (HTTP)::

        node = SimNode(h200_node("llama-3.1-8b", speed=20))
        await node.start()
        ... node.urls (one per server), node.replica_urls (one per replica) ...
        await node.stop()

    Usage (headless): ``node.run_headless(workload, RouterSpec(...))``.
    """

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.engines = [SimEngine(config.engine, name=str(i)) for i in range(config.replicas)]
        self.servers: list[SimServer] = []
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sim = 0.0  # time every engine has been advanced to
        self._last_now = 0.0
        self._tick_wall = 0.0
        self._wall_start = 0.0
        self._sim_start = 0.0
        self.ticks = 0
        self._output = output_sampler(config.output_class, config.seed)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start every server (free ports unless configured) and the clock."""
        if self._task is not None:
            raise RuntimeError("this SimNode is already started")
        cfg = self.config
        k = cfg.ranks_per_server
        for j in range(cfg.servers):
            server = SimServer(
                self.engines[j * k : (j + 1) * k],
                model_name=cfg.model_name,
                clock=self.now,
                output_tokens=self._output,
            )
            await server.start(cfg.host, cfg.ports[j] if cfg.ports else 0)
            self.servers.append(server)
        loop = self._loop = asyncio.get_running_loop()
        self._wall_start = self._tick_wall = loop.time()
        self._sim_start = self._sim
        self._task = asyncio.create_task(self._drive(), name="kvwatch-sim-clock")
        self._task.add_done_callback(_report_crash)

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for server in self.servers:
            await server.stop()
        self.servers = []

    async def _drive(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        speed, tick = cfg.speed, cfg.tick_s
        max_advance = tick * speed * cfg.max_catchup_ticks
        wall0, sim0 = self._tick_wall, self._sim
        while True:
            await asyncio.sleep(tick)
            wall = loop.time()
            target = sim0 + (wall - wall0) * speed
            if target - self._sim > max_advance:  # fell behind: slip the clock, do not burst
                target = self._sim + max_advance
                wall0, sim0 = wall, target
            for e in self.engines:
                e.advance_to(target)
            self._sim = target
            self._tick_wall = wall
            self.ticks += 1

    # ------------------------------------------------------------------ clock

    @property
    def running(self) -> bool:
        """True while the clock task advances the engines (False after a crash or ``stop()``)."""
        return self._task is not None and not self._task.done()

    def now(self) -> float:
        """Current simulated time: the last tick's, plus wall time since then x speed (monotone).
        Safe to call from other threads (the agent polls GPUs in a worker thread)."""
        t = self._sim
        if self._task is not None and self._loop is not None:
            elapsed = self._loop.time() - self._tick_wall
            t += min(elapsed, self.config.tick_s) * self.config.speed
        t = max(t, self._last_now)
        self._last_now = t
        return t

    @property
    def sim_time(self) -> float:
        """The simulated time every engine has been advanced to (the last tick's target)."""
        return self._sim

    @property
    def achieved_speed(self) -> float:
        """Simulated seconds per wall second since start (equals ``speed`` unless the CPU lags)."""
        wall = asyncio.get_running_loop().time() - self._wall_start if self._task else 0.0
        return (self._sim - self._sim_start) / wall if wall > 0 else 0.0

    # ------------------------------------------------------------------ addresses

    @property
    def urls(self) -> list[str]:
        """Base URL of each server (``/v1/...``, ``/metrics``)."""
        return [s.url for s in self.servers if s.url]

    @property
    def replica_urls(self) -> list[str]:
        """Base URL serving each replica (servers repeat when they hold several ranks)."""
        k = self.config.ranks_per_server
        urls = []
        for i in range(self.config.replicas):
            url = self.servers[i // k].url
            if url is None:
                raise RuntimeError("the node's servers are not started: no URL yet")
            urls.append(url)
        return urls

    # ------------------------------------------------------------------ headless

    def run_headless(
        self,
        requests: Iterable[WorkloadRequest],
        router: RouterSpec | None = None,
        *,
        until: float | None = None,
    ) -> HeadlessReport:
        return run_headless(self.engines, requests, router, until=until)

    # ------------------------------------------------------------------ fake-GPU coupling

    def gpu_replica(self, gpu: int) -> tuple[int, int]:
        """(replica, tp rank) that owns GPU index ``gpu``."""
        tp = self.config.engine.tp
        if not 0 <= gpu < self.config.gpus:
            raise IndexError(f"GPU {gpu} is not one of this node's {self.config.gpus} GPUs")
        return gpu // tp, gpu % tp

    def gpu_memory_used_bytes(self, replica: int) -> float:
        """Per GPU of ``replica``, what NVML shows: weights + runtime reserve + the whole KV pool.
        Constant: vLLM allocates its KV pool at start-up, so NVML cannot see KV occupancy."""
        return self.engines[replica].memory_plan.used_bytes_per_gpu

    def kv_bytes_in_use(self, replica: int) -> float:
        """Bytes of KV blocks held by live requests, whole replica (for contrast with NVML)."""
        return self.engines[replica].kv_bytes_in_use

    def pcie_bytes(self, replica: int) -> tuple[float, float]:
        """Cumulative (tx, rx) PCIe bytes per GPU of ``replica`` from KV offload: tx = GPU->host
        stores, rx = host->GPU loads (each TP rank moves its shard)."""
        e = self.engines[replica]
        tp = self.config.engine.tp
        return e.stats.offload_store_bytes / tp, e.stats.offload_load_bytes / tp

    def busy_seconds(self, replica: int) -> float:
        """Cumulative simulated seconds ``replica`` spent in steps (utilisation = its rate)."""
        return self.engines[replica].stats.busy_seconds


@contextlib.contextmanager
def serving_in_thread(node: SimNode, timeout_s: float = 30.0) -> Iterator[list[str]]:
    """``node`` started on an event loop of its own thread, for clients that block (httpx's sync
    client, a calibration load); its replicas' base URLs."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="sim-node", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(node.start(), loop).result(timeout_s)
        try:
            yield node.urls
        finally:
            asyncio.run_coroutine_threadsafe(node.stop(), loop).result(timeout_s)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        loop.close()


def _report_crash(task: asyncio.Task) -> None:
    """A clock task that dies would freeze the node silently: say so."""
    if not task.cancelled() and task.exception() is not None:
        log.error("simulated node clock stopped", exc_info=task.exception())
