"""``--csv``: one row per length band x replica, columns ``summary.ROW_COLUMNS`` (docs/report.md)."""

from __future__ import annotations

import csv
import io
from dataclasses import astuple

from kvwatch.report.summary import ROW_COLUMNS, Report


def _cell(value: object) -> object:
    if value is None:
        return ""
    if isinstance(value, float):
        return format(value, ".10g")
    return value


def render_csv(report: Report) -> str:
    """Empty cell = not known (no request in the band had the value, or the input lacks it)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(ROW_COLUMNS)
    for row in report.rows:
        writer.writerow([_cell(v) for v in astuple(row)])
    return out.getvalue()
