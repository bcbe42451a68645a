"""kvwatch's report on itself: build info, collector success/duration, source staleness."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import Metric

from kvwatch import __version__
from kvwatch.catalog import spec
from kvwatch.config import Config
from kvwatch.state import NodeState

#: self counters kept in ``NodeState.counters`` and exported as-is (family, label names)
_SELF_COUNTERS = (
    ("kvwatch_proxy_accounting_errors", ("replica",)),
    ("kvwatch_proxy_connections_timed_out", ("replica",)),
    ("kvwatch_proxy_requests_shed", ("replica", "reason")),
    ("kvwatch_proxy_accept_errors", ("replica",)),
    ("kvwatch_proxy_usage_injection_refused", ("replica",)),
    ("kvwatch_proxy_requests_refused", ("replica", "status")),
    ("kvwatch_proxy_refusals_undelivered", ("replica", "status")),
    ("kvwatch_proxy_worker_restarts", ()),
    ("kvwatch_proxy_worker_records_lost", ("replica", "reason")),
    ("kvwatch_proxy_worker_datagrams_refused", ()),
    ("kvwatch_otlp_spans", ("result",)),
    ("kvwatch_otlp_exports_refused", ("reason",)),
    ("kvwatch_request_file_lines", ("replica", "result")),
    ("kvwatch_request_values_dropped", ("replica", "source", "reason")),
    ("kvwatch_ledger_write_errors", ()),
    ("kvwatch_vllm_plugin_datagrams", ("replica", "result")),
    ("kvwatch_vllm_plugin_refused_requests", ("replica", "reason")),
)
#: discovery's counters, exported while Kubernetes discovery is on
_DISCOVERY_COUNTERS = (
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
        info = spec("kvwatch_build").info()
        info.add_metric(
            [],
            {
                "version": __version__,
                "python": platform.python_version(),
                "nvidia_ml_py": _nvml_bindings_version(),
                "node": self.state.node,
            },
        )
        yield info

        success = spec("kvwatch_collector_success").gauge()
        duration = spec("kvwatch_collector_duration_seconds").gauge()
        last = spec("kvwatch_source_last_success_timestamp_seconds").gauge()
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

        for family, _labels in _SELF_COUNTERS:
            counter = spec(family).counter()
            for label_values, value in sorted(self.state.counters_for(family)):
                counter.add_metric(list(label_values), value)
            yield counter
        yield from self._reloads()
        yield from self._discovery()
        yield from self._unattributed_grants()

    def _reloads(self) -> Iterator[Metric]:
        reload = self.state.config_reload
        if reload.last_success_ts is None:
            return
        ok = spec("kvwatch_config_last_reload_successful").gauge()
        ok.add_metric([], 1.0 if reload.successful else 0.0)
        stamp = spec("kvwatch_config_last_reload_success_timestamp_seconds").gauge()
        stamp.add_metric([], reload.last_success_ts)
        yield from (ok, stamp)

    def _unattributed_grants(self) -> Iterator[Metric]:
        counts = self.state.gpu_grants_unattributed
        if counts is None:
            return
        family = spec("kvwatch_gpu_grants_unattributed").gauge()
        for reason, count in sorted(counts.items()):
            family.add_metric([reason], float(count))
        yield family

    def _discovery(self) -> Iterator[Metric]:
        found = self.state.discovery
        if found is None:
            return
        stale = spec("kvwatch_discovery_stale").gauge()
        stale.add_metric([], 1.0 if found.stale else 0.0)
        replicas = spec("kvwatch_discovery_replicas").gauge()
        replicas.add_metric([], float(len(found.replicas)))
        ready = spec("kvwatch_discovery_replica_ready").gauge()
        for replica, is_ready in sorted(found.ready.items()):
            ready.add_metric([replica], 1.0 if is_ready else 0.0)
        problems = spec("kvwatch_discovery_pod_annotation_errors").gauge()
        for (namespace, pod), issues in sorted(found.problems.items()):
            for annotation in sorted({a for a, _ in issues}):
                problems.add_metric([namespace, pod, annotation], 1.0)
        yield from (stale, replicas, ready, problems)
        for family in _DISCOVERY_COUNTERS:
            counter = spec(family).counter()
            for label_values, value in sorted(self.state.counters_for(family)):
                counter.add_metric(list(label_values), value)
            yield counter
