"""Cumulative counters read at two scrapes: increase and per-second rate, restart-aware.

The one place kvwatch turns two reads of an engine (or NVML) counter into an increase. The rule is
Prometheus's: a counter that went down was reset (the engine restarted) and counted again from zero,
so the increase is the current value.
"""

from __future__ import annotations

from collections.abc import Iterable


def was_reset(previous: float | None, current: float | None) -> bool:
    """True when the counter went backwards between the two reads (engine restart)."""
    return previous is not None and current is not None and current < previous


def increase(previous: float | None, current: float | None) -> float | None:
    """Increase between two reads; ``None`` when either read is missing.

    After a reset the increase is the current value (what was counted since the restart), which
    is a lower bound of the true increase over the interval.
    """
    if previous is None or current is None:
        return None
    if current < previous:
        return current
    return current - previous


def per_second(previous: float | None, current: float | None, seconds: float) -> float | None:
    """Average rate over ``seconds``; ``None`` when a read is missing or the interval is not positive."""
    if seconds <= 0:
        return None
    delta = increase(previous, current)
    return None if delta is None else delta / seconds


def total(values: Iterable[float | None]) -> float | None:
    """Sum of readings that must all be known (a replica's ranks, a replica's GPUs); else ``None``."""
    result = 0.0
    for value in values:
        if value is None:
            return None
        result += value
    return result
