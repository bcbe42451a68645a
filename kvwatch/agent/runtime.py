"""``Agent``: starts and stops every source and server of ``kvwatch run`` (and ``kvwatch demo``)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol

import httpx
from aiohttp import web
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from prometheus_client.core import Metric

from kvwatch.agent.derived import update_derived
from kvwatch.agent.engines import scrape_target
from kvwatch.agent.gpu import nvml_backend, refresh_gpu_state, refresh_mapping, xid_recorder
from kvwatch.config import Config, ReplicaConfig, VllmPluginSocketConfig
from kvwatch.derive.recompute import request_stalled
from kvwatch.export.collector import NodeCollector
from kvwatch.export.derived import DerivedCollector
from kvwatch.export.gpus import GpuCollector
from kvwatch.export.plugin import PluginCollector
from kvwatch.export.replicas import ReplicaCollector
from kvwatch.export.requests import RequestCollector
from kvwatch.export.server import make_registry, metrics_app
from kvwatch.gpu.events import XidWatcher
from kvwatch.gpu.nvml import NvmlCollector, NvmlLibrary
from kvwatch.gpu.processes import ProcessTree
from kvwatch.model import RequestRecord
from kvwatch.requests.values import VALUES_DROPPED, out_of_range
from kvwatch.state import NodeState
from kvwatch.tasks import cancel_and_wait
from kvwatch.workers import WorkerProcess

if TYPE_CHECKING:  # each is imported when the config asks for it
    from kvwatch.agent.discovery import PodDiscovery
    from kvwatch.requests.ledger import RequestLedger
    from kvwatch.requests.otlp import OtlpReceiver
    from kvwatch.requests.sglang_files import SglangFileFollower
    from kvwatch.requests.vllm_plugin import PluginReceiver

log = logging.getLogger(__name__)

_P = ParamSpec("_P")

#: (state, config, the agent's clock) -> routes beside ``/metrics``
RouteFactory = Callable[[NodeState, Config, Callable[[], float]], Iterable[web.RouteDef]]


def _ends_quietly_on_shutdown(job: Callable[_P, Awaitable[None]]) -> Callable[_P, Awaitable[None]]:
    """A scheduled job cancelled because the agent stops just ends (APScheduler would log the
    cancellation as a failed job with a traceback)."""

    @functools.wraps(job)
    async def run(*args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            await job(*args, **kwargs)
        except asyncio.CancelledError:
            log.debug("%s cancelled: the agent is stopping", job.__name__)

    return run


class _Area(Protocol):
    """An export collector: renders from its ``config``, which reload and discovery replace."""

    @property
    def config(self) -> Config | None: ...  # the GPU collector reads none
    @config.setter
    def config(self, config: Config) -> None: ...

    def collect(self) -> Iterator[Metric]: ...


class Agent:
    """One node's agent. ``await start()``, then ``await stop()`` (SIGTERM handling is the caller's).

    ``nvml`` overrides the NVML module (the demo passes a ``FakeNvml`` driven by the simulator);
    ``route_factories`` add HTTP routes next to ``/metrics`` (the status page); ``clock`` is the
    node's time (unix seconds: scrapes, derived signals, and the proxies' request dates, so a request's
    gaps and the engine's preemption windows compare) and ``proxy_clock`` what the proxies measure
    durations with (the demo passes the simulator's clocks for both).
    """

    def __init__(
        self,
        config: Config,
        *,
        nvml: NvmlLibrary | None = None,
        proc: ProcessTree | None = None,
        route_factories: Iterable[RouteFactory] = (),
        clock: Callable[[], float] = time.time,
        proxy_clock: Callable[[], float] = time.perf_counter,
    ):
        #: the running config: the file's replicas plus those discovered (``set_discovered_replicas``)
        self.config = config
        self._base_config = config
        self._discovered: tuple[ReplicaConfig, ...] = ()
        self._discovered_plugin_sockets: tuple[VllmPluginSocketConfig, ...] = ()
        self._jobs: dict[str, tuple[ReplicaConfig, float]] = {}  # replica -> (config, interval) scheduled
        self._areas: dict[str, _Area] = {}
        self._discovery: PodDiscovery | None = None
        self.clock = clock
        self.proxy_clock = proxy_clock
        self.state = NodeState(config.node, config.length_bands, started_at=clock())
        self._nvml_override = nvml
        self._proc = proc
        self._route_factories = tuple(route_factories)
        self._client: httpx.AsyncClient | None = None
        self._worker = WorkerProcess()  # large engine pages and OTLP exports are parsed there, started lazily
        self._scheduler: AsyncIOScheduler | None = None
        self._runner: web.AppRunner | None = None
        self._site_port: int | None = None
        self._gpu: NvmlCollector | None = None
        self._xid: XidWatcher | None = None
        self._xid_tried = False  # the watcher starts once NVML answers, and is not tried again after
        self._proxies: list[Any] = []
        self._proxy_workers: Any = None  # a requests.proxy.workers.WorkerGroup when proxy.workers > 1
        self._otlp: OtlpReceiver | None = None
        self._followers: list[SglangFileFollower] = []
        self._plugin_receivers: dict[str, PluginReceiver] = {}  # socket path -> its receiver
        self._plugin_lock = asyncio.Lock()
        self._plugin_syncs: set[asyncio.Task[None]] = set()
        self._ledger: RequestLedger | None = None
        self._first_round: set[str] = set()
        self._mapping_notes: set[str] = set()
        self._mig_parents: dict[str, str] = {}  # MIG device UUID -> its GPU's UUID
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=max(8, 2 * len(cfg.replicas)), max_keepalive_connections=64),
            follow_redirects=False,
            headers={"Accept": "text/plain;version=0.0.4, */*;q=0.1", "User-Agent": "kvwatch"},
        )
        self._start_ledger()
        self._scheduler = AsyncIOScheduler(event_loop=asyncio.get_running_loop())
        self._sync_scrape_jobs()
        await self._start_gpu()
        self._start_pod_resources()
        self._scheduler.start()
        await self._start_request_sources()
        await self._start_http()
        await self._start_discovery()
        self._started = True

    # -- replicas that come and go -----------------------------------------------------------------
    def set_discovered_replicas(self, replicas: tuple[ReplicaConfig, ...]) -> None:
        """Discovery's replicas now; those no longer listed stop being scraped and lose their series."""
        self._discovered = tuple(replicas)
        self._reconfigure()

    def set_discovered_plugin_sockets(self, sockets: tuple[VllmPluginSocketConfig, ...]) -> None:
        """Discovery's vLLM plugin sockets now (``discovery.kubernetes.vllm_plugin_dir``)."""
        self._discovered_plugin_sockets = tuple(sockets)
        self._reconfigure()

    @property
    def file_config(self) -> Config:
        """The config as loaded (without discovered replicas): what a reload compares against."""
        return self._base_config

    def apply_config(self, config: Config) -> None:
        """A reloaded (already validated) config: replicas, intervals and scrape settings take effect
        now, and so do the vLLM plugin sockets; what needs a restart (listeners, NVML, ledger, bands)
        stays as started. The log level (set already) reaches the relay workers."""
        self._base_config = config
        self._reconfigure()
        if self._proxy_workers is not None:
            self._proxy_workers.set_log_level(logging.getLogger("kvwatch").getEffectiveLevel())

    def _reconfigure(self) -> None:
        base = self._base_config
        static = {r.name for r in base.replicas}
        discovered = tuple(r for r in self._discovered if r.name not in static)
        self.config = dataclasses.replace(base, replicas=base.replicas + discovered)
        for area in self._areas.values():
            area.config = self.config
        if self._scheduler is not None:
            self._sync_scrape_jobs()
        if self._started:
            task = asyncio.get_running_loop().create_task(
                self._sync_plugin_receivers(), name="vllm-plugin-sockets"
            )
            self._plugin_syncs.add(task)
            task.add_done_callback(self._plugin_syncs.discard)

    def _every(
        self, job: Callable[..., Awaitable[None]], seconds: float, job_id: str, **options: Any
    ) -> None:
        """Run ``job`` every ``seconds``, the first time now: never two runs at once (one due while the
        last still runs is skipped), and runs the loop missed are merged into one."""
        assert self._scheduler is not None
        self._scheduler.add_job(
            job,
            "interval",
            seconds=seconds,
            id=job_id,
            next_run_time=_now_dt(),
            max_instances=1,
            coalesce=True,
            **options,
        )

    def _sync_scrape_jobs(self) -> None:
        assert self._scheduler is not None
        interval = self.config.intervals.engine_s
        wanted = {r.name: r for r in self.config.replicas}
        for name, scheduled in list(self._jobs.items()):
            if scheduled != (wanted.get(name), interval):
                self._scheduler.remove_job(f"engine:{name}")
                del self._jobs[name]
                if name not in wanted:
                    self.state.drop_target(name)
                    self._first_round.discard(name)
        for name, replica in wanted.items():
            if name in self._jobs:
                continue
            self._every(
                self._scrape,
                interval,
                f"engine:{name}",
                args=[replica],
                misfire_grace_time=max(1, int(interval)),
            )
            self._jobs[name] = (replica, interval)

    async def _start_discovery(self) -> None:
        if not self.config.discovery.kubernetes.enabled:
            return
        from kvwatch.agent.discovery import PodDiscovery

        self._discovery = PodDiscovery(
            self.config,
            self.state,
            self.set_discovered_replicas,
            set_plugin_sockets=self.set_discovered_plugin_sockets,
        )
        await self._discovery.start()

    async def stop(self) -> None:
        """Stop sources first (proxies close upstreams, so engines free KV), then the server."""
        if self._discovery is not None:
            await self._discovery.stop()
            self._discovery = None
        if self._scheduler is not None and self._scheduler.running:
            # a job submitted but not started yet would be cancelled before its first step, where
            # _ends_quietly_on_shutdown cannot catch it, and logged as failed: pause, let it start
            self._scheduler.pause()
            await asyncio.sleep(0)
            self._scheduler.shutdown(wait=False)
        for proxy in self._proxies:
            await proxy.stop()
        self._proxies.clear()
        if self._proxy_workers is not None:
            await self._proxy_workers.stop()
            self._proxy_workers = None
        if self._otlp is not None:
            await self._otlp.stop()
            self._otlp = None
        for follower in self._followers:
            await follower.stop()
        self._followers.clear()
        self._started = False  # no more plugin socket changes
        for task in list(self._plugin_syncs):
            await cancel_and_wait(task)
        async with self._plugin_lock:
            for receiver in self._plugin_receivers.values():
                await receiver.stop()
            self._plugin_receivers.clear()
        if self._xid is not None:
            await asyncio.to_thread(self._xid.stop)
            self._xid = None
        if self._gpu is not None:
            await asyncio.to_thread(self._gpu.stop)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        await self._worker.close()
        if self._ledger is not None:
            await asyncio.to_thread(self._ledger.stop)
            self._ledger = None

    @property
    def port(self) -> int:
        """The port ``/metrics`` listens on (useful with ``listen: 127.0.0.1:0``)."""
        assert self._site_port is not None, "agent not started"
        return self._site_port

    @property
    def proxy_ports(self) -> dict[str, int]:
        ports = {p.replica: p.port for p in self._proxies}
        if self._proxy_workers is not None:
            ports.update(self._proxy_workers.ports)
        return ports

    @property
    def otlp_port(self) -> int | None:
        return None if self._otlp is None else self._otlp.port

    def ready(self) -> bool:
        """Ready once every configured source has been tried once (not: every engine is up)."""
        if not self._started:
            return False
        wanted = {r.name for r in self._base_config.replicas}  # discovered ones come and go
        return wanted <= self._first_round

    # -- engines -----------------------------------------------------------------------------------
    @_ends_quietly_on_shutdown
    async def _scrape(self, replica: ReplicaConfig) -> None:
        assert self._client is not None
        await scrape_target(
            self._client, replica, self.config.scrape, self.state, now=self.clock, worker=self._worker
        )
        if self._jobs.get(replica.name, (None,))[0] != replica:  # dropped or replaced meanwhile
            if replica.name not in self._jobs:
                self.state.drop_target(replica.name)
            return
        self._first_round.add(replica.name)
        self._update_derived()

    def _update_derived(self) -> None:
        try:
            update_derived(self.state, self.config, self.clock())
        except Exception:
            # keep the previous view (its recompute estimate is a counter that must not reset)
            log.exception("deriving KV signals failed; the previous derived view is kept")

    # -- GPUs --------------------------------------------------------------------------------------
    async def _start_gpu(self) -> None:

        cfg = self.config
        module = self._nvml_override if self._nvml_override is not None else nvml_backend(cfg.nvml)
        if module is None:
            log.info("NVML collection disabled by config (nvml.enabled: false)")
            return
        self._gpu = NvmlCollector(module, now=self.clock)
        if await asyncio.to_thread(self._gpu.start):
            await self._start_xid(module)
        self._every(self._poll_gpus, cfg.intervals.gpu_s, "nvml")
        self._every(self._map_gpus, cfg.intervals.process_map_s, "gpu_mapping")

    def _start_pod_resources(self) -> None:
        settings = self.config.discovery.pod_resources
        if not settings.enabled:
            return
        self._every(self._poll_pod_resources, settings.interval_s, "pod_resources")

    @_ends_quietly_on_shutdown
    async def _poll_pod_resources(self) -> None:
        """Who holds which GPU, from the kubelet; a failure keeps the last answer and says why."""
        from kvwatch.discovery.podresources import PodResourcesError, list_grants

        settings = self.config.discovery.pod_resources
        started = time.perf_counter()
        try:
            grants = await list_grants(settings.socket, settings.resource_names, settings.timeout_s)
        except PodResourcesError as exc:
            if (
                self.state.collectors.get("pod_resources", None) is None
                or self.state.collectors["pod_resources"].success
            ):
                log.warning("%s; GPU -> pod labels keep the last answer", exc)
            self.state.report("pod_resources", False, time.perf_counter() - started, str(exc))
            return
        self.state.gpu_grants = grants
        self.state.report("pod_resources", True, time.perf_counter() - started, now=self.clock())
        if self._gpu is not None:
            await self._map_gpus()

    async def _start_xid(self, module: Any) -> None:
        """The XID watcher, once, when NVML first answers: at start, or at the first poll that finds
        it (a GPU Operator's driver container often comes up after the agent's pod)."""
        if self._xid_tried or not self.config.nvml.events:
            return
        self._xid_tried = True
        watcher = XidWatcher(xid_recorder(self.state), module)
        if await asyncio.to_thread(watcher.start):
            self._xid = watcher

    @_ends_quietly_on_shutdown
    async def _poll_gpus(self) -> None:
        gpu = self._gpu
        if gpu is None:  # not scheduled before _start_gpu made one
            return
        await asyncio.to_thread(refresh_gpu_state, gpu, self.state, self.clock())
        self._update_derived()
        if gpu.available:
            await self._start_xid(gpu.nvml)

    def _mig_parent(self, mig_uuid: str) -> str | None:
        """The GPU a MIG device was carved from (NVML; answers are kept: a MIG device keeps its GPU)."""
        parent = self._mig_parents.get(mig_uuid)
        if parent is None and self._gpu is not None:
            parent = self._gpu.mig_parent(mig_uuid)
            if parent is not None and len(self._mig_parents) < 4096:
                self._mig_parents[mig_uuid] = parent
        return parent

    @_ends_quietly_on_shutdown
    async def _map_gpus(self) -> None:
        started = time.perf_counter()
        try:
            await asyncio.to_thread(
                refresh_mapping, self.config, self.state, self._proc, self._mapping_notes, self._mig_parent
            )
        except Exception as exc:
            log.exception("replica -> GPU mapping failed")
            self.state.report("gpu_mapping", False, time.perf_counter() - started, repr(exc))
            return
        self.state.report("gpu_mapping", True, time.perf_counter() - started, now=self.clock())

    # -- requests ----------------------------------------------------------------------------------
    def _start_ledger(self) -> None:
        ledger_cfg = self.config.ledger
        if ledger_cfg.path is None:
            return
        from kvwatch.requests.ledger import RequestLedger

        self._ledger = RequestLedger(
            ledger_cfg.path,
            self.config.length_bands,
            ledger_cfg.max_bytes,
            ledger_cfg.backups,
            counter=self.state.count,
        )
        self._ledger.start()
        log.info(
            "request ledger: %s (max %d bytes x %d files)",
            ledger_cfg.path,
            ledger_cfg.max_bytes,
            ledger_cfg.backups + 1,
        )

    def record(self, record: RequestRecord, admitted: bool = False) -> None:
        """The sink every request source hands finished requests to.

        A request whose longest gap the source measured (the proxy) is judged a preemption stall or
        not here, against its replica's preemption windows in the current derived view.
        ``admitted``: the ledger made room for it beforehand (an OTLP export, ``RequestLedger.admit``);
        it reaches the ledger even if the histograms raise.
        """
        for field in record.dropped_values:
            self.state.count(VALUES_DROPPED, record.replica, record.source, out_of_range(field))
        try:
            derived = self.state.derived
            windows = derived.preemption_windows(record.replica) if derived is not None else ()
            self.state.requests.observe(record, stalled=request_stalled(record, windows))
        finally:
            if self._ledger is not None:
                self._ledger.write(record, admitted)

    def _record_admitted(self, record: RequestRecord) -> None:
        self.record(record, admitted=True)

    def _relay_workers(self, proxied: int) -> int:
        """Relay worker processes for ``proxy.workers`` (0: the proxies run on this loop).

        Workers measure on the real clocks; an agent given its own (the demo's simulator) keeps
        its proxies in process, where they can read them.
        """
        from kvwatch.requests.proxy.cpus import relay_workers, usable_cpus

        workers = relay_workers(self.config.proxy.workers, proxied, usable_cpus())
        if workers and (self.clock is not time.time or self.proxy_clock is not time.perf_counter):
            log.info(
                "proxy: relaying in process (the agent runs on its own clock, which workers cannot read)"
            )
            return 0
        return workers

    async def _start_proxies(self, proxied: list[ReplicaConfig]) -> None:
        """The proxied replicas' relay: in relay worker processes, or on this loop."""
        if not proxied:
            return
        from kvwatch.requests.proxy import Accounting, start_proxy

        cfg = self.config
        accounting = Accounting(
            cfg.length_bands,
            self.state.in_flight,
            self.record,
            self.state.count,
            clock=self.proxy_clock,
            wall_clock=self.clock,
        )
        workers = self._relay_workers(len(proxied))
        if workers:
            from kvwatch.requests.proxy.workers import WorkerGroup

            group = WorkerGroup(proxied, cfg.proxy, cfg.known_models, accounting, workers)
            await group.start()
            self._proxy_workers = group
            return
        for replica in proxied:
            self._proxies.append(await start_proxy(replica, cfg.proxy, cfg.known_models, accounting))

    async def _start_request_sources(self) -> None:
        cfg = self.config
        await self._start_proxies([r for r in cfg.replicas if r.proxy_listen is not None])
        if cfg.otlp.listen is not None:
            from kvwatch.requests.otlp import OtlpReceiver

            self._otlp = OtlpReceiver(
                cfg,
                self._record_admitted,
                self.state.count,
                self.state.report,
                worker=self._worker,
                ledger=self._ledger,
            )
            await self._otlp.start()
        for files in cfg.sglang_request_files:
            from kvwatch.requests.sglang_files import start_follower

            self._followers.append(
                await start_follower(files, cfg, self.record, self.state.count, self.state.report)
            )
        await self._sync_plugin_receivers(at_start=True)

    def _wanted_plugin_sockets(self) -> dict[str, tuple[str, str]]:
        """Socket path -> (replica, model_name label): the config file's, then discovery's (for
        replicas the file does not name, at paths the file does not use)."""
        models = {r.name: r.model_name or "other" for r in self.config.replicas}
        wanted: dict[str, tuple[str, str]] = {}
        named = {s.replica for s in self._base_config.vllm_plugin_sockets}
        for entry in self._base_config.vllm_plugin_sockets:
            wanted[entry.path] = (entry.replica, models.get(entry.replica, "other"))
        for entry in self._discovered_plugin_sockets:
            if entry.replica in models and entry.replica not in named and entry.path not in wanted:
                wanted[entry.path] = (entry.replica, models[entry.replica])
        return wanted

    async def _sync_plugin_receivers(self, at_start: bool = False) -> None:
        """Bind the plugin sockets the config and discovery want now, close those they no longer
        want (a changed replica or model label rebinds). At start a socket that cannot be bound
        stops the agent (a config error); later, it is logged and reported, and the rest go on."""
        from kvwatch.requests.vllm_plugin import start_receivers

        async with self._plugin_lock:
            wanted = self._wanted_plugin_sockets()
            replicas = {replica for replica, _ in wanted.values()}
            for key in [k for k in self.state.collectors if k.startswith("vllm_plugin:")]:
                if key.split(":", 1)[1] not in replicas:  # a socket no longer configured: its failure goes
                    self.state.collectors.pop(key, None)
            for path, receiver in list(self._plugin_receivers.items()):
                if wanted.get(path) != (receiver.replica, receiver.model_name):
                    await receiver.stop()
                    del self._plugin_receivers[path]
                    log.info("vLLM plugin socket %s closed (%s)", path, receiver.replica)
                    if receiver.replica not in {r.name for r in self.config.replicas}:
                        # the replica was dropped before its socket closed: a datagram in between
                        # made rows under its name again
                        self.state.drop_target(receiver.replica)
            for path, (replica, model) in wanted.items():
                if path in self._plugin_receivers:
                    continue
                entry = VllmPluginSocketConfig(replica, path)
                try:
                    started = await start_receivers(
                        [entry],
                        {replica: model},
                        self.record,
                        self.state.plugin.observe,
                        self.state.count,
                        self.state.report,
                    )
                except OSError as exc:
                    if at_start:  # a config error: the agent stops, saying which socket
                        raise OSError(
                            exc.errno,
                            f"vllm_plugin_sockets ({replica}): cannot bind {path}: {exc.strerror or exc}",
                        ) from None
                    log.error("vLLM plugin socket %s for %s cannot be bound: %s", path, replica, exc)
                    self.state.report(f"vllm_plugin:{replica}", False, 0.0, f"bind {path}: {exc}")
                    continue
                self._plugin_receivers[path] = started[0]

    # -- HTTP --------------------------------------------------------------------------------------
    async def _start_http(self) -> None:
        cfg = self.config
        areas: dict[str, _Area] = {
            "replicas": ReplicaCollector(self.state, cfg),
            "derived": DerivedCollector(self.state, cfg),
            "gpus": GpuCollector(self.state, cfg),
            "requests": RequestCollector(self.state, cfg),
            "plugin": PluginCollector(self.state, cfg),
        }
        node = NodeCollector(self.state, cfg, areas)
        self._areas = {**areas, "node": node}  # each reads .config: updated on reload and discovery
        registry = make_registry(node)
        routes = [
            route for factory in self._route_factories for route in factory(self.state, cfg, self.clock)
        ]
        app = metrics_app(registry, self.ready, routes)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.listen.host, cfg.listen.port, reuse_address=True)
        await site.start()
        server = site._server  # aiohttp exposes the bound socket only here
        sockets = getattr(server, "sockets", None) or []
        self._site_port = sockets[0].getsockname()[1] if sockets else cfg.listen.port
        log.info(
            "kvwatch listening on %s:%d (/metrics, /-/healthy, /-/ready)", cfg.listen.host, self._site_port
        )


def _now_dt() -> datetime:
    """APScheduler's ``next_run_time`` for "run once right away, then on the interval"."""
    return datetime.now(UTC)
