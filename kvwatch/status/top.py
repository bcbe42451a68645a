"""The status view as terminal text (``kvwatch top``, and ``kvwatch demo``'s live view)."""

from __future__ import annotations

from kvwatch import texttable
from kvwatch.safetext import terminal_safe
from kvwatch.status.cells import Table, summary_line, tables
from kvwatch.status.view import StatusView

BAR_WIDTH = 10
#: the most of a status.json ``kvwatch top`` reads (a node's is tens of KiB)
MAX_STATUS_BYTES = 16 * 1024 * 1024


def kv_bar(allocated: float, live: float, width: int = BAR_WIDTH) -> str:
    """``[###--.....]``: ``#`` live tokens, ``-`` allocated but not live (fragmentation, cached
    prefixes), ``.`` free."""
    live_cells = round(max(0.0, min(live, 1.0)) * width)
    used_cells = max(round(max(0.0, min(allocated, 1.0)) * width), live_cells)
    return "[" + "#" * live_cells + "-" * (used_cells - live_cells) + "." * (width - used_cells) + "]"


def _table_text(table: Table) -> str:
    rows = []
    for row in table.rows:
        cells = [terminal_safe(cell) for cell in row.cells]
        if table.bar_column is not None and row.bar is not None:
            cells[table.bar_column] = f"{kv_bar(*row.bar)} {cells[table.bar_column]}"
        if row.alert:
            cells[0] = f"!{cells[0]}"
        rows.append(cells)
    headers = tuple(terminal_safe(header) for header in table.headers)
    body = texttable.render(headers, rows, left=table.left) if rows else "  (none)"
    return f"{terminal_safe(table.title)}\n{body}"


def render_text(view: StatusView, width: int) -> str:
    """The whole view as plain text, each line cut to ``width`` columns (``!`` marks a row to look at)."""
    parts = [
        terminal_safe(summary_line(view)),
        *map(terminal_safe, view.notes),
        *(_table_text(t) for t in tables(view)),
    ]
    text = "\n\n".join(parts)  # the only control characters left are these line breaks
    return "\n".join(texttable.cut(line, width) if width > 0 else line for line in text.split("\n")) + "\n"


# --------------------------------------------------------------------------------------------
# kvwatch top: read a running agent's /status.json
# --------------------------------------------------------------------------------------------

CLEAR = "\x1b[H\x1b[2J"


class AgentUnreachableError(Exception):
    """The agent's /status.json could not be fetched or read (message names the URL and why)."""


def status_url(base: str) -> str:
    """``http://host:9477`` or a full ``.../status.json`` URL -> the status.json URL."""
    base = base.strip()
    if "://" not in base:
        base = f"http://{base}"
    if not base.startswith(("http://", "https://")):
        raise AgentUnreachableError(f"{base}: expected an http(s) URL of a kvwatch agent")
    return base if base.endswith("/status.json") else base.rstrip("/") + "/status.json"


def fetch_view(url: str, timeout_s: float = 5.0) -> StatusView:
    import http.client
    import urllib.error
    import urllib.request

    from kvwatch.jsonsafe import loads
    from kvwatch.status.view import view_from_dict

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read(MAX_STATUS_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise AgentUnreachableError(f"cannot reach kvwatch at {url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        # HTTPException: something that is not an HTTP server answered (BadStatusLine); ValueError:
        # a URL urllib cannot use
        reason = getattr(exc, "reason", None) or exc.__class__.__name__ + (f": {exc}" if str(exc) else "")
        raise AgentUnreachableError(f"cannot reach kvwatch at {url}: {reason}") from None
    if len(body) > MAX_STATUS_BYTES:
        raise AgentUnreachableError(f"{url}: over {MAX_STATUS_BYTES} bytes, not a kvwatch status document")
    try:
        document = loads(body)
    except ValueError as exc:
        raise AgentUnreachableError(f"{url}: not JSON: {exc}") from None
    try:
        return view_from_dict(document["view"])
    except (KeyError, TypeError, ValueError) as exc:
        raise AgentUnreachableError(f"{url}: not a kvwatch status document ({exc})") from None
