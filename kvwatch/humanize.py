"""Numbers for people: durations, token counts, byte sizes, ratios. One place, every view uses it.

Every function takes ``None`` (or NaN) for "not known" and returns ``MISSING`` for it, so a table
never shows 0 for a value nobody measured.
"""

from __future__ import annotations

import math
import time

MISSING = "-"
#: (scale, suffix) from the smallest unit up
_SI = ((1.0, ""), (1e3, "k"), (1e6, "M"), (1e9, "G"), (1e12, "T"))
_BINARY = ((1.0, "B"), (2.0**10, "KiB"), (2.0**20, "MiB"), (2.0**30, "GiB"), (2.0**40, "TiB"))
_SUBSECOND = ((1e-6, "us"), (1e-3, "ms"), (1.0, "s"))


def _unknown(value: float | None) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _figure(value: float, digits: int) -> str:
    """``value`` to ``digits`` significant digits, never with an exponent (``150``, not ``1.5e+02``)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(digits - 1 - math.floor(math.log10(abs(value))), 0)
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _scaled(value: float, units: tuple[tuple[float, str], ...], digits: int) -> str:
    """``value`` in the largest unit it reaches, one unit up where rounding makes the figure 1000
    (999,600 is ``1M``, not ``1000k``)."""
    first = max((i for i, (scale, _) in enumerate(units) if abs(value) >= scale), default=0)
    for scale, suffix in units[first:]:
        figure = _figure(value / scale, digits)
        if abs(float(figure)) < 1000:
            return figure + suffix
    return figure + suffix  # beyond the largest unit


def seconds(value: float | None) -> str:
    """``850ms``, ``1.25s``, ``12.5s``, ``450s``, ``17m``, ``2.5h``; ``inf`` for +Inf."""
    if _unknown(value):
        return MISSING
    assert value is not None
    if math.isinf(value):
        return "inf"
    if value == 0:
        return "0s"
    if abs(value) >= 7200:
        return f"{value / 3600:.1f}h"
    if abs(float(_figure(value, 3))) >= 1000:
        return f"{value / 60:.0f}m"
    return _scaled(value, _SUBSECOND, 3)


def si(value: float | None, digits: int = 3) -> str:
    """``950``, ``12.3k``, ``4.5M``, ``1.34T`` (``digits`` significant digits, more for a whole
    part that has more)."""
    if _unknown(value):
        return MISSING
    assert value is not None
    if math.isinf(value):
        return "inf"
    return _scaled(value, _SI, digits)


def count(value: float | None) -> str:
    """A whole count with thousands separators: ``1,000,000``."""
    if _unknown(value):
        return MISSING
    assert value is not None
    return f"{round(value):,}"


def ratio(value: float | None, digits: int = 1) -> str:
    """``95.1%``."""
    if _unknown(value):
        return MISSING
    assert value is not None
    return f"{value * 100:.{digits}f}%"


def nbytes(value: float | None) -> str:
    """``80GiB``, ``512MiB``, ``900B``; 1,000 to 1,023 of a unit is shown in the next (``0.98TiB``)."""
    if _unknown(value):
        return MISSING
    assert value is not None
    return _scaled(value, _BINARY, 3)


def rate_bytes(value: float | None) -> str:
    """``1.2GiB/s``."""
    text = nbytes(value)
    return text if text == MISSING else f"{text}/s"


def utc(ts: float | None, fmt: str = "%Y-%m-%d %H:%M:%SZ") -> str:
    """A unix time as UTC text; ``MISSING`` for one no calendar holds (NaN, 1e300: ``time.gmtime``
    raises OverflowError, OSError or ValueError on those, and a ledger or a peer can send them)."""
    if _unknown(ts):
        return MISSING
    try:
        return time.strftime(fmt, time.gmtime(ts))
    except (OverflowError, OSError, ValueError):
        return MISSING
