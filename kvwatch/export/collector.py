"""The node's /metrics: one custom Collector composed of small per-area collectors.

Each area collector is a class ``XCollector(state, config)`` with ``collect() -> Iterator[Metric]``
that only reads ``NodeState``. The node collector times each one and reports
``kvwatch_collector_success{collector="export_<area>"}`` and ``kvwatch_collector_duration_seconds``;
an area that raises is logged and reported as failed, the rest of the scrape still renders
(dcgm-exporter answers 500 for the whole scrape instead).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvwatch.config import Config
from kvwatch.state import NodeState

log = logging.getLogger(__name__)


class AreaCollector(Protocol):
    def collect(self) -> Iterator[Metric]: ...


class NodeCollector(Collector):
    """Renders the current state at scrape time; nothing is mutated while rendering."""

    def __init__(self, state: NodeState, config: Config, areas: dict[str, AreaCollector]) -> None:
        self.state = state
        self.config = config
        self.areas = areas

    def describe(self) -> list[Metric]:
        return []  # no collect at registration time

    def collect(self) -> Iterator[Metric]:
        from kvwatch.export.self_metrics import SelfCollector

        for name, area in self.areas.items():
            started = time.perf_counter()
            try:
                families = list(area.collect())
            except Exception as exc:  # one area must never fail the scrape
                log.exception("export area %s failed", name)
                self.state.report(f"export_{name}", False, time.perf_counter() - started, repr(exc))
                continue
            self.state.report(f"export_{name}", True, time.perf_counter() - started)
            yield from families
        yield from SelfCollector(self.state, self.config).collect()
