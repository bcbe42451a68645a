"""All derived KV signals of a node, from one snapshot of its inputs and the previous view.

``derive_node(previous_view, inputs, now, settings) -> DerivedView`` is pure: the view carries the
little memory the signals need (recent samples per unit for rates, recent GPU polls, recompute
estimator states), and the caller keeps the returned view for the next call. Rates are taken over a
window: the baseline of a unit is its newest sample at least ``rate_window_s`` older than the
current one (or the oldest one kept, while the history is shorter), so a 5 s scrape interval gives
rates over ~30 s rather than over one noisy interval.

Only samples of targets that are up are inputs; a unit that is absent loses its rate history (rates
across an outage would describe the outage), but keeps its recompute estimate, so that counter never
goes backwards, and its preemption windows (intervals between two samples in which preemptions rose,
kept for ``preemption_memory_s``), which tell whether a finished request's longest gap was a stall.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvwatch.derive import counters, pool
from kvwatch.derive.fragmentation import Fragmentation, replica_fragmentation
from kvwatch.derive.headroom import Headroom, headroom
from kvwatch.derive.overcommit import Overcommit, overcommitted_requests
from kvwatch.derive.recompute import (
    PreemptionWindow,
    RecomputeEstimate,
    accumulate_recompute,
    preemption_rate,
    recomputed_tokens,
    remember_preemptions,
)
from kvwatch.derive.stranded import Stranded, stranded_capacity
from kvwatch.derive.tiers import (
    BusThresholds,
    GpuLink,
    TierLink,
    TierPayback,
    TierRate,
    gpu_link,
    tier_links,
    tier_payback,
    tier_rates,
)
from kvwatch.model import GpuSample, InFlightRequest, ReplicaSample

T = TypeVar("T")
UnitKey = tuple[str, str | None, str | None]  # ReplicaSample.key: (replica, model_name, dp_rank)


@dataclass(frozen=True, slots=True)
class DerivedSettings:
    """Tunables of the derived signals (defaults documented in docs/kv-signals.md)."""

    rate_window_s: float = 30.0
    max_history: int = 64  # samples kept per unit, whatever the window
    preemption_memory_s: float = 3600.0  # preemption windows kept per unit (longer than most requests)
    max_preemption_windows: int = 256
    include_admissions: bool = True  # headroom counts admitted prompt tokens as growth
    bus: BusThresholds = field(default_factory=BusThresholds)


@dataclass(frozen=True, slots=True)
class NodeInputs:
    samples: tuple[ReplicaSample, ...]  # current samples of targets that are up
    gpus: tuple[GpuSample, ...] = ()
    replica_gpus: Mapping[str, Sequence[tuple[str, str, str]]] = field(default_factory=dict)
    in_flight: tuple[InFlightRequest, ...] = ()
    proxied: Collection[str] = ()  # replicas a kvwatch proxy fronts
    kv_bytes_per_token: Mapping[str, float] = field(default_factory=dict)  # per replica, on one GPU
    link_bandwidth: Callable[[int, int], float | None] | None = None  # (PCIe gen, width) -> bytes/s


@dataclass(frozen=True, slots=True)
class UnitSignals:
    """Per replica and DP rank signals; ``sample`` is the current sample (identity and inputs)."""

    sample: ReplicaSample
    headroom: Headroom
    preemptions_per_second: float | None
    recomputed_tokens: float | None
    recomputed_source: str
    #: the KV pool in tokens (``derive.pool``): slots requests can hold, slots held, slots free
    usable_tokens: float | None = None
    allocated_tokens: float | None = None
    free_tokens: float | None = None


@dataclass(frozen=True, slots=True)
class ReplicaOvercommit:
    replica: str
    model_name: str | None
    backend: str
    dp_rank: str | None  # the rank when the replica has one, else None (replica level)
    overcommit: Overcommit


@dataclass(frozen=True, slots=True)
class DerivedView:
    computed_at: float
    fragmentation: tuple[Fragmentation, ...] = ()
    units: tuple[UnitSignals, ...] = ()
    overcommit: tuple[ReplicaOvercommit, ...] = ()
    stranded: tuple[Stranded, ...] = ()
    tier_links: tuple[TierLink, ...] = ()
    #: every polled GPU's PCIe rates over the rate window and link state (needs ``link_bandwidth``)
    gpu_links: tuple[GpuLink, ...] = ()
    # memory for the next call
    history: Mapping[UnitKey, tuple[ReplicaSample, ...]] = field(default_factory=dict)
    gpu_history: Mapping[str, tuple[GpuSample, ...]] = field(default_factory=dict)
    recompute: Mapping[UnitKey, RecomputeEstimate] = field(default_factory=dict)
    preemptions: Mapping[UnitKey, tuple[PreemptionWindow, ...]] = field(default_factory=dict)
    #: per replica with KV tier counters: recompute avoided and bytes moved over the rate window
    tier_payback: tuple[TierPayback, ...] = ()

    def baseline(self, key: UnitKey) -> ReplicaSample | None:
        """The sample rates of this unit are measured from (None with fewer than two samples)."""
        return _oldest_of_two(self.history.get(key, ()))

    def gpu_baseline(self, uuid: str) -> GpuSample | None:
        """The GPU poll PCIe rates are measured from (None with fewer than two polls)."""
        return _oldest_of_two(self.gpu_history.get(uuid, ()))

    def preemption_windows(self, replica: str) -> list[PreemptionWindow]:
        """Preemption windows of every unit (model, DP rank) of a replica, oldest first."""
        found = [w for key, kept in self.preemptions.items() if key[0] == replica for w in kept]
        return sorted(found, key=lambda w: w.start)


def _oldest_of_two(kept: Sequence[T]) -> T | None:
    """A rate baseline: the oldest kept item once two are kept (one alone gives no rate)."""
    return kept[0] if len(kept) >= 2 else None


def keep_window(
    history: tuple[T, ...], newest: T, at: Callable[[T], float], window_s: float, max_items: int
) -> tuple[T, ...]:
    """Append ``newest`` (unless it is the last one already) and drop what the window no longer needs.

    Keeps every item within ``window_s`` of the newest plus the newest one before that, so the
    oldest kept item spans at least the window once the history is deep enough.
    """
    if history and at(history[-1]) == at(newest):
        items = (*history[:-1], newest)
    elif history and at(newest) < at(history[-1]):
        items = (newest,)  # time went backwards: start over rather than compute negative rates
    else:
        items = (*history, newest)
    edge = at(newest) - window_s
    first = 0
    for i, item in enumerate(items):
        if at(item) <= edge:
            first = i
    return items[max(first, len(items) - max_items) :]


def _scraped_at(sample: ReplicaSample) -> float:
    return sample.scraped_at


def _sampled_at(gpu: GpuSample) -> float:
    return gpu.sampled_at


def derive_node(
    previous: DerivedView | None,
    inputs: NodeInputs,
    now: float,
    settings: DerivedSettings = DerivedSettings(),
) -> DerivedView:
    """The node's derived signals now, and the memory for the next call."""
    prev = previous or DerivedView(computed_at=now)
    history = {
        s.key: keep_window(
            prev.history.get(s.key, ()), s, _scraped_at, settings.rate_window_s, settings.max_history
        )
        for s in inputs.samples
    }
    gpu_history = {
        g.uuid: keep_window(
            prev.gpu_history.get(g.uuid, ()), g, _sampled_at, settings.rate_window_s, settings.max_history
        )
        for g in inputs.gpus
        if not g.lost
    }
    view = DerivedView(now, history=history, gpu_history=gpu_history)
    preemptions = _preemptions(prev, inputs.samples, now, settings)

    by_replica: dict[str, list[ReplicaSample]] = {}
    for sample in inputs.samples:
        by_replica.setdefault(sample.replica, []).append(sample)
    in_flight: dict[str, list[InFlightRequest]] = {}
    for request in inputs.in_flight:
        in_flight.setdefault(request.replica, []).append(request)

    fragmentation = [
        f
        for name, samples in by_replica.items()
        for f in replica_fragmentation(samples, in_flight.get(name, ()), name in inputs.proxied)
    ]
    recompute = dict(prev.recompute)
    units = []
    for sample in inputs.samples:
        baseline = view.baseline(sample.key)
        estimate = recompute[sample.key] = accumulate_recompute(
            prev.recompute.get(sample.key, RecomputeEstimate()),
            sample.preemptions_total,
            _tokens_per_running(sample, fragmentation),
        )
        value, source = recomputed_tokens(sample, estimate)
        units.append(
            UnitSignals(
                sample,
                headroom(sample, baseline, settings.include_admissions),
                preemption_rate(sample, baseline),
                value,
                source,
                pool.usable_tokens(sample),
                pool.allocated_tokens(sample),
                pool.free_tokens(sample),
            )
        )
    baselines = {s.key: b for s in inputs.samples if (b := view.baseline(s.key)) is not None}
    stranded = stranded_capacity(inputs.samples, baselines)
    overcommit = [
        o
        for name, samples in by_replica.items()
        if name in inputs.proxied
        if (o := _replica_overcommit(samples, in_flight.get(name, ()))) is not None
    ]
    gpu_links = _gpu_links(view, inputs, settings)
    links = [
        link
        for name, samples in by_replica.items()
        for link in _replica_links(name, samples, view, inputs, gpu_links, settings)
    ]
    payback = [
        p
        for name, samples in by_replica.items()
        if (p := _replica_payback(name, samples, view, inputs)) is not None
    ]
    return DerivedView(
        now,
        tuple(fragmentation),
        tuple(units),
        tuple(overcommit),
        tuple(stranded.values()),
        tuple(links),
        tuple(gpu_links.values()),
        history,
        gpu_history,
        recompute,
        preemptions,
        tuple(payback),
    )


