"""kvwatch's report on itself: build info, collector success/duration, source staleness."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import Metric

from kvwatch import __version__
from kvwatch.catalog import MetricSpec, specs
from kvwatch.config import Config
from kvwatch.export.families import (
    BUILD,
    COLLECTOR_DURATION_SECONDS,
    COLLECTOR_SUCCESS,
    CONFIG_LAST_RELOAD_SUCCESS_TIMESTAMP_SECONDS,
    CONFIG_LAST_RELOAD_SUCCESSFUL,
    DISCOVERY_POD_ANNOTATION_ERRORS,
    DISCOVERY_REPLICA_READY,
    DISCOVERY_REPLICAS,
    DISCOVERY_STALE,
    GPU_GRANTS_UNATTRIBUTED,
    SOURCE_LAST_SUCCESS_TIMESTAMP_SECONDS,
)
from kvwatch.state import NodeState

#: self counters kept in ``NodeState.counters`` (keyed by family name) and exported as-is
_SELF_COUNTERS: tuple[MetricSpec, ...] = specs(
    "kvwatch_proxy_accounting_errors",
    "kvwatch_proxy_connections_timed_out",
    "kvwatch_proxy_requests_shed",
    "kvwatch_proxy_accept_errors",
    "kvwatch_proxy_usage_injection_refused",
    "kvwatch_proxy_requests_refused",
    "kvwatch_proxy_refusals_undelivered",
    "kvwatch_proxy_worker_restarts",
    "kvwatch_proxy_worker_records_lost",
    "kvwatch_proxy_worker_datagrams_refused",
    "kvwatch_otlp_spans",
    "kvwatch_otlp_exports_refused",
    "kvwatch_request_file_lines",
    "kvwatch_request_values_dropped",
    "kvwatch_ledger_write_errors",
    "kvwatch_vllm_plugin_datagrams",
    "kvwatch_vllm_plugin_refused_requests",
)
#: discovery's counters, exported while Kubernetes discovery is on
_DISCOVERY_COUNTERS: tuple[MetricSpec, ...] = specs(
    "kvwatch_discovery_watch_events",
    "kvwatch_discovery_watch_errors",
    "kvwatch_discovery_relists",
)


def _nvml_bindings_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-ml-py")
    except Exception:
        return "none"


@dataclass(frozen=True, slots=True)
class AreaRun:
    """How one export area went in this very scrape (never stored: a render writes nothing)."""

    collector: str  # export_<area>
    success: bool
    duration_s: float


class SelfCollector:
    """Reads the sources' collector statuses (they write them via ``NodeState.report`` on their own
    schedule) and adds this scrape's export-area runs, which have no last-success time to go stale."""

    def __init__(self, state: NodeState, config: Config, area_runs: tuple[AreaRun, ...] = ()) -> None:
        self.state = state
        self.config = config
        self.area_runs = area_runs

    def collect(self) -> Iterator[Metric]:
        info = BUILD.info()
        info.add_metric(
            [__version__, platform.python_version(), _nvml_bindings_version(), self.state.node], {}
        )
        yield info

        success = COLLECTOR_SUCCESS.gauge()
        duration = COLLECTOR_DURATION_SECONDS.gauge()
        last = SOURCE_LAST_SUCCESS_TIMESTAMP_SECONDS.gauge()
        for name, status in sorted(list(self.state.collectors.items())):
            success.add_metric([name], 1.0 if status.success else 0.0)
            duration.add_metric([name], status.duration_s)
            if status.last_success_ts is not None:
                last.add_metric([name], status.last_success_ts)
        for run in self.area_runs:
            success.add_metric([run.collector], 1.0 if run.success else 0.0)
            duration.add_metric([run.collector], run.duration_s)
        yield success
        yield duration
        yield last

        yield from map(self._counted, _SELF_COUNTERS)
        yield from self._reloads()
        yield from self._discovery()
        yield from self._unattributed_grants()

    def _reloads(self) -> Iterator[Metric]:
        reload = self.state.config_reload
        if reload.last_success_ts is None:
            return
        ok = CONFIG_LAST_RELOAD_SUCCESSFUL.gauge()
        ok.add_metric([], 1.0 if reload.successful else 0.0)
        stamp = CONFIG_LAST_RELOAD_SUCCESS_TIMESTAMP_SECONDS.gauge()
        stamp.add_metric([], reload.last_success_ts)
        yield from (ok, stamp)

    def _unattributed_grants(self) -> Iterator[Metric]:
        counts = self.state.gpu_grants_unattributed
        if counts is None:
            return
        family = GPU_GRANTS_UNATTRIBUTED.gauge()
        for reason, count in sorted(counts.items()):
            family.add_metric([reason], float(count))
        yield family

    def _discovery(self) -> Iterator[Metric]:
        found = self.state.discovery
        if found is None:
            return
        stale = DISCOVERY_STALE.gauge()
        stale.add_metric([], 1.0 if found.stale else 0.0)
        replicas = DISCOVERY_REPLICAS.gauge()
        replicas.add_metric([], float(len(found.replicas)))
        ready = DISCOVERY_REPLICA_READY.gauge()
        for replica, is_ready in sorted(found.ready.items()):
            ready.add_metric([replica], 1.0 if is_ready else 0.0)
        problems = DISCOVERY_POD_ANNOTATION_ERRORS.gauge()
        for (namespace, pod), issues in sorted(found.problems.items()):
            for annotation in sorted({a for a, _ in issues}):
                problems.add_metric([namespace, pod, annotation], 1.0)
        yield from (stale, replicas, ready, problems)
        yield from map(self._counted, _DISCOVERY_COUNTERS)

    def _counted(self, family: MetricSpec) -> Metric:
        """A counter family as ``NodeState.count`` kept it."""
        counter = family.counter()
        for label_values, value in sorted(self.state.counters_for(family.name)):
            counter.add_metric(list(label_values), value)
        return counter
