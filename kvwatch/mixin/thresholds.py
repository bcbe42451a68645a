"""The knobs of kvwatch's operational alerts, in the spirit of node-mixin's ``_config``: every
threshold and every ``for:`` duration, with the defaults kvwatch ships.

A user changes them in the SLO file's ``alerts:`` section (docs/alerting.md) and re-runs
``kvwatch rules``, instead of forking ``kvwatch/mixin/alerts.py``::

    alerts:
      thresholds: {kv_pressure_usage: 0.9, headroom_seconds: 600}
      for: {KVWatchKVCachePressure: 5m}

The job selector of the kvwatch targets is ``kvwatch rules --job``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

#: alert -> its default ``for:`` (None: fires at the first evaluation that sees the event)
DEFAULT_FOR: Mapping[str, str | None] = {
    "KVWatchKVCachePressure": "10m",
    "KVWatchPreemptionStorm": "10m",
    "KVWatchRecomputeWaste": "30m",
    "KVWatchKVHeadroomLow": "5m",
    "KVWatchKVTierPCIeSaturated": "15m",
    "KVWatchGPUPCIeLinkDegraded": "15m",
    "KVWatchKVCapacityStranded": "15m",
    "KVWatchLongRequestsStarving": "30m",
    "KVWatchLongRequestsPreemptedRepeatedly": "15m",
    "KVWatchGPULost": "1m",
    "KVWatchGPUCriticalXID": None,
    "KVWatchGPUXIDErrors": None,
    "KVWatchGPUUncorrectableECC": None,
    "KVWatchGPURowRemapFailure": None,
    "KVWatchGPURowRemapPending": "5m",
    "KVWatchGPUThrottled": "10m",
    "KVWatchDown": "5m",
    "KVWatchAbsent": "15m",
    "KVWatchEngineTargetDown": "5m",
    "KVWatchCollectorFailing": "15m",
    "KVWatchSourceStale": "5m",
    "KVWatchConfigReloadFailed": "10m",
}

_PROM_DURATION = re.compile(r"^(?:\d+[smhdwy])+$")


@dataclass(frozen=True, slots=True)
class AlertConfig:
    """Thresholds (``ratio`` fields are shares, 0 to 1) and ``for:`` durations of the alerts."""

    kv_pressure_usage: float = 0.95  # KV usage ratio above which preemptions mean pressure
    storm_preemptions_per_finished: float = 0.5  # preemptions per finished request: a storm
    storm_min_preemptions_per_s: float = 0.05  # and at least this many per second (3 a minute)
    recompute_waste_ratio: float = 0.2  # recomputed tokens / tokens processed
    headroom_seconds: float = 300  # seconds until the KV pool is full at its current growth
    stranded_ratio: float = 0.2  # stranded KV tokens / the model's KV capacity
    tier_pcie_ratio: float = 0.8  # KV tier traffic / one-direction PCIe bandwidth
    link_busy_utilization: float = 0.1  # GPUs lower the PCIe generation when idle to save power
    starving_long_completion: float = 0.9  # long bands completing less than this ...
    starving_short_completion: float = 0.97  # ... while short bands complete at least this ...
    starving_aborted_ratio: float = 0.05  # ... and more than this share of long ones aborted ...
    starving_min_requests: int = 20  # ... with at least this many long requests in the hour
    repeated_preemptions_per_request: float = 2.0  # mean preemptions per finished request of a band
    repeated_preemptions_min_requests: float = 10  # ... over at least this many requests in 30 minutes
    source_stale_seconds: float = 600  # a polled source without success for this long is stuck
    for_: Mapping[str, str | None] = field(default_factory=lambda: dict(DEFAULT_FOR))

    def for_of(self, alert: str) -> str | None:
        return self.for_[alert]


THRESHOLDS = tuple(f.name for f in fields(AlertConfig) if f.name != "for_")


def _threshold(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"expected a non-negative number, got {value!r}")
    is_share = "ratio" in name or name.endswith(("_usage", "_completion", "_utilization"))
    if is_share and value > 1:
        raise ValueError(f"a share from 0 to 1, got {value!r}")
    if name == "starving_min_requests" and not isinstance(value, int):
        raise ValueError(f"expected a whole number of requests, got {value!r}")
    return value


def _for(value: Any) -> str | None:
    if value in (None, "0s", "0m", 0):
        return None
    if not isinstance(value, str) or not _PROM_DURATION.match(value):
        raise ValueError(f"expected a Prometheus duration such as 5m or 1h30m, got {value!r}")
    return value


def alert_config_from_mapping(node: Any, path: str, problems: list[tuple[str, str]]) -> AlertConfig:
    """Read an ``alerts:`` section; each problem is appended as (key path, reason)."""
    if node is None:
        return AlertConfig()
    if not isinstance(node, Mapping):
        problems.append((path, f"expected a mapping with thresholds and for, got {type(node).__name__}"))
        return AlertConfig()
    changes: dict[str, Any] = {}
    for key in node:
        if key not in ("thresholds", "for"):
            problems.append((f"{path}.{key}", "unknown key (known keys: for, thresholds)"))
    for section, known, read in (("thresholds", THRESHOLDS, _threshold),
                                 ("for", tuple(DEFAULT_FOR), lambda _name, v: _for(v))):
        entries = node.get(section) or {}
        if not isinstance(entries, Mapping):
            problems.append((f"{path}.{section}", f"expected a mapping, got {type(entries).__name__}"))
            continue
        for name, value in entries.items():
            where = f"{path}.{section}.{name}"
            if name not in known:
                problems.append((where, f"unknown {'threshold' if section == 'thresholds' else 'alert'} "
                                        f"(known: {', '.join(known)})"))
                continue
            try:
                parsed = read(name, value)
            except ValueError as exc:
                problems.append((where, str(exc)))
                continue
            if section == "thresholds":
                changes[name] = parsed
            else:
                changes.setdefault("for_", dict(DEFAULT_FOR))[name] = parsed
    return replace(AlertConfig(), **changes)
