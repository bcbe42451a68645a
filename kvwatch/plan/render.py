"""The replay as text and HTML: the twin's figures per band next to the recorded ones.

Each latency cell is ``twin (recorded, error)`` where a recorded figure exists; error is
``(twin - recorded) / recorded``. The header says what timed the twin's steps and how far that can
be trusted, and every node figure names its definition (``replay`` module doc).
"""

from __future__ import annotations

from html import escape

from kvwatch import humanize as h
from kvwatch import texttable
from kvwatch.plan.calibration import Calibration, describe
from kvwatch.plan.inputs import Workload
from kvwatch.plan.replay import NodeFigures, ReplayResult
from kvwatch.report import svg
from kvwatch.report.summary import ALL, BandRow, Report

LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("e2e", "e2e"))


def relative_error(twin: float | None, recorded: float | None) -> float | None:
    if twin is None or recorded is None or recorded == 0:
        return None
    return (twin - recorded) / recorded


def _cell(twin: float | None, recorded: float | None) -> str:
    if recorded is None:
        return h.seconds(twin)
    err = relative_error(twin, recorded)
    return f"{h.seconds(twin)} ({h.seconds(recorded)}, {'n/a' if err is None else f'{err:+.0%}'})"


def _rows_by_band(report: Report | None) -> dict[str, BandRow]:
    return {} if report is None else {r.length_band: r for r in report.rows_for(ALL)}


def header(result: ReplayResult, workload: Workload, calibration: Calibration | None) -> list[str]:
    c, n = result.candidate, result.node
    lines = [
        f"kvwatch plan replay: {len(workload.requests):,} requests from {workload.kind} "
        f"{', '.join(workload.paths)} over {h.seconds(workload.span_seconds)} of recorded arrivals",
        f"twin: {c.gpus} GPU(s): {c.label()}; router {c.router}; {n.capacity_tokens_per_replica:,} KV tokens "
        "per replica",
        f"step time: {result.step_model}",
    ]
    if calibration is not None:
        lines += describe(calibration)
    lines += workload.caveats()
    lines.append(f"simulated {h.seconds(n.sim_seconds)} in {result.wall_seconds:.2f} s wall")
    return lines + [f"note: {x}" for x in result.notes]


def band_table(twin: Report, recorded: Report | None) -> str:
    rec = _rows_by_band(recorded)
    headers = ["band", "requests", "completed", "truncated", "aborted"]
    for name, _ in LATENCIES:
        headers += [f"{name} p50", f"{name} p99"]
    body = []
    for r in twin.rows_for(ALL):
        o = rec.get(r.length_band)
        cells = [
            "all bands" if r.length_band == ALL else r.length_band,
            h.count(r.requests) + (f" ({h.count(o.requests)})" if o else ""),
            h.ratio(r.completed_ratio),
            h.ratio(r.truncated_ratio),
            h.ratio(r.aborted_ratio),
        ]
        for _, key in LATENCIES:
            for q in ("p50", "p99"):
                attr = f"{key}_{q}_seconds"
                cells.append(_cell(getattr(r, attr), getattr(o, attr) if o else None))
        body.append(cells)
    return texttable.render(headers, body)


def node_lines(result: ReplayResult) -> list[str]:
    n = result.node
    per_hour = n.completed_per_gpu_hour
    return [
        f"requests: {n.completed:,} completed, {n.truncated:,} truncated, {n.aborted:,} abandoned, "
        f"{n.rejected:,} rejected (too long for max_model_len)",
        f"preemptions: {n.preemptions:,}; recomputed tokens: {n.recomputed_tokens:,} (engine counters)",
        f"KV use (sampled every {h.seconds(n.sample_every_s)}, {n.samples:,} samples): node peak "
        f"{n.peak_kv_usage:.1%}, fullest replica peak {n.peak_replica_kv_usage:.1%}, "
        f"node mean {n.mean_kv_usage:.1%}",
        f"stranded capacity: {h.si(n.mean_stranded_tokens)} KV tokens on average, in "
        f"{n.stranded_sample_share:.1%} of samples (free KV on replicas with no queue while another queues)",
        f"completed requests per GPU-hour: {'n/a' if per_hour is None else f'{per_hour:,.1f}'} "
        f"({n.completed:,} completed / {n.gpus} GPU(s) x {h.seconds(n.sim_seconds)})",
    ] + (tier_lines(n) if n.offload_bytes else [])


def tier_lines(n: NodeFigures) -> list[str]:
    """What the CPU tier cost over PCIe and what it bought."""
    ratio = n.recompute_avoided_per_byte
    return [
        f"CPU tier traffic: {h.si(n.offload_bytes)}B over PCIe ({n.offload_transfer_seconds:,.1f} s of "
        f"transfers at the measured host bandwidth); {n.offload_tokens_loaded:,} tokens loaded back instead "
        f"of recomputed: {'n/a' if ratio is None else f'{ratio * 1e6:,.2f}'} tokens per MB moved; steps "
        f"waited {n.offload_queue_seconds:,.1f} s more for uplinks busy with other transfers"
    ]


def render_replay_text(
    result: ReplayResult, workload: Workload, recorded: Report | None, calibration: Calibration | None
) -> str:
    parts = ["\n".join(header(result, workload, calibration))]
    legend = (
        "per band: twin"
        + (" (recorded, error)" if recorded is not None and recorded.has_e2e else "")
        + "; percentiles as kvwatch report computes them"
    )
    parts += [legend, band_table(result.report, recorded), "\n".join(node_lines(result))]
    return "\n\n".join(parts) + "\n"


_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;text-align:right}"
    "th{background:#f2f2f2}.meta{color:#333;margin:2px 0}.chart text{font-size:11px}"
    ".s0{fill:#4e79a7}.s1{fill:#f28e2b}.s2{fill:#59a14f}.title{font-weight:600}"
    "line.s0,polyline.s0{stroke:#4e79a7;fill:none}"
)


def _html_table(text_table: str) -> str:
    lines = [ln for ln in text_table.splitlines() if ln.strip() and not set(ln) <= {"-", " "}]
    return "<pre>" + escape("\n".join(lines)) + "</pre>"


def render_replay_html(
    result: ReplayResult, workload: Workload, recorded: Report | None, calibration: Calibration | None
) -> str:
    meta = "".join(f'<p class="meta">{escape(x)}</p>' for x in header(result, workload, calibration))
    node = "".join(f"<li>{escape(x)}</li>" for x in node_lines(result))
    rows = result.report.rows_for(ALL)
    rec = _rows_by_band(recorded)
    bands = [r.length_band if r.length_band != ALL else "all" for r in rows]
    charts = []
    for name, key in LATENCIES:
        series = [("twin p99", [getattr(r, f"{key}_p99_seconds") for r in rows])]
        if rec:
            series.append(
                ("recorded p99", [getattr(rec.get(r.length_band), f"{key}_p99_seconds", None) for r in rows])
            )
        charts.append(svg.grouped_bars(f"{name} p99 by band", bands, series, h.seconds, log=True))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>kvwatch plan replay</title>'
        f"<style>{_STYLE}</style></head><body><h1>kvwatch plan replay</h1>{meta}"
        f"<h2>Per length band</h2>{_html_table(band_table(result.report, recorded))}"
        f"<h2>Node</h2><ul>{node}</ul><h2>Charts</h2>{''.join(charts)}</body></html>\n"
    )
