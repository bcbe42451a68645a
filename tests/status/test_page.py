"""The status page and /status.json over HTTP (aiohttp, real sockets)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import aiohttp
import aiohttp.web

from kvwatch.status.page import CSP
from tests.local import serving

from .node import populated_state
from .server import serve


async def get(url: str) -> tuple[int, dict[str, str], str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, dict(response.headers), await response.text()


async def test_page_shows_every_replica_gpu_and_band() -> None:
    state, cfg = populated_state()
    async with serve(state, cfg) as base:
        status, headers, html = await get(base + "/")
    assert status == 200
    assert headers["Content-Type"].startswith("text/html")
    for name in ("r0", "r1", "s0"):
        assert f'data-row="replica:{name}:-"' in html
    assert "DOWN: connect: connection refused" in html
    assert "NVIDIA H200" in html and "gen5 x16" in html
    assert "10k-20k" in html and "Stranded KV capacity" in html
    assert re.search(r'class="bar" data-bar="replica:r0:-"><i class="alloc" style="width:70.0%"', html)
    assert '<meta http-equiv="refresh"' in html  # inside <noscript>: reloads when scripts are off
    assert re.search(r"<noscript><meta http-equiv=\"refresh\"", html)


async def test_page_is_locked_down() -> None:
    state, cfg = populated_state()
    async with serve(state, cfg) as base:
        _status, headers, html = await get(base + "/")
    assert headers["Content-Security-Policy"] == CSP
    assert "script-src 'sha256-" in CSP and "default-src 'none'" in CSP
    assert not re.search(r"<script[^>]+src=", html) and "<link" not in html
    assert headers["X-Content-Type-Options"] == "nosniff"


async def test_names_from_engines_are_escaped() -> None:
    state, cfg = populated_state()
    target = state.target("r1")
    target.samples = (replace(target.samples[0], model_name='<script>alert("x")</script>'),)
    async with serve(state, cfg) as base:
        _status, _headers, html = await get(base + "/")
        _status, _headers, body = await get(base + "/status.json")
    assert '<script>alert("x")' not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    assert json.loads(body)["display"]["cells"]["replica:r1:-/2"] == '<script>alert("x")</script>'


async def test_status_json_carries_the_view_and_the_display_patch() -> None:
    state, cfg = populated_state()
    async with serve(state, cfg) as base:
        status, headers, body = await get(base + "/status.json")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    document = json.loads(body)  # strict JSON: no NaN / Infinity tokens
    assert "Infinity" not in body and "NaN" not in body.replace('"NaN"', "")
    assert [r["name"] for r in document["view"]["replicas"]] == ["r0", "r1", "s0"]
    display = document["display"]
    assert display["cells"]["replica:r0:-/4"] == "70.0%"
    assert display["bars"]["replica:r0:-"][0] > display["bars"]["replica:r0:-"][1] > 0
    assert "replica:s0:-" in display["alerts"]
    assert display["layout"].startswith("replicas:replica:r0:-,replica:r1:-,replica:s0:-")


async def test_page_follows_state_changes() -> None:
    state, cfg = populated_state()
    async with serve(state, cfg) as base:
        _s, _h, before = await get(base + "/status.json")
        target = state.target("r1")
        target.samples = (replace(target.samples[0], kv_usage_ratio=0.55),)
        _s, _h, after = await get(base + "/status.json")
    cell = "replica:r1:-/4"
    assert json.loads(before)["display"]["cells"][cell] == "10.0%"
    assert json.loads(after)["display"]["cells"][cell] == "55.0%"


async def test_routes_mount_next_to_metrics_on_the_agent_app() -> None:
    from prometheus_client.core import GaugeMetricFamily

    from kvwatch.export.server import make_registry, metrics_app
    from kvwatch.status.page import make_status_routes

    class One:
        def collect(self):  # type: ignore[no-untyped-def]
            yield GaugeMetricFamily("kvwatch_test_gauge", "test", value=1)

    state, cfg = populated_state()
    app = metrics_app(make_registry(One()), lambda: True, extra_routes=make_status_routes(state, cfg))
    async with serving(app) as base:
        page = await get(base + "/")
        metrics = await get(base + "/metrics")
    assert page[0] == 200 and "Replicas: KV cache" in page[2]
    assert metrics[0] == 200 and "kvwatch_test_gauge 1.0" in metrics[2]