def _preemptions(
    prev: DerivedView, samples: Sequence[ReplicaSample], now: float, settings: DerivedSettings
) -> dict[UnitKey, tuple[PreemptionWindow, ...]]:
    """Every unit's preemption windows after this call (absent units keep theirs until they age out)."""
    keep_since = now - settings.preemption_memory_s
    sampled = {s.key for s in samples}
    out = {
        key: fresh
        for key, kept in prev.preemptions.items()
        if key not in sampled
        if (fresh := tuple(w for w in kept if w.end >= keep_since))
    }
    for sample in samples:
        before = prev.history.get(sample.key, ())
        kept = remember_preemptions(
            prev.preemptions.get(sample.key, ()),
            before[-1] if before else None,
            sample,
            keep_since,
            settings.max_preemption_windows,
        )
        if kept:
            out[sample.key] = kept
    return out


def _tokens_per_running(sample: ReplicaSample, fragmentation: Sequence[Fragmentation]) -> float | None:
    """Mean tokens a running request of this unit holds: live tokens, else allocated slots."""
    running = sample.requests_running
    if not running:
        return None
    for f in fragmentation:
        if (f.replica, f.model_name, f.dp_rank) == sample.key and f.live_tokens is not None:
            return f.live_tokens / running
    allocated = pool.allocated_tokens(sample)
    return None if allocated is None else allocated / running


