"""Numbers for people: durations, token counts, byte sizes, ratios. One place, every view uses it.

Every function takes ``None`` (or NaN) for "not known" and returns ``MISSING`` for it, so a table
never shows 0 for a value nobody measured.
"""

from __future__ import annotations

import math
import time

MISSING = "-"
_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
_BINARY = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def _unknown(value: float | None) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def seconds(value: float | None) -> str:
    """``850ms``, ``1.25s``, ``12.5s``, ``450s``, ``2.5h``; ``inf`` for +Inf."""
    if _unknown(value):
        return MISSING
    assert value is not None
    if math.isinf(value):
        return "inf"
    if value == 0:
        return "0s"
    if abs(value) < 0.001:
        return f"{value * 1e6:.0f}us"
    if abs(value) < 1:
        return f"{value * 1e3:.3g}ms"
    if abs(value) < 1000:
        return f"{value:.3g}s"
    if abs(value) < 7200:
        return f"{value / 60:.0f}m"
    return f"{value / 3600:.1f}h"


def si(value: float | None, digits: int = 3) -> str:
    """``950``, ``12.3k``, ``4.5M``, ``1.34T`` (``digits`` significant digits above 1000)."""
    if _unknown(value):
        return MISSING
    assert value is not None
    if math.isinf(value):
        return "inf"
    for scale, suffix in _SI:
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g}{suffix}"
    if value == int(value):
        return f"{int(value)}"
    return f"{value:.{digits}g}"


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
    """``80.0GiB``, ``512MiB``, ``900B``."""
    if _unknown(value):
        return MISSING
    assert value is not None
    for scale, suffix in _BINARY:
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.0f}B"


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
