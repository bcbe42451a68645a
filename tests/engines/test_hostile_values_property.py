"""Hostile sample values on real engine pages, through the agent's own steps: scrape, derive, render.

The exposition fuzz target (``fuzz/exposition.py``) checks the parser; this checks what comes after
it. Hypothesis takes a real captured page (vLLM, SGLang, llama.cpp) and rewrites the values of some
of its samples: NaN, ±Inf, negative, 1e308, 400 digits, tiny subnormals, any float. The page is
scraped twice (the capture, then the rewritten one, 15 s later: the engine's counters may now run
backwards, gauges may be absurd), through ``scrape_target`` against an httpx transport serving it,
``update_derived``, every export area of ``/metrics``, the status page, its strict ``status.json``
and ``kvwatch top`` reading it back. What must hold: the scrape never raises (a page it refuses is
counted, as any bad page), deriving never raises, every export area renders
(``kvwatch_collector_success{collector="export_*"}`` is 1) and so does the status page: an odd
number from an engine costs that number, never a whole area of the node's series or its page.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.agent.derived import update_derived
from kvwatch.agent.engines import scrape_target
from kvwatch.config import Config, ReplicaConfig, ScrapeConfig
from kvwatch.export.collector import NodeCollector
from kvwatch.export.derived import DerivedCollector
from kvwatch.export.encode import TextEncoder
from kvwatch.export.gpus import GpuCollector
from kvwatch.export.plugin import PluginCollector
from kvwatch.export.replicas import ReplicaCollector
from kvwatch.export.requests import RequestCollector
from kvwatch.export.server import make_registry
from kvwatch.model import LengthBands
from kvwatch.state import NodeState
from kvwatch.status.page import render_page, status_document
from kvwatch.status.top import render_text
from kvwatch.status.view import build_view, view_from_dict

from .helpers import LLAMACPP_TINY, SGLANG_DYNAMO, VLLM_DYNAMO_LMCACHE

PAGES = {
    path.name: path.read_text(encoding="utf-8").splitlines()
    for path in (VLLM_DYNAMO_LMCACHE, SGLANG_DYNAMO, LLAMACPP_TINY)
}
SAMPLE_LINES = {
    name: [i for i, line in enumerate(lines) if line and not line.startswith("#")]
    for name, lines in PAGES.items()
}
URL = "http://engine.test/metrics"
CONFIG = Config(replicas=(ReplicaConfig("r0", URL, model_name="tiny"),))
SCRAPE = ScrapeConfig(timeout_s=2.0)
T0 = 1_800_000_000.0

VALUES = st.sampled_from(
    ["NaN", "+Inf", "-Inf", "-1", "0", "-0", "1e308", "-1e308", "1e-320", "1" + "0" * 400, "4.9e-324", "2e9"]
) | st.floats(allow_nan=True, allow_infinity=True).map(repr)


@st.composite
def rewritten(draw: st.DrawFn) -> tuple[str, str]:
    name = draw(st.sampled_from(sorted(PAGES)))
    lines = list(PAGES[name])
    for index in draw(st.lists(st.sampled_from(SAMPLE_LINES[name]), min_size=1, max_size=12, unique=True)):
        series, _, _ = lines[index].rpartition(" ")
        lines[index] = f"{series} {draw(VALUES)}"
    return "\n".join(PAGES[name]) + "\n", "\n".join(lines) + "\n"


async def _scrape(state: NodeState, page: str, at: float) -> None:
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, text=page, headers={"content-type": "text/plain"})
    )
    async with httpx.AsyncClient(transport=transport) as client:
        await scrape_target(client, CONFIG.replicas[0], SCRAPE, state, now=lambda: at)


def _area_success(state: NodeState) -> dict[str, float]:
    areas = {
        "replicas": ReplicaCollector(state, CONFIG),
        "derived": DerivedCollector(state, CONFIG),
        "gpus": GpuCollector(state, CONFIG),
        "requests": RequestCollector(state, CONFIG),
        "plugin": PluginCollector(state, CONFIG),
    }
    text = TextEncoder().encode(make_registry(NodeCollector(state, CONFIG, areas))).decode()
    return {
        s.labels["collector"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvwatch_collector_success" and s.labels["collector"].startswith("export_")
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rewritten())
def test_odd_values_cost_the_value_never_an_area(pages: tuple[str, str]) -> None:
    clean, hostile = pages
    state = NodeState("node-a", LengthBands())
    asyncio.run(_scrape(state, clean, T0))
    assert state.target("r0").up
    update_derived(state, CONFIG, T0)
    asyncio.run(_scrape(state, hostile, T0 + 15))
    event(f"the rewritten page scraped {'up' if state.target('r0').up else 'down'}")
    update_derived(state, CONFIG, T0 + 15)
    success = _area_success(state)
    assert set(success) == {
        "export_replicas",
        "export_derived",
        "export_gpus",
        "export_requests",
        "export_plugin",
    }
    assert all(v == 1 for v in success.values()), success
    view = build_view(state, CONFIG, T0 + 16)  # the status page, status.json and kvwatch top read it
    render_page(view)
    document = json.loads(json.dumps(status_document(view), allow_nan=False))  # the page's strict JSON
    render_text(view_from_dict(document["view"]), 120)
    for sample in state.target("r0").samples:
        for field in ("kv_usage_ratio", "kv_capacity_tokens", "requests_running"):
            value = getattr(sample, field)
            assert value is None or not math.isnan(value), (field, value)
