"""The status page at ``/`` and its data at ``/status.json`` (aiohttp routes on the agent's port).

``/`` is rendered on the server from ``cells.tables(view)``: readable with scripts off (a
``<noscript>`` meta refresh reloads it every few seconds). With scripts on, a few lines of inline
vanilla JS poll ``/status.json`` every 2 s and patch every cell, KV bar and alert mark in place by
id; when rows come or go (the layout key changes) the page reloads instead. The script only sets
``textContent`` and widths, every server-rendered string is escaped, and a Content-Security-Policy
allows nothing but this one script (by hash), inline styles and requests to the page's own origin.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from html import escape

from aiohttp import web

from kvwatch.config import Config
from kvwatch.state import NodeState
from kvwatch.status.cells import Display, Table, display, summary_line, tables
from kvwatch.status.view import StatusView, build_view, view_to_dict

POLL_MS = 2000
NOSCRIPT_REFRESH_S = 5

_STYLE = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:20px;color:#1d2330;background:#fff}
header{display:flex;gap:16px;align-items:baseline;flex-wrap:wrap}h1{font-size:18px;margin:0}
h2{font-size:15px;margin:22px 0 6px}#live{font-size:12px;color:#3a7d2c}#live.stale{color:#b3261e}
.scroll{overflow-x:auto}table{border-collapse:collapse;font-variant-numeric:tabular-nums}
th,td{padding:3px 8px;text-align:right;border-bottom:1px solid #eef;white-space:nowrap}
th{background:#f4f6fa;font-weight:600}th.l,td.l{text-align:left}
tr.alert td{background:#fdecea}tr.alert td:first-child{font-weight:700;color:#b3261e}
.bar{position:relative;display:inline-block;width:120px;height:10px;background:#e8ecf3;margin-right:6px;
vertical-align:middle}.bar i{position:absolute;left:0;top:0;bottom:0}.bar .alloc{background:#9db8e6}
.bar .live{background:#1f4e9c}.empty{color:#778}.notes{color:#556;font-size:12px}
"""

_SCRIPT = """(function(){
var layout=document.body.getAttribute('data-layout'),live=document.getElementById('live');
function apply(d){
 if(d.layout!==layout){location.reload();return;}
 document.querySelectorAll('[data-k]').forEach(function(el){
  var v=d.cells[el.getAttribute('data-k')];if(v!==undefined&&el.textContent!==v){el.textContent=v;}});
 document.querySelectorAll('[data-bar]').forEach(function(el){
  var b=d.bars[el.getAttribute('data-bar')];if(b){
   el.children[0].style.width=(100*b[0]).toFixed(1)+'%';el.children[1].style.width=(100*b[1]).toFixed(1)+'%';}});
 document.querySelectorAll('tr[data-row]').forEach(function(tr){
  tr.classList.toggle('alert',d.alerts.indexOf(tr.getAttribute('data-row'))>=0);});
 live.textContent='live';live.className='';
}
function tick(){
 fetch('status.json',{cache:'no-store'}).then(function(r){return r.json();})
 .then(function(j){apply(j.display);})
 .catch(function(){live.textContent='agent unreachable: values are stale';live.className='stale';})
 .then(function(){setTimeout(tick,%POLL%);});
}
setTimeout(tick,%POLL%);
})();""".replace("%POLL%", str(POLL_MS))

_SCRIPT_HASH = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
CSP = (
    f"default-src 'none'; script-src 'sha256-{_SCRIPT_HASH}'; style-src 'unsafe-inline'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}


def _attr(text: str) -> str:
    return escape(text, quote=True)


def _table_html(table: Table) -> str:
    def cls(i: int) -> str:
        return ' class="l"' if i < table.left else ""

    head = "".join(f"<th{cls(i)}>{escape(h)}</th>" for i, h in enumerate(table.headers))
    rows = []
    for row in table.rows:
        cells = []
        for i, text in enumerate(row.cells):
            cell_id = _attr(f"{row.key}/{i}")
            inner = f'<span data-k="{cell_id}">{escape(text)}</span>'
            if i == table.bar_column and row.bar is not None:
                alloc, live = row.bar
                inner = (
                    f'<span class="bar" data-bar="{_attr(row.key)}"><i class="alloc" '
                    f'style="width:{100 * alloc:.1f}%"></i><i class="live" '
                    f'style="width:{100 * live:.1f}%"></i></span>{inner}'
                )
            cells.append(f"<td{cls(i)}>{inner}</td>")
        alert = ' class="alert"' if row.alert else ""
        rows.append(f'<tr data-row="{_attr(row.key)}"{alert}>{"".join(cells)}</tr>')
    body = "".join(rows) or f'<tr><td class="empty" colspan="{len(table.headers)}">none</td></tr>'
    return (
        f'<section id="{_attr(table.key)}"><h2>{escape(table.title)}</h2><div class="scroll"><table>'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div></section>"
    )


def render_page(view: StatusView) -> str:
    """The whole page for ``view`` (server-side; the script only keeps it current)."""
    layout = display(view).layout
    notes = "".join(f"<p>{escape(n)}</p>" for n in view.notes)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>kvwatch {escape(view.node)}</title>"
        f'<noscript><meta http-equiv="refresh" content="{NOSCRIPT_REFRESH_S}"></noscript>'
        f"<style>{_STYLE}</style></head>"
        f'<body data-layout="{_attr(layout)}"><header><h1 data-k="summary">{escape(summary_line(view))}</h1>'
        '<span id="live">live</span></header>'
        f'<div class="notes">{notes}</div>'
        + "".join(_table_html(t) for t in tables(view))
        + '<p class="notes">KV bar: dark = tokens running requests hold, light = allocated but not live '
        "(partly filled blocks, cached prefixes). Also as JSON: "
        '<a href="status.json">status.json</a>.</p>'
        f"<script>{_SCRIPT}</script></body></html>\n"
    )


def status_document(view: StatusView) -> dict[str, object]:
    """``/status.json``: the view as data (``kvwatch top`` reads it) and the page's display patch."""
    patch: Display = display(view)
    return {"view": view_to_dict(view), "display": asdict(patch)}


def make_status_routes(
    state: NodeState, config: Config, clock: Callable[[], float] = time.time
) -> list[web.RouteDef]:
    """``GET /`` (HTML) and ``GET /status.json``, reading ``state`` at each request."""

    async def page(_request: web.Request) -> web.Response:
        html = render_page(build_view(state, config, clock()))
        return web.Response(text=html, content_type="text/html", charset="utf-8", headers=_HEADERS)

    async def status_json(_request: web.Request) -> web.Response:
        document = status_document(build_view(state, config, clock()))
        return web.json_response(document, headers=_HEADERS, dumps=_dumps)

    return [web.get("/", page), web.get("/status.json", status_json)]


def _dumps(obj: object) -> str:
    """Strict JSON (browsers reject NaN / Infinity): the view already spells them as strings."""
    return json.dumps(obj, allow_nan=False, separators=(",", ":"))
