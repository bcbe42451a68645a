"""The node's /metrics: one custom Collector composed of small per-area collectors.

Each area collector is a class ``XCollector(state, config)`` with ``collect() -> Iterator[Metric]``
that only reads ``NodeState``. The node collector times each one and yields
``kvwatch_collector_success{collector="export_<area>"}`` and ``kvwatch_collector_duration_seconds``
as const metrics of the same scrape, as node_exporter does with its ``node_scrape_collector_*``:
a render writes nothing into ``NodeState``. An area that raises is logged and shown as failed
(success 0), the rest of the scrape still renders (dcgm-exporter answers 500 for the whole scrape
instead).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvwatch.config import Config
from kvwatch.export.self_metrics import AreaRun, SelfCollector
from kvwatch.state import NodeState

log = logging.getLogger(__name__)


class AreaCollector(Protocol):
    def collect(self) -> Iterator[Metric]: ...


class NodeCollector(Collector):
    """Renders the current state at scrape time; nothing is mutated while rendering."""

    def __init__(self, state: NodeState, config: Config, areas: Mapping[str, AreaCollector]) -> None:
        self.state = state
        self.config = config
        self.areas = areas

    def describe(self) -> list[Metric]:
        return []  # no collect at registration time

    def collect(self) -> Iterator[Metric]:
        runs = []
        for name, area in self.areas.items():
            started = time.perf_counter()
            try:
                families = list(area.collect())
            except Exception:  # one area must never fail the scrape
                log.exception("export area %s failed", name)
                runs.append(AreaRun(f"export_{name}", False, time.perf_counter() - started))
                continue
            runs.append(AreaRun(f"export_{name}", True, time.perf_counter() - started))
            yield from families
        yield from SelfCollector(self.state, self.config, tuple(runs)).collect()
