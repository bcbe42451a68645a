"""The status page in a real headless Chromium: it renders, and its script updates values in place.

``--dump-dom`` with a virtual-time budget lets the page's 2 s poll run before the DOM is printed.
(Without scripts ``--dump-dom`` prints nothing, so the no-script page is checked on the server's
HTML in test_page.py.)
The server changes the state right after serving ``/``, so the printed DOM shows the new values
only if the script fetched ``/status.json`` and patched the page; the request log proves the page
was not simply reloaded.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from aiohttp import web

from .chromium import dump_dom
from .node import populated_state, with_usage
from .server import serve

pytestmark = [pytest.mark.chromium]


def cell(dom: str, cell_id: str) -> str:
    m = re.search(rf'data-k="{re.escape(cell_id)}">([^<]*)<', dom)
    assert m, f"no cell {cell_id}"
    return m.group(1)


async def test_page_renders_every_replica(tmp_path: Path) -> None:
    state, cfg = populated_state()
    async with serve(state, cfg) as base:
        dom = await dump_dom(base + "/", tmp_path / "profile", budget_ms=500)
    for name in ("r0", "r1", "s0"):
        assert f'data-row="replica:{name}:-"' in dom
    assert cell(dom, "replica:r0:-/4") == "70.0%"
    assert "DOWN: connect: connection refused" in dom


async def test_script_updates_values_in_place(tmp_path: Path) -> None:
    state, cfg = populated_state()
    served: list[str] = []

    @web.middleware
    async def change_after_page(request: web.Request, handler):  # type: ignore[no-untyped-def]
        response = await handler(request)
        served.append(request.path)
        if request.path == "/":  # the next poll must see a new KV usage and a stalled GPU
            with_usage(state, cfg, "r1", 0.55)
        return response

    async with serve(state, cfg, middleware=change_after_page) as base:
        dom = await dump_dom(base + "/", tmp_path / "profile", budget_ms=5000)
    assert served.count("/") == 1, served  # patched, not reloaded
    assert "/status.json" in served
    assert cell(dom, "replica:r1:-/4") == "55.0%"
    assert re.search(r'data-bar="replica:r1:-"><i class="alloc" style="width: ?55(\.0)?%;?"', dom)
    assert re.search(r'id="live"[^>]*>live<', dom)  # the poll worked: no "agent unreachable"
