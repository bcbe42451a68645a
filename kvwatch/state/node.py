"""The node's status: collectors, scrape targets, config reload, discovery, and ``NodeState``, which
holds them with the request, in-flight and plugin stats (the rest of this package).

Sources write here (whole immutable samples replace old ones, so a reader never sees half an
update; ``NodeState`` says how each part is written); exporters and the status page only read. A
target that fails keeps ``up = False`` and its samples are dropped rather than served as if fresh.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from kvwatch.catalog import BY_NAME
from kvwatch.derive.node import DerivedView
from kvwatch.model import GpuGrant, GpuSample, InFlightRequest, LengthBands, ReplicaSample
from kvwatch.state.in_flight import InFlightTracker
from kvwatch.state.plugin import PluginStats
from kvwatch.state.request_stats import RequestStats


@dataclass(slots=True)
class CollectorStatus:
    """node_exporter-style self report of one collector (``engine:r0``, ``nvml``, ...)."""

    success: bool = False
    duration_s: float = 0.0
    last_success_ts: float | None = None
    last_error: str | None = None


@dataclass(slots=True)
class TargetState:
    """One scrape target (a configured replica: one engine server, maybe several DP ranks)."""

    name: str
    backend: str = "unknown"
    up: bool = False
    samples: tuple[ReplicaSample, ...] = ()
    last_success_ts: float | None = None
    last_error: str | None = None
    scrape_duration_s: float = 0.0
    consecutive_failures: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    #: engine samples dropped or folded while parsing, by reason (catalog.REJECTED_SAMPLE_REASONS)
    rejected_samples: Counter[str] = field(default_factory=Counter)
    restarts: int = 0
    #: scrapes are skipped until this unix time after consecutive failures (exponential backoff)
    backoff_until: float | None = None
    #: last good samples, kept while down only to detect counter resets (engine restarts); never exported
    previous_samples: tuple[ReplicaSample, ...] = ()
    #: the proxy's requests in flight to this replica when ``samples``' page was read: what the
    #: samples' KV counts are compared with (live tokens, over-commitment), from the same moment
    in_flight: tuple[InFlightRequest, ...] = ()
    #: why the last fetch of the adapter's extra page (llama.cpp /slots) failed (the target stays up),
    #: None when it worked
    extra_page_error: str | None = None


@dataclass(slots=True)
class ConfigReloadStatus:
    """Prometheus-style: whether the last reload was applied, and when a config last loaded."""

    successful: bool = True
    last_success_ts: float | None = None
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class DiscoveryStatus:
    """Kubernetes discovery as of its last change (replaced whole)."""

    stale: bool = True
    replicas: tuple[str, ...] = ()
    #: (namespace, pod) -> ((annotation, reason), ...) for pods whose annotations are malformed
    problems: dict[tuple[str, str], tuple[tuple[str, str], ...]] = field(default_factory=dict)
    #: replica -> its pod's Ready condition is True (a not-ready pod that was a target stays a replica)
    ready: dict[str, bool] = field(default_factory=dict)


class NodeState:
    """Everything the outputs read.

    Writers run on the agent's event loop (the engine scrape job, the proxy, the receivers, discovery,
    config reload) or in its threads (NVML poll and PID mapping in the executor, the NVML XID event
    thread). Renders (``/metrics``, the status page) only read; nothing here is written during one.

    How each part is written, as it is:

    - Replaced whole, no lock: ``gpus``, ``driver_version``, ``replica_gpus``, ``pid_replica``,
      ``derived``, ``discovery``, ``gpu_grants``, ``gpu_owners``, a target's ``samples`` tuple. A
      reader in another thread sees the old value or the new one, never half of one.
    - Under ``_lock``: the ``targets`` dict's membership and the self-metric ``counters``.
    - Own locks: ``requests``, ``in_flight`` and ``plugin`` (each class locks its own updates).
    - In place, no lock: a ``TargetState`` is written field by field by its scrape job alone; a
      ``CollectorStatus`` field by field by ``report`` (each source reports its own collector); the
      ``xid_counts`` counter one key at a time by the XID thread; ``config_reload`` by the reload job.
      A render in between may pair one run's ``success`` or ``up`` with the previous run's duration
      or error, never see a half-written sample.
    """

    def __init__(self, node: str, bands: LengthBands, started_at: float | None = None) -> None:
        self.node = node
        self.bands = bands
        #: on the agent's clock (``kvwatch demo``'s runs ahead of the wall), so uptime reads true
        self.started_at = time.time() if started_at is None else started_at
        self._lock = threading.Lock()
        self.targets: dict[str, TargetState] = {}
        self.collectors: dict[str, CollectorStatus] = {}
        self.gpus: tuple[GpuSample, ...] = ()
        self.driver_version: str | None = None
        self.xid_counts: Counter[tuple[str, str, int]] = Counter()  # (gpu index, uuid, xid)
        #: replica name -> ((gpu index, uuid, mapped_by), ...)
        self.replica_gpus: dict[str, tuple[tuple[str, str, str], ...]] = {}
        #: pid -> replica name, for per-process GPU memory attribution
        self.pid_replica: dict[int, str] = {}
        self.requests = RequestStats(bands)
        self.plugin = PluginStats()
        self.in_flight = InFlightTracker()
        self.counters: dict[tuple[str, ...], float] = {}  # self-metrics: (family, *label values)
        #: derived KV signals, replaced whole by kvwatch.agent.derived.update_derived after each scrape
        self.derived: DerivedView | None = None
        self.config_reload = ConfigReloadStatus()
        #: None while Kubernetes discovery is off
        self.discovery: DiscoveryStatus | None = None
        #: devices the kubelet allocated to containers (PodResources API), replaced whole each poll
        self.gpu_grants: tuple[GpuGrant, ...] = ()
        #: (namespace, pod) of this node's pods in a terminal phase, from discovery: they hold no GPU
        self.terminal_pods: frozenset[tuple[str, str]] = frozenset()
        #: reason -> kubelet grants that name no GPU holder; None until the kubelet answered
        self.gpu_grants_unattributed: dict[str, int] | None = None
        #: GPU uuid -> (namespace, pod, container) holding it, derived from gpu_grants + NVML
        self.gpu_owners: dict[str, tuple[str, str, str]] = {}

    # -- targets --------------------------------------------------------------------------------
    def target(self, name: str) -> TargetState:
        with self._lock:
            state = self.targets.get(name)
            if state is None:
                state = self.targets[name] = TargetState(name)
            return state

    def drop_target(self, name: str) -> None:
        """Forget a replica that went away: its series go with it, its request stats and the self
        counters kept for it included (the agent calls this only for a replica no longer configured
        or discovered, never for one a reload keeps, whose counters must not reset)."""
        with self._lock:
            self.targets.pop(name, None)
            for key in [k for k in self.counters if _row_of_replica(k, name)]:
                del self.counters[key]
        self.collectors.pop(f"engine:{name}", None)
        self.collectors.pop(f"vllm_plugin:{name}", None)
        self.replica_gpus = {r: gpus for r, gpus in self.replica_gpus.items() if r != name}
        self.pid_replica = {pid: r for pid, r in self.pid_replica.items() if r != name}
        self.plugin.forget(name)
        self.requests.forget(name)
        self.in_flight.forget(name)

    def live_samples(self) -> list[ReplicaSample]:
        """Samples of targets that are up: what may be exported as current."""
        return [s for t in list(self.targets.values()) if t.up for s in t.samples]

    def in_flight_at_scrape(self) -> list[InFlightRequest]:
        """The in-flight requests of targets that are up, each as of its replica's last page: a page
        is up to a scrape interval old, and requests start, grow and end in between."""
        return [r for t in list(self.targets.values()) if t.up for r in t.in_flight]

    # -- collectors -----------------------------------------------------------------------------
    def report(
        self,
        collector: str,
        success: bool,
        duration_s: float,
        error: str | None = None,
        now: float | None = None,
    ) -> None:
        status = self.collectors.setdefault(collector, CollectorStatus())
        status.success = success
        status.duration_s = duration_s
        if success:
            status.last_success_ts = time.time() if now is None else now
            status.last_error = None
        else:
            status.last_error = error

    def count(self, family: str, *labels: str, amount: float = 1) -> None:
        """Increment a self-metric counter (``count("kvwatch_otlp_spans", "malformed")``)."""
        with self._lock:
            key = (family, *labels)
            self.counters[key] = self.counters.get(key, 0) + amount

    def counters_for(self, family: str) -> list[tuple[tuple[str, ...], float]]:
        with self._lock:
            return [(key[1:], value) for key, value in self.counters.items() if key[0] == family]


def _row_of_replica(key: tuple[str, ...], replica: str) -> bool:
    """Whether a ``counters`` key (family, *label values) is a row of ``replica``: its family has a
    ``replica`` label (in the catalog) and the key names it there."""
    spec = BY_NAME.get(key[0])
    if spec is None or "replica" not in spec.labels:
        return False
    at = 1 + spec.labels.index("replica")
    return len(key) > at and key[at] == replica
