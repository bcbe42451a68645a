"""Every counter kvwatch keeps about itself reaches /metrics once its event has happened: a family
cannot be catalogued, counted by a source, and never exported."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.catalog import CATALOG
from kvwatch.config import Config
from kvwatch.export.collector import NodeCollector
from kvwatch.export.encode import TextEncoder
from kvwatch.export.server import make_registry
from kvwatch.state import NodeState

#: self counters that are not NodeState counters: prometheus_client's, the per-target ones kept on the
#: target (export/replicas.py), and discovery's (exported while discovery is on)
NOT_COUNTED = {
    "process_cpu_seconds",
    "kvwatch_target_scrape_errors",
    "kvwatch_target_samples_rejected",
    "kvwatch_target_restarts",
}
DISCOVERY = {"kvwatch_discovery_watch_events", "kvwatch_discovery_watch_errors", "kvwatch_discovery_relists"}
SELF_COUNTERS = [
    s for s in CATALOG if s.area == "self" and s.kind == "counter" and s.name not in NOT_COUNTED | DISCOVERY
]


@pytest.mark.parametrize("family", SELF_COUNTERS, ids=lambda s: s.name)
def test_a_counted_self_family_is_on_metrics(family) -> None:
    state = NodeState("node-a", Config().length_bands)
    labels = tuple(f"v{i}" for i in range(len(family.labels)))
    state.count(family.name, *labels)  # what every source does when the event happens
    text = TextEncoder().encode(make_registry(NodeCollector(state, Config(), {}))).decode()
    wanted = dict(zip(family.labels, labels, strict=True))
    values = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == f"{family.name}_total" and s.labels == wanted
    ]
    assert values == [1.0]
