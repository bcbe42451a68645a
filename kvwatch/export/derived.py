"""Derived KV signals on /metrics (catalog area "derived"), read from ``NodeState.derived``.

The view is computed by ``kvwatch.agent.derived.update_derived`` after each scrape; this collector only
renders it. A value is exported only while the target it was computed from is up and the unit
(replica, model, DP rank) still exists there, so nothing derived from a down target is served.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import Metric

from kvwatch.config import Config
from kvwatch.derive.node import DerivedView, UnitKey
from kvwatch.export.families import (
    KV_FRAGMENTATION_RATIO,
    KV_HEADROOM_SECONDS,
    KV_LIVE_TOKENS,
    KV_OVERCOMMITTED_REQUESTS,
    KV_STRANDED_TOKENS,
    KV_TIER_LINK_CONDITION,
    KV_TIER_LINK_UTILIZATION_RATIO,
    KV_TIER_RECOMPUTE_AVOIDED_TOKENS_PER_BYTE,
    RECOMPUTED_TOKENS,
)
from kvwatch.export.replicas import replica_label_values
from kvwatch.state import NodeState

#: the recompute the vLLM plugin measured: exact, or an upper bound (older vLLM, see PluginUnit)
PLUGIN_EXACT, PLUGIN_UPPER_BOUND = "vllm_plugin", "vllm_plugin_upper_bound"


def exact_recompute(state: NodeState) -> dict[tuple[str, str | None], tuple[int, str]]:
    """(replica, dp_rank) -> (tokens re-prefilled after preemption, source label), where the vLLM
    plugin said; none where vLLM could not count them (prefix caching off, no KV connector)."""
    return {
        key: (unit.recomputed_tokens, PLUGIN_UPPER_BOUND if unit.recompute_upper_bound else PLUGIN_EXACT)
        for key, unit in state.plugin.snapshot().items()
        if unit.recomputed_tokens is not None
    }


TIER_CONDITIONS = ("offload_pcie_bound", "link_down_trained", "foreign_bus_traffic")


def _present(
    replica: str, model_name: str | None, dp_rank: str | None, units: set[UnitKey], up: set[str]
) -> bool:
    """A per-rank value needs its rank still scraped; a replica-level one needs the replica up."""
    return (replica, model_name, dp_rank) in units if dp_rank is not None else replica in up


class DerivedCollector:
    def __init__(self, state: NodeState, config: Config) -> None:
        self.state = state
        self.config = config

    def collect(self) -> Iterator[Metric]:
        view = self.state.derived or DerivedView(computed_at=0.0)
        units = {s.key for s in self.state.live_samples()}
        up = {key[0] for key in units}
        yield from self._fragmentation(view, units, up)
        yield from self._units(view, units, exact_recompute(self.state))
        yield from self._overcommit(view, units, up)
        yield from self._stranded(view, up)
        yield from self._tier_links(view, up)
        yield from self._tier_payback(view, up)

    @staticmethod
    def _fragmentation(view: DerivedView, units: set[UnitKey], up: set[str]) -> Iterator[Metric]:
        live = KV_LIVE_TOKENS.gauge()
        ratio = KV_FRAGMENTATION_RATIO.gauge()
        for f in view.fragmentation:
            if (
                not _present(f.replica, f.model_name, f.dp_rank, units, up)
                or f.live_tokens is None
                or f.source is None
            ):
                continue
            labels = [*replica_label_values(f.replica, f.model_name, f.backend, f.dp_rank), f.source]
            live.add_metric(labels, f.live_tokens)
            if f.ratio is not None:
                ratio.add_metric(labels, f.ratio)
        yield live
        yield ratio

    @staticmethod
    def _units(
        view: DerivedView, units: set[UnitKey], exact: dict[tuple[str, str | None], tuple[int, str]]
    ) -> Iterator[Metric]:
        headroom = KV_HEADROOM_SECONDS.gauge()
        recomputed = RECOMPUTED_TOKENS.counter()
        for u in view.units:
            s = u.sample
            if s.key not in units:
                continue
            labels = replica_label_values(s.replica, s.model_name, s.backend, s.dp_rank)
            if u.headroom.seconds is not None:
                headroom.add_metric(labels, u.headroom.seconds)
            plugin = exact.get((s.replica, s.dp_rank)) if u.recomputed_source != "engine" else None
            if plugin is not None:
                recomputed.add_metric([*labels, plugin[1]], float(plugin[0]))
            # the exact figure replaces the estimate; an upper bound is no better than it: both stay
            if (plugin is None or plugin[1] == PLUGIN_UPPER_BOUND) and u.recomputed_tokens is not None:
                recomputed.add_metric([*labels, u.recomputed_source], u.recomputed_tokens)
        yield headroom
        yield recomputed

    @staticmethod
    def _overcommit(view: DerivedView, units: set[UnitKey], up: set[str]) -> Iterator[Metric]:
        family = KV_OVERCOMMITTED_REQUESTS.gauge()
        for o in view.overcommit:
            if _present(o.replica, o.model_name, o.dp_rank, units, up):
                family.add_metric(
                    replica_label_values(o.replica, o.model_name, o.backend, o.dp_rank), o.overcommit.requests
                )
        yield family

    @staticmethod
    def _stranded(view: DerivedView, up: set[str]) -> Iterator[Metric]:
        family = KV_STRANDED_TOKENS.gauge()
        for s in view.stranded:
            if all(r in up for r in s.replicas):
                family.add_metric([s.model_name], s.stranded_tokens)
        yield family

    @staticmethod
    def _tier_links(view: DerivedView, up: set[str]) -> Iterator[Metric]:
        utilization = KV_TIER_LINK_UTILIZATION_RATIO.gauge()
        condition = KV_TIER_LINK_CONDITION.gauge()
        for link in view.tier_links:
            if link.replica not in up:
                continue
            ratio = link.link_utilization
            if ratio is not None and math.isfinite(ratio):
                utilization.add_metric([link.replica, link.direction], ratio)
            for name in TIER_CONDITIONS:
                flag = getattr(link, name)
                if flag is not None:
                    condition.add_metric([link.replica, link.direction, name], float(flag))
        yield utilization
        yield condition

    @staticmethod
    def _tier_payback(view: DerivedView, up: set[str]) -> Iterator[Metric]:
        family = KV_TIER_RECOMPUTE_AVOIDED_TOKENS_PER_BYTE.gauge()
        for p in view.tier_payback:
            ratio = p.tokens_per_byte
            if p.replica in up and ratio is not None and math.isfinite(ratio):
                family.add_metric([p.replica], ratio)
        yield family
