"""What the vLLM stat-logger plugin reports per replica and DP rank: recompute, drops, step times,
KV-block lifetimes, and a ring of recent steps for calibrating the simulator."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from kvwatch import buckets
from kvwatch.buckets import Histogram
from kvwatch.model import EngineStep, LengthBands, PluginLink

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
        out.step_seconds = {k: h.copy() for k, h in self.step_seconds.items()}
        out.block_lifetime = self.block_lifetime.copy()
        out.block_idle = self.block_idle.copy()
        out.block_reuse_gap = self.block_reuse_gap.copy()
        return out


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
