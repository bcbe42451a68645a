"""A /metrics render reads NodeState and writes nothing into it (scrape time reads,
never writes). Export-area success and duration are yielded by the same scrape, as node_exporter's
``node_scrape_collector_success`` are, and a failing area shows success 0 while the rest renders."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

import httpx
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.export.collector import NodeCollector
from kvwatch.export.derived import DerivedCollector
from kvwatch.export.gpus import GpuCollector
from kvwatch.export.plugin import PluginCollector
from kvwatch.export.replicas import ReplicaCollector
from kvwatch.export.requests import RequestCollector
from kvwatch.export.server import make_registry, metrics_app
from kvwatch.state import NodeState
from tests.local import serving

from .node import full_node

_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


def snapshot(value: Any, seen: set[int] | None = None) -> Any:
    """Every value reachable from ``value`` as plain nested data (locks left out), to compare."""
    seen = set() if seen is None else seen
    if isinstance(value, (str, int, float, bool, bytes, type(None))):
        return value
    if isinstance(value, _LOCK_TYPES):
        return "<lock>"
    if id(value) in seen:
        return "<seen>"
    seen.add(id(value))
    if isinstance(value, dict):
        return sorted(((repr(k), snapshot(v, seen)) for k, v in value.items()), key=lambda kv: kv[0])
    if isinstance(value, (list, tuple, deque, set, frozenset)):
        items = [snapshot(v, seen) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if is_dataclass(value):
        return (
            type(value).__name__,
            [(f.name, snapshot(getattr(value, f.name), seen)) for f in fields(value)],
        )
    attrs = getattr(value, "__dict__", None)
    slots = [s for cls in type(value).__mro__ for s in getattr(cls, "__slots__", ())]
    if attrs is None and not slots:
        return repr(value)
    data = dict(attrs or {})
    data.update({s: getattr(value, s) for s in slots if hasattr(value, s)})
    return (type(value).__name__, sorted((k, snapshot(v, seen)) for k, v in data.items()))


class Broken:
    def collect(self) -> Iterator[Metric]:
        yield from ()  # a generator, as collect() is: it raises on the first next()
        raise RuntimeError("this area is broken")


def _areas(state: NodeState, config: Any, broken: bool) -> dict[str, Any]:
    areas: dict[str, Any] = {
        "replicas": ReplicaCollector(state, config),
        "derived": DerivedCollector(state, config),
        "gpus": GpuCollector(state, config),
        "requests": RequestCollector(state, config),
        "plugin": PluginCollector(state, config),
    }
    if broken:
        areas["gpus"] = Broken()
    return areas


async def _scrape_twice(state: NodeState, config: Any, broken: bool) -> list[str]:
    registry = make_registry(NodeCollector(state, config, _areas(state, config, broken)))
    app = metrics_app(registry, lambda: True)
    async with serving(app, access_log=None) as base, httpx.AsyncClient() as client:
        return [(await client.get(f"{base}/metrics", timeout=10)).text for _ in range(2)]


def _collector_values(text: str, family: str) -> dict[str, float]:
    for metric in text_string_to_metric_families(text):
        if metric.name == family:
            return {s.labels["collector"]: s.value for s in metric.samples}
    raise AssertionError(f"{family} not rendered")


async def test_rendering_metrics_twice_leaves_the_state_unchanged() -> None:
    state, config = full_node(replicas=2)
    before = snapshot(state)
    first, second = await _scrape_twice(state, config, broken=False)
    assert snapshot(state) == before
    assert not any(name.startswith("export_") for name in state.collectors)
    success = _collector_values(second, "kvwatch_collector_success")
    assert {k: v for k, v in success.items() if k.startswith("export_")} == {
        f"export_{a}": 1.0 for a in ("replicas", "derived", "gpus", "requests", "plugin")
    }
    durations = _collector_values(second, "kvwatch_collector_duration_seconds")
    assert all(durations[f"export_{a}"] > 0 for a in ("replicas", "requests"))
    # the areas have no schedule to go stale against: no last-success time, only the sources have one
    last = {
        s.labels["source"]
        for m in text_string_to_metric_families(second)
        if m.name == "kvwatch_source_last_success_timestamp_seconds"
        for s in m.samples
    }
    assert last == set(state.collectors) and not any(n.startswith("export_") for n in last)
    assert "kvwatch_kv_usage_ratio{" in first and "kvwatch_kv_usage_ratio{" in second


async def test_a_failing_area_shows_success_0_and_the_rest_renders() -> None:
    state, config = full_node(replicas=2)
    before = snapshot(state)
    _first, text = await _scrape_twice(state, config, broken=True)
    assert snapshot(state) == before
    success = _collector_values(text, "kvwatch_collector_success")
    assert success["export_gpus"] == 0.0
    assert success["export_replicas"] == success["export_requests"] == 1.0
    assert "kvwatch_gpu_memory_used_bytes{" not in text  # the broken area's families are absent
    assert "kvwatch_kv_usage_ratio{" in text and "kvwatch_request_ttft_seconds_bucket{" in text


def test_the_snapshot_sees_a_write() -> None:
    """The comparison above could fail: a collector report or a counter changes the snapshot."""
    state, _config = full_node(replicas=1)
    before = snapshot(state)
    state.report("export_gpus", True, 0.1)
    assert snapshot(state) != before
    again = snapshot(state)
    state.count("kvwatch_otlp_spans", "request")
    assert snapshot(state) != again
