"""Aligned plain-text tables (no dependencies): the report and ``kvwatch top`` both print them."""

from __future__ import annotations

from collections.abc import Sequence


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1, gap: int = 2) -> str:
    """Columns sized to their widest cell; the first ``left`` columns left-aligned, the rest right."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    pad = " " * gap

    def line(cells: Sequence[str]) -> str:
        out = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return pad.join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])
