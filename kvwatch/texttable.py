"""Aligned plain-text tables (no dependencies): the report and ``kvwatch top`` both print them."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence


def columns(text: str) -> int:
    """The terminal columns ``text`` takes: East Asian wide and fullwidth characters two (a model
    named in Chinese), combining marks none, the rest one."""
    return sum(_columns(c) for c in text)


def _columns(char: str) -> int:
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def cut(text: str, width: int) -> str:
    """The longest start of ``text`` that fits in ``width`` columns."""
    used = 0
    for i, char in enumerate(text):
        used += _columns(char)
        if used > width:
            return text[:i]
    return text


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1, gap: int = 2) -> str:
    """Columns sized to their widest cell; the first ``left`` columns left-aligned, the rest right."""
    widths = [columns(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], columns(cell))
    pad = " " * gap

    def line(cells: Sequence[str]) -> str:
        out = [_aligned(c, w, i < left) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return pad.join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def _aligned(cell: str, width: int, left: bool) -> str:
    fill = " " * (width - columns(cell))
    return cell + fill if left else fill + cell
