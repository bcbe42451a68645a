"""The agent's current view of the node: what sources wrote last, and cumulative request stats.

Sources write here (whole immutable samples replace old ones, so a reader never sees half an
update; ``NodeState`` says how each part is written); exporters and the status page only read. A
target that fails keeps ``up = False`` and its samples are dropped rather than served as if fresh.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from kvwatch import buckets
from kvwatch.buckets import Histogram
from kvwatch.derive.node import DerivedView
from kvwatch.model import (
    EngineStep,
    GpuGrant,
    GpuSample,
    InFlightRequest,
    LengthBands,
    Outcome,
    PluginLink,
    ReplicaSample,
    RequestRecord,
)
from kvwatch.native_histogram import NativeHistogram

# --------------------------------------------------------------------------------------------
# collectors and targets
# --------------------------------------------------------------------------------------------


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

    def __init__(self, node: str, bands: LengthBands) -> None:
        self.node = node
        self.bands = bands
        self.started_at = time.time()
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
        """Forget a replica that went away (its series go with it)."""
        with self._lock:
            self.targets.pop(name, None)
        self.collectors.pop(f"engine:{name}", None)
        self.collectors.pop(f"vllm_plugin:{name}", None)
        self.plugin.forget(name)

    def live_samples(self) -> list[ReplicaSample]:
        """Samples of targets that are up: what may be exported as current."""
        return [s for t in list(self.targets.values()) if t.up for s in t.samples]

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


# --------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------


HISTOGRAM_FAMILIES = {
    "kvwatch_request_ttft_seconds": buckets.TTFT_SECONDS,
    "kvwatch_request_tpot_seconds": buckets.TPOT_SECONDS,
    "kvwatch_request_inter_chunk_seconds": buckets.INTER_CHUNK_SECONDS,
    "kvwatch_request_duration_seconds": buckets.DURATION_SECONDS,
    "kvwatch_request_queue_seconds": buckets.QUEUE_SECONDS,
    "kvwatch_request_prefill_seconds": buckets.TTFT_SECONDS,
    "kvwatch_request_decode_seconds": buckets.DURATION_SECONDS,
    "kvwatch_request_preemptions": buckets.PREEMPTIONS,
    "kvwatch_request_output_limit_ratio": buckets.RATIO,
    "kvwatch_request_prefix_reuse_ratio": buckets.RATIO,
}
#: families fed pre-binned (a request's inter-chunk gaps arrive as classic bins): no native form
PREBINNED_FAMILIES = frozenset({"kvwatch_request_inter_chunk_seconds"})


class DualHistogram(Histogram):
    """Classic buckets and a native histogram of the same observations: the protobuf exposition
    sends both in one message, the text exposition the classic ones."""

    __slots__ = ("native",)

    def __init__(self, bounds: tuple[float, ...]) -> None:
        super().__init__(bounds)
        self.native = NativeHistogram()

    def observe(self, value: float, weight: int = 1) -> None:
        super().observe(value, weight)
        self.native.observe(value, weight)


class RequestStats:
    """Cumulative per-(replica, model, band, source) request histograms and outcome counts.

    ``observe`` is called once per finished request (never per chunk). Thread-safe.
    """

    def __init__(self, bands: LengthBands) -> None:
        self.bands = bands
        self.bounds = dict(HISTOGRAM_FAMILIES)
        self.bounds["kvwatch_request_output_tokens"] = buckets.output_token_bounds(bands.edges)
        self._lock = threading.Lock()
        # (replica, model, band, source) -> family -> Histogram
        self.histograms: dict[tuple[str, str, str, str], dict[str, Histogram]] = {}
        self.outcomes: Counter[tuple[str, str, str, str, str]] = Counter()
        self.estimated: Counter[tuple[str, str, str, str]] = Counter()
        #: (replica, model, band, source) -> requests whose longest gap was a preemption stall; a key
        #: is present (at 0) once a request with a measured longest gap was seen
        self.stalls: Counter[tuple[str, str, str, str]] = Counter()
        #: (replica, model, band, source) -> max_tokens - output tokens of requests that stopped early
        self.unused_limit_tokens: Counter[tuple[str, str, str, str]] = Counter()
        self.observed = 0

    def _hists(self, key: tuple[str, str, str, str]) -> dict[str, Histogram]:
        hists = self.histograms.get(key)
        if hists is None:
            hists = self.histograms[key] = {
                name: Histogram(b) if name in PREBINNED_FAMILIES else DualHistogram(b)
                for name, b in self.bounds.items()
            }
        return hists

    def observe(self, record: RequestRecord, stalled: bool | None = None) -> str:
        """Fold one finished request in; returns the length band it was counted in.

        ``stalled``: whether its longest gap overlapped a preemption (None: not measured).
        """
        band = self.bands.band_for(record.output_tokens)
        key = (record.replica, record.model_name, band, record.source)
        tpot = record.tpot_seconds
        with self._lock:
            hists = self._hists(key)
            if record.ttft_seconds is not None:
                hists["kvwatch_request_ttft_seconds"].observe(record.ttft_seconds)
            if tpot is not None:
                hists["kvwatch_request_tpot_seconds"].observe(tpot)
            if record.e2e_seconds is not None:
                hists["kvwatch_request_duration_seconds"].observe(record.e2e_seconds)
            if record.queue_seconds is not None:
                hists["kvwatch_request_queue_seconds"].observe(record.queue_seconds)
            if record.output_tokens is not None:
                hists["kvwatch_request_output_tokens"].observe(record.output_tokens)
            if record.gap_counts:
                hists["kvwatch_request_inter_chunk_seconds"].merge_bins(
                    record.gap_bounds, record.gap_counts, record.gap_sum
                )
            self._observe_engine_facts(hists, key, record)
            self.outcomes[(*key, record.outcome.value)] += 1
            if record.output_tokens_estimated:
                self.estimated[key] += 1
            if stalled is not None:
                self.stalls[key] += int(stalled)
            self.observed += 1
        return band

    def _observe_engine_facts(
        self, hists: dict[str, Histogram], key: tuple[str, str, str, str], record: RequestRecord
    ) -> None:
        """What only an engine-side source knows per request (the vLLM plugin; OTLP partly)."""
        if record.prefill_seconds is not None:
            hists["kvwatch_request_prefill_seconds"].observe(record.prefill_seconds)
        if record.decode_seconds is not None:
            hists["kvwatch_request_decode_seconds"].observe(record.decode_seconds)
        if record.preemptions is not None:
            hists["kvwatch_request_preemptions"].observe(record.preemptions)
        if record.output_tokens is not None and record.max_tokens:
            hists["kvwatch_request_output_limit_ratio"].observe(record.output_tokens / record.max_tokens)
            if record.outcome is Outcome.COMPLETED and not record.output_tokens_estimated:
                self.unused_limit_tokens[key] += max(0, record.max_tokens - record.output_tokens)
        if record.cached_prompt_tokens is not None and record.prompt_tokens:
            hists["kvwatch_request_prefix_reuse_ratio"].observe(
                min(1.0, record.cached_prompt_tokens / record.prompt_tokens)
            )

    def snapshot(
        self,
    ) -> tuple[
        dict[tuple[str, str, str, str], dict[str, Histogram]],
        dict[tuple[str, str, str, str, str], int],
        dict[tuple[str, str, str, str], int],
    ]:
        """Copies for exporters (scrape must not hold the lock while rendering)."""
        with self._lock:
            hists = {
                key: {name: _copy_histogram(h) for name, h in fams.items()}
                for key, fams in self.histograms.items()
            }
            return hists, dict(self.outcomes), dict(self.estimated)

    def outcome_counts(self) -> dict[tuple[str, str, str, str, str], int]:
        """A copy of the finished-request counts by (replica, model, band, source, outcome)."""
        with self._lock:
            return dict(self.outcomes)

    def unused_limit_counts(self) -> dict[tuple[str, str, str, str], int]:
        """A copy of the unused max_tokens per key, for exporters."""
        with self._lock:
            return dict(self.unused_limit_tokens)

    def stall_counts(self) -> dict[tuple[str, str, str, str], int]:
        """A copy of the preemption-stall counts, for exporters."""
        with self._lock:
            return dict(self.stalls)


class InFlightTracker:
    """Requests the proxy relays right now; the proxy updates content chunks as they pass.

    Generated tokens of a running stream are estimated as chunks x tokens-per-chunk, a per-replica
    moving average learned from finished streams whose usage gave the exact count: one chunk is
    one token on most engines at normal pace, several with stream intervals, speculative decoding,
    merged deltas under load, or the demo's accelerated clock.
    """

    CALIBRATION_WEIGHT = 0.2  # weight of the newest finished stream in the moving average

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._requests: dict[int, InFlightRequest] = {}
        self._chunks: dict[int, int] = {}
        self._tokens_per_chunk: dict[str, float] = {}

    def start(self, request: InFlightRequest) -> int:
        with self._lock:
            self._next += 1
            handle = self._next
            self._requests[handle] = request
            self._chunks[handle] = 0
            return handle

    def progress(self, handle: int, content_chunks: int) -> None:
        # plain dict store: cheap enough for the per-chunk path, atomic under the GIL
        if handle in self._chunks:
            self._chunks[handle] = content_chunks

    def finish(self, handle: int) -> None:
        with self._lock:
            self._requests.pop(handle, None)
            self._chunks.pop(handle, None)

    def calibrate(self, replica: str, output_tokens: int, content_chunks: int) -> None:
        """Fold one finished stream's exact tokens-per-chunk into the replica's average."""
        if output_tokens < 1 or content_chunks < 1:
            return
        ratio = max(1.0, output_tokens / content_chunks)
        with self._lock:
            old = self._tokens_per_chunk.get(replica)
            w = self.CALIBRATION_WEIGHT
            self._tokens_per_chunk[replica] = ratio if old is None else (1 - w) * old + w * ratio

    def tokens_per_chunk(self, replica: str) -> float:
        return self._tokens_per_chunk.get(replica, 1.0)

    def current(self) -> list[InFlightRequest]:
        with self._lock:
            out = []
            for handle, req in self._requests.items():
                per_chunk = self._tokens_per_chunk.get(req.replica, 1.0)
                generated = round(self._chunks.get(handle, 0) * per_chunk)
                out.append(
                    InFlightRequest(
                        req.replica,
                        req.model_name,
                        req.admission_band,
                        req.prompt_tokens_estimate,
                        generated,
                        req.started_at,
                        req.max_tokens,
                    )
                )
            return out


# --------------------------------------------------------------------------------------------
# the vLLM plugin's engine steps
# --------------------------------------------------------------------------------------------

STEP_RING_SIZE = 4096
#: sender processes whose drop counts are kept apart per DP rank (API servers, plus restarts)
MAX_SENDER_PIDS = 64
BATCH_TOKEN_BANDS = LengthBands(buckets.BATCH_TOKEN_EDGES)


class SenderCounts:
    """One cumulative counter that several sender processes report (the highest value of each pid).

    vLLM runs one plugin per API server (``--api-server-count``, by default the DP size) and each
    sends for every engine index, so several live pids report one rank; a restarted engine is a new
    pid that counts from 0. Datagrams may arrive reordered: a pid's value never goes back.
    """

    __slots__ = ("by_pid", "folded")

    def __init__(self, by_pid: dict[int | None, int] | None = None, folded: int = 0) -> None:
        self.by_pid: dict[int | None, int] = dict(by_pid or {})
        #: counts of the senders folded out of ``by_pid`` (more than MAX_SENDER_PIDS seen)
        self.folded = folded

    @property
    def total(self) -> int:
        return self.folded + sum(self.by_pid.values())

    def note(self, pid: int | None, value: int) -> None:
        by_pid = self.by_pid
        if pid not in by_pid and len(by_pid) >= MAX_SENDER_PIDS:
            oldest = next(iter(by_pid))  # insertion order: the longest-known sender, likely gone
            self.folded += by_pid.pop(oldest)
        by_pid[pid] = max(by_pid.get(pid, 0), value)

    def copy(self) -> SenderCounts:
        return SenderCounts(self.by_pid, self.folded)


@dataclass(slots=True)
class PluginUnit:
    """Cumulative facts of one DP rank of one replica, as its plugin reported them."""

    datagrams: int = 0
    #: datagrams, and the engine steps in them, that the plugin could not send
    dropped_datagrams: SenderCounts = field(default_factory=SenderCounts)
    dropped_steps: SenderCounts = field(default_factory=SenderCounts)
    #: tokens re-prefilled for resumed requests; None until a step said it (unknown, not 0)
    recomputed_tokens: int | None = None
    #: True once any of them came from a vLLM that records a prefix-cache lookup per lookup, not per
    #: admission (or from a plugin that does not say which): the figure is then an upper bound
    recompute_upper_bound: bool = False
    resumed_requests: int = 0
    preemptions: int = 0
    eviction_samples_left_out: int = 0
    last_at: float | None = None
    step_seconds: dict[str, Histogram] = field(default_factory=dict)  # batch-token band -> histogram
    block_lifetime: Histogram = field(default_factory=lambda: Histogram(buckets.KV_BLOCK_SECONDS))
    block_idle: Histogram = field(default_factory=lambda: Histogram(buckets.KV_BLOCK_SECONDS))
    block_reuse_gap: Histogram = field(default_factory=lambda: Histogram(buckets.KV_BLOCK_SECONDS))

    @property
    def dropped(self) -> int:
        return self.dropped_datagrams.total

    def copy(self) -> PluginUnit:
        out = PluginUnit(
            self.datagrams,
            self.dropped_datagrams.copy(),
            self.dropped_steps.copy(),
            self.recomputed_tokens,
            self.recompute_upper_bound,
            self.resumed_requests,
            self.preemptions,
            self.eviction_samples_left_out,
            self.last_at,
        )
        out.step_seconds = {k: _copy_histogram(h) for k, h in self.step_seconds.items()}
        out.block_lifetime = _copy_histogram(self.block_lifetime)
        out.block_idle = _copy_histogram(self.block_idle)
        out.block_reuse_gap = _copy_histogram(self.block_reuse_gap)
        return out


def _copy_histogram(h: Histogram) -> Histogram:
    c = DualHistogram(h.bounds) if isinstance(h, DualHistogram) else Histogram(h.bounds)
    c.bins, c.sum, c.count = list(h.bins), h.sum, h.count
    if isinstance(h, DualHistogram) and isinstance(c, DualHistogram):
        c.native = h.native.copy()
    return c


class PluginStats:
    """Per (replica, DP rank): exact recompute, drops, step-time and KV-block histograms, and a
    bounded ring of the most recent step samples (for calibrating the simulator). Thread-safe."""

    def __init__(self, ring_size: int = STEP_RING_SIZE) -> None:
        self._lock = threading.Lock()
        self.units: dict[tuple[str, str], PluginUnit] = {}
        self.steps: deque[EngineStep] = deque(maxlen=ring_size)

    def observe(self, link: PluginLink, step: EngineStep | None) -> None:
        key = (link.replica, link.dp_rank)
        with self._lock:
            unit = self.units.get(key)
            if unit is None:
                unit = self.units[key] = PluginUnit()
            unit.datagrams += 1
            if link.dropped is not None:
                unit.dropped_datagrams.note(link.pid, link.dropped)
            if link.dropped_steps is not None:
                unit.dropped_steps.note(link.pid, link.dropped_steps)
            if step is not None:
                self._observe_step(unit, step, link.per_admission)

    def _observe_step(self, unit: PluginUnit, step: EngineStep, per_admission: bool | None) -> None:
        unit.last_at = step.at
        recomputed = step.recomputed_tokens
        if recomputed is not None:
            unit.recomputed_tokens = (unit.recomputed_tokens or 0) + recomputed
            # a KV connector's lookups are recorded at admission in every vLLM; the local ones only
            # from 0.27.0 (before, each retry of a request that could not be scheduled counted again)
            if step.connector_resumed_queried_tokens is None and per_admission is not True:
                unit.recompute_upper_bound = True
        unit.resumed_requests += step.resumed_requests or 0
        unit.preemptions += step.preempted or 0
        if step.elapsed_ms is not None and step.batch_tokens is not None:
            band = BATCH_TOKEN_BANDS.band_for(step.batch_tokens)
            hist = unit.step_seconds.get(band)
            if hist is None:
                hist = unit.step_seconds[band] = Histogram(buckets.STEP_SECONDS)
            hist.observe(step.elapsed_ms / 1000.0)
            self.steps.append(step)
        for ev in step.evictions:
            if ev.lifetime_seconds is not None:
                unit.block_lifetime.observe(ev.lifetime_seconds)
            if ev.idle_seconds is not None:
                unit.block_idle.observe(ev.idle_seconds)
            for gap in ev.reuse_gaps_seconds:
                unit.block_reuse_gap.observe(gap)
        unit.eviction_samples_left_out += step.evictions_left_out

    def forget(self, replica: str) -> None:
        """Drop a replica that went away (a discovered pod's random name never comes back)."""
        with self._lock:
            for key in [k for k in self.units if k[0] == replica]:
                del self.units[key]

    def snapshot(self) -> dict[tuple[str, str], PluginUnit]:
        with self._lock:
            return {key: unit.copy() for key, unit in self.units.items()}

    def recent_steps(self) -> list[EngineStep]:
        """The ring of step samples with a batch shape and a time, oldest first."""
        with self._lock:
            return list(self.steps)
