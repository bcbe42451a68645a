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

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvwatch.config.validate import INTEGER, Kind, quoted, read_value
from kvwatch.jsonsafe import finite

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
    "KVWatchNearFileDescriptorLimit": "5m",
}

_PROM_DURATION = re.compile(r"^(?:\d+[smhdwy])+$")


def _non_negative(value: Any) -> float:
    """A number at least 0, kept as written (``300`` stays an int, so rules print it so)."""
    number = finite(value)
    if number is None or number < 0:
        raise ValueError(f"expected a non-negative number, got {quoted(value)}")
    return value


def _share(value: Any) -> float:
    if _non_negative(value) > 1:
        raise ValueError(f"expected a share from 0 to 1, got {quoted(value)}")
    return value


NON_NEGATIVE = Kind("number ≥ 0", _non_negative)
SHARE = Kind("share, 0 to 1", _share)


def _knob(default: float, kind: Kind, doc: str, *, minimum: float | None = None) -> Any:
    """A threshold field: its key (``alerts.thresholds.<key>``) is the field's name."""
    return field(default=default, metadata={"kind": kind, "doc": doc, "min": minimum})


@dataclass(frozen=True, slots=True)
class AlertConfig:
    """Thresholds (``ratio`` fields are shares, 0 to 1) and ``for:`` durations of the alerts.

    Each threshold's kind and bounds are in its field's metadata, read by the config's generic value
    reader.
    """

    kv_pressure_usage: float = _knob(0.95, SHARE, "KV usage ratio above which preemptions mean pressure")
    storm_preemptions_per_finished: float = _knob(
        0.5, NON_NEGATIVE, "preemptions per finished request: a storm"
    )
    storm_min_preemptions_per_s: float = _knob(
        0.05, NON_NEGATIVE, "and at least this many per second (3 a minute)"
    )
    recompute_waste_ratio: float = _knob(0.2, SHARE, "recomputed tokens / tokens processed")
    headroom_seconds: float = _knob(
        300, NON_NEGATIVE, "seconds until the KV pool is full at its current growth"
    )
    stranded_ratio: float = _knob(0.2, SHARE, "stranded KV tokens / the model's KV capacity")
    tier_pcie_ratio: float = _knob(0.8, SHARE, "KV tier traffic / one-direction PCIe bandwidth")
    link_busy_utilization: float = _knob(0.1, SHARE, "GPUs lower the PCIe generation when idle to save power")
    starving_long_completion: float = _knob(0.9, SHARE, "long bands completing less than this ...")
    starving_short_completion: float = _knob(0.97, SHARE, "... while short bands complete at least this ...")
    starving_aborted_ratio: float = _knob(
        0.05, SHARE, "... and more than this share of long ones aborted ..."
    )
    starving_min_requests: int = _knob(
        20, INTEGER, "... with at least this many long requests in the hour", minimum=0
    )
    repeated_preemptions_per_request: float = _knob(
        2.0, NON_NEGATIVE, "mean preemptions per finished request of a band"
    )
    repeated_preemptions_min_requests: float = _knob(
        10, NON_NEGATIVE, "... over at least this many requests in 30 min"
    )
    source_stale_seconds: float = _knob(
        600, NON_NEGATIVE, "a polled source without success for this long is stuck"
    )
    open_fds_ratio: float = _knob(
        0.9, SHARE, "kvwatch's open descriptors over its limit: past it, accepts fail"
    )
    for_: Mapping[str, str | None] = field(default_factory=lambda: dict(DEFAULT_FOR))

    def for_of(self, alert: str) -> str | None:
        return self.for_[alert]


_THRESHOLD_FIELDS = {f.name: f for f in fields(AlertConfig) if "kind" in f.metadata}
THRESHOLDS = tuple(_THRESHOLD_FIELDS)


def _threshold(name: str, value: Any) -> float:
    return read_value(_THRESHOLD_FIELDS[name].metadata, value)


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
    for section, known, read in (
        ("thresholds", THRESHOLDS, _threshold),
        ("for", tuple(DEFAULT_FOR), lambda _name, v: _for(v)),
    ):
        entries = node.get(section) or {}
        if not isinstance(entries, Mapping):
            problems.append((f"{path}.{section}", f"expected a mapping, got {type(entries).__name__}"))
            continue
        for name, value in entries.items():
            where = f"{path}.{section}.{name}"
            if name not in known:
                problems.append(
                    (
                        where,
                        f"unknown {'threshold' if section == 'thresholds' else 'alert'} "
                        f"(known: {', '.join(known)})",
                    )
                )
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
