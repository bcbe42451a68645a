"""The figures: medians, the "added" columns against direct, the ratios against nginx, the table."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from _harness import percentile as _pct


@dataclass
class Result:
    target: str
    steady_ttft_ns: list[int]
    steady_latency_ns: list[int]
    steady_chunks: int
    steady_cpu_s: float
    burst_ttft_ns: list[int]
    flat_chunks: int
    flat_cpu_s: float
    flat_wall_s: float


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ms(ns: float) -> float:
    return ns / 1e6


def _rows(results: list[Result]) -> list[dict]:
    direct = results[0]
    base_ttft = {q: _pct(direct.steady_ttft_ns, q) for q in (50, 99)}
    base_lat = {q: _pct(direct.steady_latency_ns, q) for q in (50, 99)}
    base_burst = _pct(direct.burst_ttft_ns, 99)
    nginx = next((r for r in results if r.target == "nginx"), None)
    nginx_cpu_per_k = (1000 * nginx.steady_cpu_s / nginx.steady_chunks) if nginx else None
    nginx_flat_per_k = (1000 * nginx.flat_cpu_s / nginx.flat_chunks) if nginx else None
    nginx_burst_added = (_pct(nginx.burst_ttft_ns, 99) - base_burst) if nginx else None
    rows = []
    for r in results:
        row = {
            "target": r.target,
            "steady_arrivals": len(r.steady_ttft_ns),
            "ttft_p50_ms": _ms(_pct(r.steady_ttft_ns, 50)),
            "ttft_p99_ms": _ms(_pct(r.steady_ttft_ns, 99)),
            "added_ttft_p50_ms": _ms(_pct(r.steady_ttft_ns, 50) - base_ttft[50]),
            "added_ttft_p99_ms": _ms(_pct(r.steady_ttft_ns, 99) - base_ttft[99]),
            "added_chunk_p50_ms": _ms(_pct(r.steady_latency_ns, 50) - base_lat[50]),
            "added_chunk_p99_ms": _ms(_pct(r.steady_latency_ns, 99) - base_lat[99]),
            "burst_ttft_p99_ms": _ms(_pct(r.burst_ttft_ns, 99)),
            "added_burst_ttft_p99_ms": _ms(_pct(r.burst_ttft_ns, 99) - base_burst),
            "steady_chunks": r.steady_chunks,
            "steady_cpu_s": r.steady_cpu_s,
            "flat_chunks": r.flat_chunks,
            "flat_cpu_s": r.flat_cpu_s,
            "flat_chunks_per_s": r.flat_chunks / r.flat_wall_s if r.flat_wall_s else None,
        }
        if r.target != "direct":
            row["steady_chunks_per_cpu_s"] = r.steady_chunks / r.steady_cpu_s if r.steady_cpu_s else None
            row["flat_chunks_per_cpu_s"] = r.flat_chunks / r.flat_cpu_s if r.flat_cpu_s else None
            row["steady_cpu_ms_per_1k_chunks"] = 1000 * 1000 * r.steady_cpu_s / r.steady_chunks
            row["flat_cpu_ms_per_1k_chunks"] = 1000 * 1000 * r.flat_cpu_s / r.flat_chunks
            if nginx_cpu_per_k:
                row["steady_cpu_vs_nginx"] = (1000 * r.steady_cpu_s / r.steady_chunks) / nginx_cpu_per_k
            if nginx_flat_per_k:
                row["flat_cpu_vs_nginx"] = (1000 * r.flat_cpu_s / r.flat_chunks) / nginx_flat_per_k
            if nginx_burst_added:
                row["burst_added_vs_nginx"] = (_pct(r.burst_ttft_ns, 99) - base_burst) / nginx_burst_added
        rows.append(row)
    return rows


def _print(rows: list[dict], args: argparse.Namespace) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    cols = [
        ("target", "{}"),
        ("added_ttft_p50_ms", "{:.3f}"),
        ("added_ttft_p99_ms", "{:.3f}"),
        ("added_chunk_p50_ms", "{:.3f}"),
        ("added_chunk_p99_ms", "{:.3f}"),
        ("added_burst_ttft_p99_ms", "{:.2f}"),
        ("steady_chunks_per_cpu_s", "{:,.0f}"),
        ("flat_chunks_per_cpu_s", "{:,.0f}"),
        ("steady_cpu_ms_per_1k_chunks", "{:.1f}"),
        ("steady_cpu_vs_nginx", "{:.2f}"),
        ("flat_cpu_vs_nginx", "{:.2f}"),
        ("burst_added_vs_nginx", "{:.2f}"),
    ]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        cells = []
        for c, fmt in cols:
            v = row.get(c)
            cells.append("-" if v is None else fmt.format(v))
        print("| " + " | ".join(cells) + " |")
    direct = rows[0]
    print(
        f"\nmedians of {args.rounds} interleaved round(s); steady: {args.streams} streams x "
        f"{args.chunks} chunks x 10 ms, {args.seconds:.0f} s; burst: 3 x {args.streams}; flat: 2 x "
        f"{args.streams} streams x {args.chunks} chunks unpaced; direct path TTFT p50/p99 "
        f"{direct['ttft_p50_ms']:.3f}/{direct['ttft_p99_ms']:.3f} "
        f"ms; cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}"
    )
