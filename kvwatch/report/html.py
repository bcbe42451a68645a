"""``--html``: one self-contained page (inline CSS and SVG, no script, nothing fetched)."""

from __future__ import annotations

from html import escape

from kvwatch import humanize as h
from kvwatch.model import UNKNOWN_BAND
from kvwatch.report import svg
from kvwatch.report.summary import ALL, BandRow, Report
from kvwatch.report.text import (
    KIND_NAMES,
    count_cells,
    count_headers,
    e2e_cells,
    header_lines,
    kv_cells,
    streaming_cells,
)

_STYLE = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#1d2330;background:#fff}
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #dde}
.meta{color:#445;margin:2px 0}.note{color:#556;font-size:12px;margin:2px 0}
table{border-collapse:collapse;margin:8px 0 16px;font-variant-numeric:tabular-nums}
th,td{padding:3px 8px;text-align:right;border-bottom:1px solid #eef;white-space:nowrap}
.scroll{overflow-x:auto}th{background:#f4f6fa;font-weight:600}
td:first-child,th:first-child{text-align:left}tr.total td{font-weight:600;border-top:1px solid #99a}
.charts{display:flex;flex-wrap:wrap;gap:12px}.chart{background:#fbfcfe;border:1px solid #e3e7ef}
.chart text{font-size:11px;fill:#334}.chart .title{font-size:13px;font-weight:600}
.chart .grid{stroke:#e6e9f0}.chart .axis{stroke:#889}.chart .marker{stroke:#c33;stroke-dasharray:4 3}
.chart .marker-label{fill:#a22}.s0{fill:#8fb3e8}.s1{fill:#1f4e9c}.s2{fill:#e39b3c}
.b0{fill:#6aa84f}.b1{fill:#3c78d8}.b2{fill:#e69138}.b3{fill:#cc4125}.b4{fill:#8e44ad}.b5{fill:#16a085}
.b6{fill:#7f6000}.b7{fill:#a64d79}.b8{fill:#45818e}.b9{fill:#999}.b10{fill:#555}.b11{fill:#222}
"""


def _table(headers: list[str], rows: list[list[str]], totals: set[int]) -> str:
    head = "".join(f"<th>{escape(x)}</th>" for x in headers)
    body = []
    for i, row in enumerate(rows):
        cls = ' class="total"' if i in totals else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>")
    return (
        f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _band_rows_table(report: Report, rows: list[BandRow]) -> str:
    headers = count_headers(report)
    if report.has_ttft:
        headers += ["TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p90", "TPOT p99"]
    if report.has_e2e:
        headers += ["e2e p50", "e2e p90", "e2e p99", "KV token-s", "KV share", "mean KV tokens"]
    body, totals = [], set()
    for i, r in enumerate(rows):
        if r.length_band == ALL:
            totals.add(i)
        cells = count_cells(report, r)
        if report.has_ttft:
            cells += streaming_cells(r)
        if report.has_e2e:
            cells += e2e_cells(r) + kv_cells(r)
        body.append(cells)
    return _table(headers, body, totals)


def _band_class(report: Report, tokens: float) -> str:
    name = report.bands.band_for(tokens)
    return f"b{report.bands.names.index(name)}" if name != UNKNOWN_BAND else "b9"


def _charts(report: Report) -> str:
    rows = [r for r in report.rows_for(ALL) if r.length_band not in (ALL, UNKNOWN_BAND)]
    bands = [r.length_band for r in rows]
    charts = []
    latencies = (
        ("TTFT", report.has_ttft, [r.ttft_p50_seconds for r in rows], [r.ttft_p99_seconds for r in rows]),
        ("TPOT", report.has_ttft, [r.tpot_p50_seconds for r in rows], [r.tpot_p99_seconds for r in rows]),
        (
            "End-to-end latency",
            report.has_e2e,
            [r.e2e_p50_seconds for r in rows],
            [r.e2e_p99_seconds for r in rows],
        ),
    )
    for what, shown, p50, p99 in latencies:
        if shown:
            title = f"{what} by length band"
            charts.append(svg.grouped_bars(title, bands, [("p50", p50), ("p99", p99)], h.seconds, log=True))
    hist = report.output_histogram
    if hist.counts:
        classes = [_band_class(report, lo) for lo in hist.edges[:-1]]
        markers = [(float(e), f"{h.si(e)}") for e in report.bands.edges if e <= hist.edges[-1]]
        charts.append(
            svg.histogram(
                "Output length distribution (all replicas)", hist.edges, hist.counts, classes, markers, h.si
            )
        )
    series = [("requests", [r.request_share for r in rows])]
    if report.has_e2e:
        series.append(("KV token-seconds held", [r.kv_share for r in rows]))
    charts.append(svg.share_bars("Share of requests and of KV memory-time by length band", bands, series))
    return f'<div class="charts">{"".join(charts)}</div>'


def render_html(report: Report) -> str:
    """The whole page; every string from the input is escaped."""
    head, *rest = header_lines(report)
    meta = "".join(
        f'<p class="{"note" if ln.startswith(("note:", "  ")) else "meta"}">{escape(ln)}</p>' for ln in rest
    )
    files = "".join(
        f"<li>{escape(f.path)}: {f.records:,} records, {f.malformed:,} malformed</li>" for f in report.files
    )
    sections = []
    for replica in report.replicas:
        title = "All replicas" if replica == ALL else f"Replica {replica}"
        sections.append(f"<h2>{escape(title)}</h2>{_band_rows_table(report, report.rows_for(replica))}")
    title = f"kvwatch report: {KIND_NAMES.get(report.kind, report.kind)}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{escape(head)}</h1>{meta}<details><summary>inputs</summary><ul>{files}</ul></details>"
        f"<h2>Charts</h2>{_charts(report)}{''.join(sections)}</body></html>\n"
    )
