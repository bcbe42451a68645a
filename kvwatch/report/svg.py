"""Small hand-written SVG charts for the HTML report: no plotting library, no script.

Each function returns one ``<svg>`` element as text. Colours come from CSS classes (``s0``, ``s1``
... for series, ``b0``, ``b1`` ... for length bands) defined by the page; every bar has a
``<title>`` so hovering shows its exact value. All text is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape

Formatter = Callable[[float | None], str]

_LEFT, _RIGHT, _TOP, _BOTTOM = 58, 12, 30, 42


def _num(x: float) -> str:
    return f"{x:.1f}"


def _text(x: float, y: float, text: str, cls: str = "", anchor: str = "middle") -> str:
    cls_attr = f' class="{cls}"' if cls else ""
    return f'<text x="{_num(x)}" y="{_num(y)}" text-anchor="{anchor}"{cls_attr}>{escape(text)}</text>'


def _open(width: int, height: int, title: str) -> list[str]:
    return [
        f'<svg class="chart" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
        _text(width / 2, 18, title, "title"),
    ]


class _Scale:
    """Value -> pixel on the y axis (linear from 0, or log10 over whole decades) with tick values."""

    def __init__(self, values: Sequence[float], log: bool, top: float, bottom: float) -> None:
        positive = [v for v in values if v > 0]
        self.log = log and bool(positive)
        self.top, self.bottom = top, bottom
        if self.log:
            self.lo = 10 ** math.floor(math.log10(min(positive)))
            self.hi = 10 ** math.ceil(math.log10(max(positive)))
            if self.hi <= self.lo:
                self.hi = self.lo * 10
            decades = range(round(math.log10(self.lo)), round(math.log10(self.hi)) + 1)
            self.ticks = [10.0**d for d in decades]
        else:
            top_value = max(values, default=0.0) or 1.0
            step = _nice_step(top_value / 4)
            self.lo, self.hi = 0.0, step * math.ceil(top_value / step)
            self.ticks = [step * i for i in range(round(self.hi / step) + 1)]

    def y(self, value: float) -> float:
        if self.log:
            value = max(value, self.lo)
            frac = (math.log10(value) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            frac = (value - self.lo) / (self.hi - self.lo)
        return self.bottom - frac * (self.bottom - self.top)


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * exp:
            return m * exp
    return 10 * exp


def _y_axis(parts: list[str], scale: _Scale, width: int, fmt: Formatter) -> None:
    for tick in scale.ticks:
        y = scale.y(tick)
        parts.append(f'<line class="grid" x1="{_LEFT}" x2="{width - _RIGHT}" y1="{_num(y)}" y2="{_num(y)}"/>')
        parts.append(_text(_LEFT - 6, y + 4, fmt(tick), "tick", "end"))


def _legend(parts: list[str], names: Sequence[str], width: int) -> None:
    x = width - _RIGHT
    for i in reversed(range(len(names))):
        x -= 8 + 6 * len(names[i]) + 14
        parts.append(f'<rect class="s{i}" x="{_num(x)}" y="{_TOP - 12}" width="10" height="10"/>')
        parts.append(_text(x + 14, _TOP - 3, names[i], "legend", "start"))


def grouped_bars(
    title: str,
    categories: Sequence[str],
    series: Sequence[tuple[str, Sequence[float | None]]],
    fmt: Formatter,
    *,
    log: bool = False,
    width: int = 380,
    height: int = 240,
) -> str:
    """Vertical bars per category, one per series side by side (e.g. p50 and p99 per band)."""
    values = [v for _, vals in series for v in vals if v is not None and math.isfinite(v)]
    scale = _Scale(values, log, _TOP + 6, height - _BOTTOM)
    parts = _open(width, height, title)
    _y_axis(parts, scale, width, fmt)
    _legend(parts, [name for name, _ in series], width)
    slot = (width - _LEFT - _RIGHT) / max(len(categories), 1)
    bar = slot * 0.8 / max(len(series), 1)
    for ci, category in enumerate(categories):
        x0 = _LEFT + ci * slot + slot * 0.1
        for si, (name, vals) in enumerate(series):
            value = vals[ci]
            if value is None or not math.isfinite(value):
                continue
            y = scale.y(value)
            label = f"{category} {name}: {fmt(value)}"
            parts.append(
                f'<rect class="s{si}" x="{_num(x0 + si * bar)}" y="{_num(y)}" '
                f'width="{_num(bar - 1)}" height="{_num(scale.bottom - y)}">'
                f"<title>{escape(label)}</title></rect>"
            )
        parts.append(_text(_LEFT + ci * slot + slot / 2, height - _BOTTOM + 16, category, "tick"))
    parts.append(
        f'<line class="axis" x1="{_LEFT}" x2="{width - _RIGHT}" y1="{_num(scale.bottom)}" '
        f'y2="{_num(scale.bottom)}"/>'
    )
    parts.append("</svg>")
    return "\n".join(parts)


def histogram(
    title: str,
    edges: Sequence[float],
    counts: Sequence[int],
    bin_class: Sequence[str],
    markers: Sequence[tuple[float, str]],
    fmt_x: Formatter,
    *,
    width: int = 780,
    height: int = 260,
) -> str:
    """Equal-width bars over (log-spaced) bins; ``markers`` are labelled dashed lines at x values."""
    scale = _Scale([float(c) for c in counts], False, _TOP + 6, height - _BOTTOM)
    parts = _open(width, height, title)
    _y_axis(parts, scale, width, lambda v: f"{v:,.0f}" if v is not None else "")
    n = max(len(counts), 1)
    slot = (width - _LEFT - _RIGHT) / n

    def x_of(value: float) -> float:
        """Pixel of a token count: position within its bin, interpolated in log space."""
        for i in range(n):
            lo, hi = edges[i], edges[i + 1]
            if value <= hi:
                if lo <= 0:
                    frac = value / hi if hi else 0.0
                else:
                    frac = (math.log(max(value, lo)) - math.log(lo)) / (math.log(hi) - math.log(lo))
                return _LEFT + (i + frac) * slot
        return width - _RIGHT

    for i, c in enumerate(counts):
        y = scale.y(c)
        label = f"{fmt_x(edges[i])}-{fmt_x(edges[i + 1])} tokens: {c:,} requests"
        parts.append(
            f'<rect class="{bin_class[i]}" x="{_num(_LEFT + i * slot)}" y="{_num(y)}" '
            f'width="{_num(max(slot - 1, 1))}" height="{_num(scale.bottom - y)}">'
            f"<title>{escape(label)}</title></rect>"
        )
    if edges:
        decade = 1.0
        while decade <= edges[-1]:
            x = x_of(decade)
            parts.append(_text(x, height - _BOTTOM + 16, fmt_x(decade), "tick"))
            decade *= 10
    for value, label in markers:
        x = x_of(value)
        parts.append(
            f'<line class="marker" x1="{_num(x)}" x2="{_num(x)}" y1="{_TOP}" y2="{_num(scale.bottom)}"/>'
        )
        parts.append(_text(x + 3, _TOP + 8, label, "marker-label", "start"))
    parts.append(_text(width / 2, height - 8, "output tokens (log scale)", "tick"))
    parts.append("</svg>")
    return "\n".join(parts)


def share_bars(
    title: str,
    labels: Sequence[str],
    series: Sequence[tuple[str, Sequence[float | None]]],
    *,
    width: int = 780,
    row_height: int = 30,
) -> str:
    """Horizontal bars of shares (0..1) per label, one bar per series (e.g. requests vs KV held)."""
    left = 90
    height = _TOP + 10 + row_height * len(labels) + 10
    parts = _open(width, height, title)
    _legend(parts, [name for name, _ in series], width)
    span = width - left - 70
    bar = (row_height - 6) / max(len(series), 1)
    for li, label in enumerate(labels):
        y0 = _TOP + 10 + li * row_height
        parts.append(_text(left - 8, y0 + row_height / 2 + 2, label, "tick", "end"))
        for si, (name, vals) in enumerate(series):
            value = vals[li]
            if value is None:
                continue
            w = max(value * span, 0.5)
            y = y0 + si * bar
            text = f"{value * 100:.1f}%"
            tip = escape(f"{label} {name}: {text}")
            parts.append(
                f'<rect class="s{si}" x="{left}" y="{_num(y)}" width="{_num(w)}" '
                f'height="{_num(bar - 1)}"><title>{tip}</title></rect>'
            )
            parts.append(_text(left + w + 4, y + bar - 3, text, "value", "start"))
    parts.append("</svg>")
    return "\n".join(parts)