def _replica_overcommit(
    samples: Sequence[ReplicaSample], requests: Sequence[InFlightRequest]
) -> ReplicaOvercommit | None:
    capacity = counters.total(pool.usable_tokens(s) for s in samples)
    if capacity is None:
        return None
    first = samples[0]
    result = overcommitted_requests(
        requests, capacity, first.block_size, counters.total(s.requests_running for s in samples)
    )
    rank = first.dp_rank if len(samples) == 1 else None
    return ReplicaOvercommit(first.replica, first.model_name, first.backend, rank, result)


def _gpu_links(view: DerivedView, inputs: NodeInputs, settings: DerivedSettings) -> dict[str, GpuLink]:
    """uuid -> PCIe rates and link state of every GPU polled now (none without ``link_bandwidth``)."""
    if inputs.link_bandwidth is None:
        return {}
    return {
        g.uuid: gpu_link(g, view.gpu_baseline(g.uuid), inputs.link_bandwidth, settings.bus)
        for g in sorted(inputs.gpus, key=lambda g: g.index)
        if not g.lost
    }


def _replica_links(
    name: str,
    samples: Sequence[ReplicaSample],
    view: DerivedView,
    inputs: NodeInputs,
    gpu_links: Mapping[str, GpuLink],
    settings: DerivedSettings,
) -> list[TierLink]:
    mapped = inputs.replica_gpus.get(name, ())
    if not mapped or not gpu_links:
        return []
    gpus: list[GpuLink] = []
    for _index, uuid, _mapped_by in mapped:
        link = gpu_links.get(uuid)
        if link is None:
            return []  # a mapped GPU is lost or unpolled: the sum over the replica's links is unknown
        gpus.append(link)
    unit_rates = _unit_tier_rates(name, samples, view, inputs)
    return [] if unit_rates is None else tier_links(name, unit_rates, gpus, settings.bus)


def _unit_tier_rates(
    name: str, samples: Sequence[ReplicaSample], view: DerivedView, inputs: NodeInputs
) -> list[list[TierRate]] | None:
    """Tier rates of each DP rank of a replica; None until every rank has a baseline."""
    kv_bytes = inputs.kv_bytes_per_token.get(name)
    mapped = inputs.replica_gpus.get(name, ())
    # per GPU -> per DP rank: every GPU of a rank (TP/PP) holds and moves its share of each token;
    # unknown without the GPU mapping (then only families that count tokens and bytes give both)
    kv_bytes = kv_bytes * len(mapped) / len(samples) if kv_bytes is not None and mapped else None
    unit_rates = []
    for sample in samples:
        baseline = view.baseline(sample.key)
        if baseline is None:
            return None  # no rate for this rank yet
        unit_rates.append(tier_rates(sample, baseline, kv_bytes))
    return unit_rates


def _replica_payback(
    name: str, samples: Sequence[ReplicaSample], view: DerivedView, inputs: NodeInputs
) -> TierPayback | None:
    if not any(s.tier_traffic for s in samples):
        return None
    unit_rates = _unit_tier_rates(name, samples, view, inputs)
    return None if unit_rates is None else tier_payback(name, unit_rates)
