"""``kvwatch report LEDGER...``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "length-band report over a request ledger or a reference trace (text, CSV, HTML)"
DESCRIPTION = """\
Summarise finished requests per output-length band and per replica: request count and share,
completed / truncated / aborted / error / rejected ratios, TTFT, TPOT and e2e p50/p90/p99,
output-token p50/p90/p99, and the KV token-seconds each band holds
(prompt x e2e + output x (e2e - TTFT) / 2 per request) with its share of the total.

Inputs: the proxy's request ledger (ledger.jsonl, rotated ledger.jsonl.1 ..., gzip allowed;
several files and globs), or a reference trace to compare against: Azure LLM inference CSV
(TIMESTAMP,ContextTokens,GeneratedTokens), BurstGPT CSV, Mooncake JSONL. Malformed lines are
counted, reported and skipped.

  kvwatch report /var/lib/kvwatch/ledger.jsonl* --html report.html --csv bands.csv
  kvwatch report AzureLLMInferenceTrace_conv.csv --bands 128,512,1k

Exit status 0 on success, 1 when the input cannot be read (the message says why)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="LEDGER", help="ledger files, globs or trace files")
    parser.add_argument("--html", metavar="OUT", help="write a self-contained HTML report")
    parser.add_argument("--csv", metavar="OUT", help="write one CSV row per length band x replica")
    parser.add_argument(
        "--bands",
        metavar="EDGES",
        help="band edges in output tokens, e.g. 1000,5000,10000,20000 or 1k,5k "
        "(default: the ledger's own bands, else 1k,5k,10k,20k)",
    )
    parser.add_argument(
        "--replica", action="append", default=[], metavar="R", help="only this replica (repeatable)"
    )
    parser.add_argument(
        "--trace-format",
        default="auto",
        choices=("auto", "ledger", "azure", "burstgpt", "mooncake"),
        help="input format (default: detected from the first lines)",
    )
    parser.add_argument(
        "--progress", action="store_true", help="show a progress bar on stderr even when it is not a terminal"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="processes reading JSON lines (default: 1 below 64 MiB of input, else every CPU)",
    )
    parser.add_argument("--quiet", action="store_true", help="do not print the text report")


def _write(path: str, text: str) -> None:
    Path(path).write_text(text, encoding="utf-8")


def main(args: argparse.Namespace) -> int:
    from kvwatch.report import ReportError, build_report, render_csv, render_html, render_text
    from kvwatch.report.summary import parse_band_edges

    try:
        bands = parse_band_edges(args.bands) if args.bands else None
        report = build_report(
            args.inputs,
            bands=bands,
            replicas=args.replica,
            trace_format=args.trace_format,
            progress=args.progress,
            jobs=args.jobs,
        )
    except ReportError as exc:
        print(f"kvwatch report: {exc}", file=sys.stderr)
        return 1
    try:
        if args.csv:
            _write(args.csv, render_csv(report))
        if args.html:
            _write(args.html, render_html(report))
    except OSError as exc:
        print(f"kvwatch report: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    if not args.quiet:
        sys.stdout.write(render_text(report))
    return 0
