"""Engine replicas as the engines report them (catalog area ``replica``), plus each target's health.

Only samples of targets that are up are rendered: a target whose last scrape failed drops out of
every replica family at once (``kvwatch_target_up`` says 0) instead of repeating stale values. A field
the engine does not expose (None) produces no series. ``dp_rank`` is "" for engines without ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from operator import attrgetter

from prometheus_client.core import Metric

from kvwatch.catalog import REJECTED_SAMPLE_REASONS, SCRAPE_ERROR_REASONS, MetricSpec, spec_rows
from kvwatch.config import Config
from kvwatch.derive import pool
from kvwatch.export.families import (
    ENGINE_FINISHED_REQUESTS,
    KV_CAPACITY_BYTES,
    KV_FREE_TOKENS,
    REPLICA_INFO,
    TARGET_RESTARTS,
    TARGET_SAMPLES_REJECTED,
    TARGET_SCRAPE_DURATION_SECONDS,
    TARGET_SCRAPE_ERRORS,
    TARGET_UP,
)
from kvwatch.model import ReplicaSample
from kvwatch.state import NodeState

#: gauge family -> ReplicaSample attribute
GAUGES: tuple[tuple[MetricSpec, str], ...] = spec_rows(
    ("kvwatch_kv_capacity_tokens", "kv_capacity_tokens"),
    ("kvwatch_kv_block_size_tokens", "block_size"),
    ("kvwatch_kv_usage_ratio", "kv_usage_ratio"),
    ("kvwatch_kv_used_blocks", "kv_used_blocks"),
    ("kvwatch_kv_used_tokens", "kv_used_tokens"),
    ("kvwatch_kv_evictable_tokens", "kv_evictable_tokens"),
    ("kvwatch_requests_running", "requests_running"),
    ("kvwatch_requests_waiting", "requests_waiting"),
)

#: counter family -> ReplicaSample attribute
COUNTERS: tuple[tuple[MetricSpec, str], ...] = spec_rows(
    ("kvwatch_preemptions", "preemptions_total"),
    ("kvwatch_prompt_tokens", "prompt_tokens_total"),
    ("kvwatch_generation_tokens", "generation_tokens_total"),
    ("kvwatch_prefix_cache_queried_tokens", "prefix_cache_queries_total"),
    ("kvwatch_prefix_cache_hit_tokens", "prefix_cache_hits_total"),
)

#: tier counter family -> TierTraffic attribute
TIER_COUNTERS: tuple[tuple[MetricSpec, str], ...] = spec_rows(
    ("kvwatch_kv_tier_transfer_bytes", "bytes_total"),
    ("kvwatch_kv_tier_transfer_tokens", "tokens_total"),
    ("kvwatch_kv_tier_transfer_blocks", "blocks_total"),
    ("kvwatch_kv_tier_transfer_seconds", "seconds_total"),
)


def replica_label_values(
    replica: str, model_name: str | None, backend: str, dp_rank: str | None
) -> list[str]:
    """Values of catalog.REPLICA (replica, model_name, backend, dp_rank); "" for no model or rank."""
    return [replica, model_name or "", backend, dp_rank or ""]


def replica_labels(s: ReplicaSample) -> list[str]:
    """Values of catalog.REPLICA for a sample."""
    return replica_label_values(s.replica, s.model_name, s.backend, s.dp_rank)


def capacity_bytes(s: ReplicaSample, kv_bytes_per_token: float | None) -> float | None:
    """KV pool bytes on one GPU: capacity tokens x KV bytes per token (both per GPU), when known."""
    if s.kv_capacity_tokens is None or kv_bytes_per_token is None:
        return None
    return s.kv_capacity_tokens * kv_bytes_per_token


def per_sample(
    family: MetricSpec, samples: list[ReplicaSample], value: Callable[[ReplicaSample], float | None]
) -> Metric:
    """A gauge or counter family (as the catalog says) with one series per sample that has a value."""
    metric = family.counter() if family.kind == "counter" else family.gauge()
    for s in samples:
        v = value(s)
        if v is not None:
            metric.add_metric(replica_labels(s), float(v))
    return metric


class ReplicaCollector:
    """Const families for live replica samples and per-target scrape health."""

    def __init__(self, state: NodeState, config: Config) -> None:
        self.state = state
        self.config = config

    def collect(self) -> Iterator[Metric]:
        samples = self.state.live_samples()
        yield from self._identity(samples)
        yield from self._gauges(samples)
        yield from self._counters(samples)
        yield from self._tiers(samples)
        yield from self._targets()

    def _identity(self, samples: list[ReplicaSample]) -> Iterator[Metric]:
        info = REPLICA_INFO.info()
        for s in samples:
            info.add_metric([*replica_labels(s), s.version_hint or "", s.cache_dtype or ""], {})
        yield info

    def _gauges(self, samples: list[ReplicaSample]) -> Iterator[Metric]:
        for family, attr in GAUGES:
            yield per_sample(family, samples, attrgetter(attr))
        yield per_sample(KV_FREE_TOKENS, samples, pool.free_tokens)
        yield per_sample(
            KV_CAPACITY_BYTES,
            samples,
            lambda s: capacity_bytes(s, self.config.kv_bytes_per_token(s)),
        )

    def _counters(self, samples: list[ReplicaSample]) -> Iterator[Metric]:
        for family, attr in COUNTERS:
            yield per_sample(family, samples, attrgetter(attr))
        finished = ENGINE_FINISHED_REQUESTS.counter()
        for s in samples:
            for reason, value in s.finished_requests_total:
                finished.add_metric([*replica_labels(s), reason], value)
        yield finished

    def _tiers(self, samples: list[ReplicaSample]) -> Iterator[Metric]:
        for family, attr in TIER_COUNTERS:
            counter = family.counter()
            for s in samples:
                for t in s.tier_traffic:
                    value = getattr(t, attr)
                    if value is not None:
                        counter.add_metric([*replica_labels(s), t.family, t.src_tier, t.dst_tier], value)
            yield counter

    def _targets(self) -> Iterator[Metric]:
        up = TARGET_UP.gauge()
        duration = TARGET_SCRAPE_DURATION_SECONDS.gauge()
        errors = TARGET_SCRAPE_ERRORS.counter()
        restarts = TARGET_RESTARTS.counter()
        rejected = TARGET_SAMPLES_REJECTED.counter()
        for name, target in sorted(dict(self.state.targets).items()):
            up.add_metric([name, self._backend(name, target.backend)], 1.0 if target.up else 0.0)
            duration.add_metric([name], target.scrape_duration_s)
            for reason in SCRAPE_ERROR_REASONS:  # every reason from the start, so rate() sees the first error
                errors.add_metric([name, reason], float(target.errors.get(reason, 0)))
            restarts.add_metric([name], float(target.restarts))
            for reason in REJECTED_SAMPLE_REASONS:
                rejected.add_metric([name, reason], float(target.rejected_samples.get(reason, 0)))
        yield from (up, duration, errors, restarts, rejected)

    def _backend(self, name: str, scraped: str) -> str:
        """The detected backend; before the first good scrape, the configured one (if not auto)."""
        if scraped != "unknown":
            return scraped
        cfg = self.config.replica(name)
        return cfg.backend if cfg is not None and cfg.backend != "auto" else scraped
