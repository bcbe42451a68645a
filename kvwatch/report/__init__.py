"""Offline length-band report over a request ledger or a reference trace (``kvwatch report``).

``build_report`` reads, ``render_text`` / ``render_csv`` / ``render_html`` print. pandas is imported
inside the functions that need it, never when kvwatch itself is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from kvwatch.model import LengthBands
from kvwatch.report.csvout import render_csv
from kvwatch.report.html import render_html
from kvwatch.report.inputs import FORMATS, ReportError, detect_common_format, expand
from kvwatch.report.load import load
from kvwatch.report.progress import Progress
from kvwatch.report.summary import ROW_COLUMNS, BandRow, Report, choose_bands, summarize
from kvwatch.report.text import render_text

__all__ = [
    "FORMATS",
    "ROW_COLUMNS",
    "BandRow",
    "Report",
    "ReportError",
    "build_report",
    "render_csv",
    "render_html",
    "render_text",
]


def build_report(
    paths: Sequence[str],
    *,
    bands: LengthBands | None = None,
    replicas: Sequence[str] = (),
    trace_format: str = "auto",
    progress: bool = False,
    progress_stream: TextIO | None = None,
    jobs: int | None = None,
) -> Report:
    """Read ``paths`` (files or globs, gzip allowed) and summarise them per length band and replica.

    ``bands`` None: a ledger's own bands (from the band names it recorded), else the defaults.
    ``progress``: force the stderr progress bar (it shows by itself when stderr is a terminal).
    ``jobs``: worker processes reading JSON lines; None: one below 64 MiB of input, else every CPU.
    Raises ReportError with a message naming the file and what to fix.
    """
    files = expand(list(paths))
    kind = detect_common_format(files, trace_format)
    bar = Progress.auto(sum(f.size for f in files), progress, progress_stream)
    loaded = load(files, kind, bar, jobs)
    chosen, origin = choose_bands(loaded, bands)
    return summarize(loaded, chosen, origin, replicas)
