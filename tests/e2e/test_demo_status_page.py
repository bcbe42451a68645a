"""The status page (``/``) of a running ``kvwatch demo`` (the pressure node of the alerting stack, 8
replicas) in real headless Chromium: it shows every replica, and its own 2-second poll of
``/status.json`` updates the values in place.

Chromium loads the page through a small relay in the test that records what it served and holds
each ``/status.json`` answer back for a moment, so the demo (20 simulated seconds per wall second)
has moved on between the page and the poll. The printed DOM must then carry the values of a
``/status.json`` answer, not those of the HTML it loaded, with the page loaded once (patched, not
reloaded). ``--dump-dom`` with a virtual-time budget lets the poll run first (the helper of
``tests/status``).
"""

from __future__ import annotations

import asyncio
import html
import json
import re
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.local import serving
from tests.status.chromium import dump_dom

pytestmark = [
    pytest.mark.chromium,
    pytest.mark.slow,
]

POLL_HOLD_S = 1.5  # wall seconds the relay holds a /status.json answer back
ATTEMPTS = 3  # a page whose rows changed reloads itself (by design); then look again
#: in its first minute the demo's tables still gain rows (bands, stranded capacity) every few
#: seconds, and each new row reloads the page; after the alerting tests (minutes) they are settled
SETTLED_AFTER_S = 60.0
_CELL = re.compile(r'data-k="([^"]*)">([^<]*)<')


def cells_of(page: str) -> dict[str, str]:
    return {html.unescape(k): html.unescape(v) for k, v in _CELL.findall(page)}


async def _load_once(demo_url: str, profile: Path) -> tuple[str, list[tuple[str, bytes]]]:
    """The DOM Chromium printed, and what the relay served it, in order."""
    served: list[tuple[str, bytes]] = []
    async with aiohttp.ClientSession() as client:

        async def relay(request: web.Request) -> web.Response:
            if request.path == "/status.json":
                await asyncio.sleep(POLL_HOLD_S)
            async with client.get(demo_url + request.path_qs) as upstream:
                body = await upstream.read()
                headers = {
                    k: v
                    for k, v in upstream.headers.items()
                    if k.lower() in ("content-type", "content-security-policy", "cache-control")
                }
            served.append((request.path, body))
            return web.Response(body=body, status=upstream.status, headers=headers)

        app = web.Application()
        app.router.add_get("/{tail:.*}", relay)
        async with serving(app, access_log=None) as url:
            dom = await dump_dom(f"{url}/", profile, budget_ms=5000)
    return dom, served


async def test_status_page_shows_every_replica_and_its_poll_updates_the_values(alerting_stack, tmp_path):
    demo = alerting_stack.pressure
    await asyncio.sleep(max(SETTLED_AFTER_S - alerting_stack.elapsed(), 0.0))
    tries = []
    for attempt in range(ATTEMPTS):
        dom, served = await _load_once(demo.url, tmp_path / f"profile-{attempt}")
        paths = [path for path, _ in served]
        tries.append(paths)
        if paths.count("/") == 1 and "/status.json" in paths:
            break
    else:
        pytest.fail(f"no load with one page and a poll after it: {tries}\n{alerting_stack.diagnostics()}")

    for i in range(demo.replicas):
        assert re.search(rf'data-row="replica:replica-{i}:[^"]*"', dom), f"replica-{i} missing from the page"
    assert re.search(r'id="live"[^>]*>live<', dom)  # the poll worked: no "agent unreachable"

    page = cells_of(next(body for path, body in served if path == "/").decode())
    polls = [json.loads(body)["display"]["cells"] for path, body in served if path == "/status.json"]
    shown = cells_of(dom)
    assert shown.keys() == page.keys()
    down = {k: v for k, v in shown.items() if k.startswith("replica:") and "DOWN" in v}
    assert not down, down
    # what Chromium shows is what a poll answered (the last one it applied), not the HTML it loaded
    applied = [poll for poll in polls if all(poll.get(k, v) == v for k, v in shown.items())]
    assert applied, "the DOM matches no /status.json answer"
    changed = {k: (page[k], v) for k, v in shown.items() if page[k] != v}
    assert "summary" in changed, changed  # the clock in the summary line moved on
    assert any(k.startswith("replica:") for k in changed), changed  # and replica values with it
