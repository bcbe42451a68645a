"""The SLO file: per model and output-length band objectives, validated with key paths.

One objective says, for one model (or every model) and one or more length bands, what share of
requests must be good over the SLO period. Two kinds of SLI (docs/alerting.md):

* **latency** (``ttft``, ``tpot``, ``e2e``): good = requests whose value is at most ``threshold``,
  among requests that have the value (TTFT needs a first token, TPOT two output tokens). The
  threshold must be a bucket boundary of kvwatch's histogram (``kvwatch/buckets.py``): the good
  count is then read exactly from one ``le`` bucket instead of being interpolated.
* **completion**: good = requests that ended in a ``good_outcomes`` outcome, bad = those in
  ``bad_outcomes``; outcomes in neither list are not counted at all. Default good
  ``completed, truncated`` (a ``length`` finish is the token budget the client asked for), bad
  ``error``; ``aborted`` (client went away) and ``rejected`` (4xx) are left out by default because
  clients cancel and misbehave for reasons of their own. Add ``aborted`` to ``bad_outcomes`` to
  spend budget on abandonment.

Errors reuse ``kvwatch.config.ConfigError`` so ``kvwatch rules`` reports every problem at once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwatch import buckets
from kvwatch.catalog import spec
from kvwatch.config import ConfigError, KeyPathReader, parse_duration, read_yaml_file, short_name
from kvwatch.mixin.thresholds import AlertConfig, alert_config_from_mapping
from kvwatch.model import OUTCOMES, LengthBands

#: latency SLIs: name -> (histogram family, bucket boundaries)
LATENCY_SLIS: Mapping[str, tuple[str, tuple[float, ...]]] = {
    "ttft": ("kvwatch_request_ttft_seconds", buckets.TTFT_SECONDS),
    "tpot": ("kvwatch_request_tpot_seconds", buckets.TPOT_SECONDS),
    "e2e": ("kvwatch_request_duration_seconds", buckets.DURATION_SECONDS),
}
COMPLETION = "completion"
SLIS = (*LATENCY_SLIS, COMPLETION)
OUTCOMES_FAMILY = "kvwatch_requests"

DEFAULT_GOOD_OUTCOMES = ("completed", "truncated")
DEFAULT_BAD_OUTCOMES = ("error",)

#: The fastest burn factor kvwatch alerts on (rules.BURN_WINDOWS); an objective whose budget times
#: this reaches 1 could never page, which an SLO file must not do silently.
FASTEST_BURN = 14.4
#: The longest alert window; the SLO period must cover it.
LONGEST_ALERT_WINDOW_S = 3 * 86400

ANY_MODEL = "*"
_LABEL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PROM_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: labels an objective may not pin with ``matchers``: the rules aggregate or compute them
_RESERVED_LABELS = frozenset({"__name__", "le", "model_name", "length_band", "outcome"})


@dataclass(frozen=True, slots=True)
class Objective:
    """One SLO: ``objective`` of the requests of ``model`` in each of ``bands`` are good."""

    name: str  # the `slo` label value
    sli: str  # ttft | tpot | e2e | completion
    objective: float  # 0 < objective < 1
    bands: tuple[str, ...]
    model: str = ANY_MODEL  # "*" = every model, one series per model_name
    threshold: float | None = None  # seconds; latency SLIs only; an exact bucket boundary
    good_outcomes: tuple[str, ...] = DEFAULT_GOOD_OUTCOMES  # completion only
    bad_outcomes: tuple[str, ...] = DEFAULT_BAD_OUTCOMES  # completion only
    min_requests: int = 20  # requests a band needs in an alert's long window before it may alert
    matchers: tuple[tuple[str, str], ...] = ()  # extra exact label matchers, e.g. source=proxy
    description: str = ""

    @property
    def error_budget(self) -> float:
        """Allowed error ratio, ``1 - objective``, rounded so 1 - 0.99 prints as 0.01."""
        return round(1.0 - self.objective, 12)

    @property
    def is_latency(self) -> bool:
        return self.sli in LATENCY_SLIS

    @property
    def family(self) -> str:
        return LATENCY_SLIS[self.sli][0] if self.is_latency else OUTCOMES_FAMILY


@dataclass(frozen=True, slots=True)
class SloFile:
    period: str  # Prometheus duration of the error-budget window, e.g. "28d"
    bands: LengthBands
    long_bands: tuple[str, ...]  # watched by KVWatchLongRequestsStarving
    short_bands: tuple[str, ...]  # the comparison: these must still be fine
    objectives: tuple[Objective, ...]
    alerts: AlertConfig = field(default_factory=AlertConfig)  # the operational alerts' knobs

    @property
    def period_seconds(self) -> int:
        return prom_duration_seconds(self.period)


# --------------------------------------------------------------------------------------------
# value readers (each raises ValueError with the message the user sees)
# --------------------------------------------------------------------------------------------


def prom_duration_seconds(text: str) -> int:
    m = _PROM_DURATION.match(text)
    if not m:
        raise ValueError(f"expected a Prometheus duration such as 28d or 30d, got {text!r}")
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def _period(value: Any) -> str:
    text = str(value).strip()
    seconds = prom_duration_seconds(text)
    if seconds < LONGEST_ALERT_WINDOW_S:
        raise ValueError(f"the period must be at least 3d (the longest alert window), got {text!r}")
    return text


def _sli(value: Any) -> str:
    text = str(value).lower()
    if text not in SLIS:
        raise ValueError(f"unknown sli {value!r} (one of {', '.join(SLIS)})")
    return text


def _objective(value: Any) -> float:
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            ratio = float(value.strip()[:-1]) / 100.0
        except ValueError:
            raise ValueError(f"expected a ratio such as 0.99 or 99%, got {value!r}") from None
    elif isinstance(value, int | float) and not isinstance(value, bool):
        ratio = float(value)
    else:
        raise ValueError(f"expected a ratio such as 0.99 or 99%, got {value!r}")
    if not 0.0 < ratio < 1.0 or math.isnan(ratio):
        raise ValueError(f"the objective must be between 0 and 1 (exclusive), e.g. 0.99; got {value!r}")
    if FASTEST_BURN * (1.0 - ratio) >= 1.0:
        floor = 1.0 - 1.0 / FASTEST_BURN
        raise ValueError(
            f"objective {ratio:g} leaves an error budget so large that the {FASTEST_BURN:g}x page would "
            f"need an error ratio of {FASTEST_BURN * (1 - ratio):.2f} (> 1) and could never fire; "
            f"use an objective above {floor:.4f}")
    return ratio


def _min_requests(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected a whole number of requests >= 1, got {value!r}")
    return value


def _seconds(value: Any) -> float:
    """A threshold: a number of seconds or a duration string such as ``60ms`` or ``2s``."""
    return parse_duration(value)


def boundary_for(sli: str, seconds: float) -> float:
    """The histogram bucket boundary equal to ``seconds``; ValueError lists the boundaries."""
    family, bounds = LATENCY_SLIS[sli]
    for bound in bounds:
        if math.isclose(bound, seconds, rel_tol=1e-9, abs_tol=1e-12):
            return bound
    below = [b for b in bounds if b < seconds]
    above = [b for b in bounds if b > seconds]
    nearest = ", ".join(buckets.le_label(b) for b in (below[-1:] + above[:1]))
    raise ValueError(
        f"{seconds:g} s is not a bucket boundary of {family} (nearest: {nearest}); "
        f"boundaries: {', '.join(buckets.le_label(b) for b in bounds)}")


def _bands(value: Any, bands: LengthBands) -> tuple[str, ...]:
    if value == "*":
        return bands.names
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"expected a list of length bands, or '*' for all of {', '.join(bands.names)}")
    names = tuple(str(v) for v in value)
    unknown = [n for n in names if n not in bands.all_names]
    if unknown:
        raise ValueError(f"unknown length band(s) {', '.join(map(repr, unknown))} "
                         f"(valid: {', '.join(bands.all_names)})")
    if len(set(names)) != len(names):
        raise ValueError(f"a band is listed twice in {list(names)}")
    return names


def _outcomes(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"expected a list of outcomes (from {', '.join(OUTCOMES)})")
    names = tuple(str(v) for v in value)
    unknown = [n for n in names if n not in OUTCOMES]
    if unknown:
        raise ValueError(f"unknown outcome(s) {', '.join(map(repr, unknown))} (valid: {', '.join(OUTCOMES)})")
    return names


def _matchers(value: Any, family: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping):
        raise ValueError("expected a mapping of label: value, e.g. {source: proxy}")
    allowed = sorted(set(spec(family).labels) - _RESERVED_LABELS)
    out = []
    for key, val in value.items():
        label = str(key)
        if not _LABEL.match(label) or label not in allowed:
            raise ValueError(f"label {label!r} cannot be matched on {family} (allowed: {', '.join(allowed)})")
        out.append((label, str(val)))
    return tuple(out)


def _edges(value: Any) -> LengthBands:
    if not isinstance(value, list | tuple):
        raise ValueError("expected ascending token counts, e.g. [1000, 5000, 10000, 20000]")
    try:
        return LengthBands(tuple(int(v) for v in value))
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None


# --------------------------------------------------------------------------------------------
# the file
# --------------------------------------------------------------------------------------------

_TOP_KEYS = {"version", "period", "length_bands", "long_bands", "short_bands", "defaults", "objectives",
             "alerts"}
_DEFAULT_KEYS = {"model", "min_requests", "matchers"}
_OBJECTIVE_KEYS = {
    "name", "description", "sli", "threshold", "objective", "bands", "model", "min_requests", "matchers",
    "good_outcomes", "bad_outcomes",
}


def _objective_entry(r: KeyPathReader, node: Any, path: str, bands: LengthBands,
                     defaults: Mapping[str, Any]) -> Objective | None:
    m = r.mapping(node, path, _OBJECTIVE_KEYS)
    if not m:
        r.problem(path, "expected an objective with at least name, sli, objective and bands")
        return None
    name = r.get(m, "name", path, short_name, required=True)
    sli = r.get(m, "sli", path, _sli, required=True)
    objective = r.get(m, "objective", path, _objective, required=True)
    band_names = r.get(m, "bands", path, lambda v: _bands(v, bands), required=True)
    model = r.get(m, "model", path, str, default=defaults.get("model", ANY_MODEL))
    min_requests = r.get(m, "min_requests", path, _min_requests, default=defaults.get("min_requests", 20))
    description = r.get(m, "description", path, str, default="")
    threshold = None
    good, bad = DEFAULT_GOOD_OUTCOMES, DEFAULT_BAD_OUTCOMES
    if sli in LATENCY_SLIS:
        threshold = r.get(m, "threshold", path, lambda v: boundary_for(sli, _seconds(v)), required=True)
        for key in ("good_outcomes", "bad_outcomes"):
            if key in m:
                r.problem(f"{path}.{key}", f"only completion objectives count outcomes (this one is {sli})")
    elif sli == COMPLETION:
        if "threshold" in m:
            r.problem(f"{path}.threshold", "a completion objective has no latency threshold")
        good = r.get(m, "good_outcomes", path, _outcomes)
        bad = r.get(m, "bad_outcomes", path, _outcomes)
        both = sorted(set(good or ()) & set(bad or ()))
        if both:
            r.problem(f"{path}.bad_outcomes", f"{', '.join(both)} cannot be both good and bad")
        good = good or DEFAULT_GOOD_OUTCOMES
        bad = bad or DEFAULT_BAD_OUTCOMES
    family = LATENCY_SLIS[sli][0] if sli in LATENCY_SLIS else OUTCOMES_FAMILY
    matchers = ()
    if sli is not None:
        raw = m.get("matchers", defaults.get("matchers"))
        if raw is not None:
            try:
                matchers = _matchers(raw, family)
            except ValueError as exc:
                r.problem(f"{path}.matchers", str(exc))
    if None in (name, sli, objective, band_names) or (sli in LATENCY_SLIS and threshold is None):
        return None
    return Objective(name=name, sli=sli, objective=objective, bands=band_names, model=model,
                     threshold=threshold, good_outcomes=good, bad_outcomes=bad, min_requests=min_requests,
                     matchers=matchers, description=description)


def _edge_bands(bands: LengthBands) -> int:
    """How many bands at each end count as long / short by default (two of five, one of three)."""
    return 2 if len(bands.names) >= 4 else 1


def _default_long(bands: LengthBands) -> tuple[str, ...]:
    return bands.names[-_edge_bands(bands):]


def _default_short(bands: LengthBands) -> tuple[str, ...]:
    return bands.names[:_edge_bands(bands)]


def slo_from_mapping(data: Any, source: str = "slo file") -> SloFile:
    """Validate a parsed SLO document; raise ConfigError listing every problem with its key path."""
    r = KeyPathReader()
    top = r.mapping(data, "", _TOP_KEYS)
    version = top.get("version", 1)
    if version != 1:
        r.problem("version", f"unsupported version {version!r} (this kvwatch reads version 1)")
    period = r.get(top, "period", "", _period, default="28d")
    bands = r.get(top, "length_bands", "", _edges, default=LengthBands())
    long_bands = r.get(top, "long_bands", "", lambda v: _bands(v, bands), default=_default_long(bands))
    short_bands = r.get(top, "short_bands", "", lambda v: _bands(v, bands), default=_default_short(bands))
    overlap = sorted(set(long_bands) & set(short_bands))
    if overlap:
        r.problem("short_bands", f"{', '.join(overlap)} cannot be both a long and a short band")
    defaults = r.mapping(top.get("defaults"), "defaults", _DEFAULT_KEYS)
    if "min_requests" in defaults:
        r.get(defaults, "min_requests", "defaults", _min_requests)

    objectives: list[Objective] = []
    raw = top.get("objectives")
    if not isinstance(raw, list) or not raw:
        r.problem("objectives", "expected a non-empty list of objectives")
        raw = []
    seen: dict[str, int] = {}
    for i, node in enumerate(raw):
        obj = _objective_entry(r, node, f"objectives[{i}]", bands, defaults)
        if obj is None:
            continue
        if obj.name in seen:
            r.problem(f"objectives[{i}].name",
                      f"duplicate objective name {obj.name!r} (also objectives[{seen[obj.name]}])")
        seen[obj.name] = i
        objectives.append(obj)
    alerts = alert_config_from_mapping(top.get("alerts"), "alerts", r.problems)
    if r.problems:
        raise ConfigError(r.problems, source)
    return SloFile(period=period, bands=bands, long_bands=long_bands, short_bands=short_bands,
                   objectives=tuple(objectives), alerts=alerts)


def load_slo_file(path: str | Path) -> SloFile:
    """Read and validate an SLO file; every problem is reported with its key path."""
    return slo_from_mapping(read_yaml_file(path), str(path))
