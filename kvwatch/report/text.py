"""The report as plain aligned text for a terminal (what ``kvwatch report`` prints)."""

from __future__ import annotations

from kvwatch import humanize as h
from kvwatch import texttable
from kvwatch.report.summary import ALL, BandRow, Report

KIND_NAMES = {
    "ledger": "kvwatch request ledger",
    "azure": "Azure LLM inference trace",
    "burstgpt": "BurstGPT trace",
    "mooncake": "Mooncake trace",
}


#: timestamps above this are unix times (traces like BurstGPT and Mooncake count from their start)
_ABSOLUTE_AFTER = 1e9


def header_lines(report: Report) -> list[str]:
    """What was read, over which window, what was skipped, and how to read the numbers."""
    lines = [
        f"kvwatch report: {KIND_NAMES.get(report.kind, report.kind)}, {report.requests:,} requests "
        f"from {len(report.files)} file(s)"
    ]
    start, end, span = report.window_start, report.window_end, report.window_seconds
    if start is not None and end is not None and start > _ABSOLUTE_AFTER:
        lines.append(f"window: {h.utc(start)} -> {h.utc(end)} ({h.seconds(span)})")
    elif span is not None:
        lines.append(f"window: {h.seconds(span)} of trace time")
    if report.malformed:
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in report.malformed_reasons)
        lines.append(f"skipped {report.malformed:,} malformed line(s): {reasons}")
        lines += [f"  {example}" for example in report.malformed_examples]
    lines.append(f"bands: {', '.join(report.bands.names)}")
    lines += [f"note: {note}" for note in report.notes]
    return lines


def _band_label(row: BandRow) -> str:
    return "all bands" if row.length_band == ALL else row.length_band


def count_headers(report: Report) -> list[str]:
    """Columns both reports open a band's row with: its requests, outcomes and sizes."""
    headers = ["band", "requests", "share"]
    if report.has_outcomes:
        headers += ["completed", "truncated", "aborted", "error", "rejected"]
    return [*headers, "out p50", "out p90", "out p99", "prompt p50"]


def count_cells(report: Report, r: BandRow) -> list[str]:
    """The cells under ``count_headers``."""
    cells = [_band_label(r), h.count(r.requests), h.ratio(r.request_share)]
    if report.has_outcomes:
        outcomes = (r.completed_ratio, r.truncated_ratio, r.aborted_ratio, r.error_ratio, r.rejected_ratio)
        cells += [h.ratio(v) for v in outcomes]
    sizes = (r.output_tokens_p50, r.output_tokens_p90, r.output_tokens_p99, r.prompt_tokens_p50)
    return [*cells, *(h.si(v) for v in sizes)]


def streaming_cells(r: BandRow) -> list[str]:
    """TTFT p50 / p90 / p99 then TPOT p50 / p90 / p99 (inputs that time the first token)."""
    ttft = (r.ttft_p50_seconds, r.ttft_p90_seconds, r.ttft_p99_seconds)
    tpot = (r.tpot_p50_seconds, r.tpot_p90_seconds, r.tpot_p99_seconds)
    return [h.seconds(v) for v in (*ttft, *tpot)]


def e2e_cells(r: BandRow) -> list[str]:
    """End-to-end latency p50 / p90 / p99."""
    return [h.seconds(v) for v in (r.e2e_p50_seconds, r.e2e_p90_seconds, r.e2e_p99_seconds)]


def kv_cells(r: BandRow) -> list[str]:
    """KV memory-time: token-seconds held, its share, mean tokens held."""
    return [h.si(r.kv_token_seconds), h.ratio(r.kv_share), h.si(r.kv_mean_tokens)]


def requests_table(report: Report, rows: list[BandRow]) -> str:
    headers = count_headers(report)
    if report.has_e2e:
        headers += ["KV token-s", "KV share", "mean KV tok"]
    body = [count_cells(report, r) + (kv_cells(r) if report.has_e2e else []) for r in rows]
    return texttable.render(headers, body)


def latency_table(report: Report, rows: list[BandRow]) -> str:
    headers = ["band"]
    if report.has_ttft:
        headers += ["TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99"]
    headers += ["e2e p50", "p90", "p99"]
    body = [[_band_label(r), *(streaming_cells(r) if report.has_ttft else []), *e2e_cells(r)] for r in rows]
    return texttable.render(headers, body)


def render_text(report: Report) -> str:
    """Header, then per replica group ((all) first) a requests table and a latency table."""
    parts = ["\n".join(header_lines(report))]
    for replica in report.replicas:
        rows = report.rows_for(replica)
        total = next((r.requests for r in rows if r.length_band == ALL), 0)
        title = "all replicas" if replica == ALL else f"replica {replica}"
        parts.append(f"== {title}: {total:,} requests ==")
        parts.append(requests_table(report, rows))
        if report.has_e2e:
            parts.append(latency_table(report, rows))
    return "\n\n".join(parts) + "\n"
