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

Keys, kinds and bounds are declared in the fields' metadata and read by the config's generic
validator (``kvwatch.config.validate``); only the rules that depend on other keys (bands, thresholds,
matchers, outcomes) are read here. Errors reuse ``ConfigError`` so ``kvwatch rules`` reports every
problem at once.
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
from kvwatch.config import ConfigError, KeyPathReader, parse_duration, read_yaml_file
from kvwatch.config.validate import (
    EDGES,
    INTEGER,
    NAME,
    STRING,
    WORD,
    Kind,
    caller_reads,
    setting,
)
from kvwatch.jsonsafe import finite
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


def _objective(value: Any) -> float:
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            ratio = float(value.strip()[:-1]) / 100.0
        except ValueError:
            raise ValueError(f"expected a ratio such as 0.99 or 99%, got {value!r}") from None
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = finite(value)
        ratio = math.nan if number is None else number  # too large for a float: out of range below
    else:
        raise ValueError(f"expected a ratio such as 0.99 or 99%, got {value!r}")
    if not 0.0 < ratio < 1.0 or math.isnan(ratio):
        raise ValueError(f"the objective must be between 0 and 1 (exclusive), e.g. 0.99; got {value!r}")
    if FASTEST_BURN * (1.0 - ratio) >= 1.0:
        floor = 1.0 - 1.0 / FASTEST_BURN
        raise ValueError(
            f"objective {ratio:g} leaves an error budget so large that the {FASTEST_BURN:g}x page would "
            f"need an error ratio of {FASTEST_BURN * (1 - ratio):.2f} (> 1) and could never fire; "
            f"use an objective above {floor:.4f}"
        )
    return ratio


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
        f"boundaries: {', '.join(buckets.le_label(b) for b in bounds)}"
    )


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
        raise ValueError(
            f"unknown length band(s) {', '.join(map(repr, unknown))} (valid: {', '.join(bands.all_names)})"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"a band is listed twice in {list(names)}")
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


def _outcome_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"expected a list of outcomes (from {', '.join(OUTCOMES)})")
    return tuple(str(v) for v in value)


RATIO = Kind("ratio (`0.99` or `99%`)", _objective)
PERIOD = Kind("Prometheus duration (at least 3d)", _period)
OUTCOME_LIST = Kind("list of outcomes", _outcome_list)


@dataclass(frozen=True, slots=True)
class Objective:
    """One SLO: ``objective`` of the requests of ``model`` in each of ``bands`` are good."""

    name: str = field(metadata=setting("name", NAME, "the `slo` label value"))
    sli: str = field(metadata=setting("sli", WORD, "what is measured", choices=SLIS))
    objective: float = field(metadata=setting("objective", RATIO, "share of good requests, 0 to 1"))
    bands: tuple[str, ...] = field(metadata=caller_reads("bands", "length bands, or `*` for all"))
    model: str = field(
        default=ANY_MODEL, metadata=setting("model", STRING, "`*` = every model, one series per model_name")
    )
    threshold: float | None = field(
        default=None,
        metadata=caller_reads("threshold", "seconds; latency SLIs only; an exact bucket boundary"),
    )
    good_outcomes: tuple[str, ...] = field(
        default=DEFAULT_GOOD_OUTCOMES,
        metadata=setting(
            "good_outcomes", OUTCOME_LIST, "completion only", choices=OUTCOMES, choice_name="outcome(s)"
        ),
    )
    bad_outcomes: tuple[str, ...] = field(
        default=DEFAULT_BAD_OUTCOMES,
        metadata=setting(
            "bad_outcomes", OUTCOME_LIST, "completion only", choices=OUTCOMES, choice_name="outcome(s)"
        ),
    )
    min_requests: int = field(
        default=20,
        metadata=setting(
            "min_requests",
            INTEGER,
            "requests a band needs in an alert's long window before it may alert",
            minimum=1,
        ),
    )
    matchers: tuple[tuple[str, str], ...] = field(
        default=(), metadata=caller_reads("matchers", "extra exact label matchers, e.g. {source: proxy}")
    )
    description: str = field(default="", metadata=setting("description", STRING, "shown in the alert"))

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
class SloDefaults:
    """``defaults:``: what every objective takes unless it says otherwise."""

    model: str | None = field(default=None, metadata=setting("model", STRING, "as objectives[].model"))
    min_requests: int | None = field(
        default=None, metadata=setting("min_requests", INTEGER, "as objectives[].min_requests", minimum=1)
    )
    matchers: Any = field(default=None, metadata=caller_reads("matchers", "as objectives[].matchers"))


@dataclass(frozen=True, slots=True)
class SloFile:
    long_bands: tuple[str, ...] = field(
        metadata=caller_reads("long_bands", "watched by KVWatchLongRequestsStarving")
    )
    short_bands: tuple[str, ...] = field(
        metadata=caller_reads("short_bands", "the comparison: these must still be fine")
    )
    objectives: tuple[Objective, ...] = field(metadata=caller_reads("objectives", "the objectives"))
    period: str = field(
        default="28d",
        metadata=setting("period", PERIOD, "Prometheus duration of the error-budget window, e.g. 28d"),
    )
    bands: LengthBands = field(
        default_factory=LengthBands,
        metadata=setting("length_bands", EDGES, "output-length band edges in tokens"),
    )
    alerts: AlertConfig = field(
        default_factory=AlertConfig,
        metadata=caller_reads(
            "alerts", "the operational alerts' thresholds and for: durations (mixin/thresholds.py)"
        ),
    )


# --------------------------------------------------------------------------------------------
# the file
# --------------------------------------------------------------------------------------------

#: keys of the file beyond SloFile's fields: its format version and the objectives' defaults
_FILE_ONLY_KEYS = frozenset({"version", "defaults"})


def _objective_entry(
    r: KeyPathReader, node: Any, path: str, bands: LengthBands, defaults: SloDefaults
) -> Objective | None:
    if not isinstance(node, Mapping) or not node:
        r.mapping(node, path, set())
        r.problem(path, "expected an objective with at least name, sli, objective and bands")
        return None
    before = len(r.problems)
    values = r.values(node, path, Objective)
    bad_keys = {where for where, _ in r.problems[before:]}
    m: Mapping[str, Any] = node
    for key, fallback in (("model", defaults.model), ("min_requests", defaults.min_requests)):
        if m.get(key) is None and fallback is not None:
            values[key] = fallback
    sli = values["sli"]
    band_names = r.get(m, "bands", path, lambda v: _bands(v, bands), required=True)
    threshold = None
    if sli in LATENCY_SLIS:
        threshold = r.get(m, "threshold", path, lambda v: boundary_for(sli, _seconds(v)), required=True)
        for key in ("good_outcomes", "bad_outcomes"):
            if key in m:
                r.problem(f"{path}.{key}", f"only completion objectives count outcomes (this one is {sli})")
        values["good_outcomes"], values["bad_outcomes"] = DEFAULT_GOOD_OUTCOMES, DEFAULT_BAD_OUTCOMES
    elif sli == COMPLETION:
        if "threshold" in m:
            r.problem(f"{path}.threshold", "a completion objective has no latency threshold")
        both = sorted(set(values["good_outcomes"]) & set(values["bad_outcomes"]))
        if both and not bad_keys & {f"{path}.good_outcomes", f"{path}.bad_outcomes"}:
            r.problem(f"{path}.bad_outcomes", f"{', '.join(both)} cannot be both good and bad")
    family = LATENCY_SLIS[sli][0] if sli in LATENCY_SLIS else OUTCOMES_FAMILY
    matchers: tuple[tuple[str, str], ...] = ()
    if sli is not None:
        raw = m.get("matchers", defaults.matchers)
        if raw is not None:
            try:
                matchers = _matchers(raw, family)
            except ValueError as exc:
                r.problem(f"{path}.matchers", str(exc))
    if None in (values["name"], sli, values["objective"], band_names) or (
        sli in LATENCY_SLIS and threshold is None
    ):
        return None
    return Objective(**values, bands=band_names, threshold=threshold, matchers=matchers)


def _edge_bands(bands: LengthBands) -> int:
    """How many bands at each end count as long / short by default (two of five, one of three)."""
    return 2 if len(bands.names) >= 4 else 1


def _default_long(bands: LengthBands) -> tuple[str, ...]:
    return bands.names[-_edge_bands(bands) :]


def _default_short(bands: LengthBands) -> tuple[str, ...]:
    return bands.names[: _edge_bands(bands)]


def slo_from_mapping(data: Any, source: str = "slo file") -> SloFile:
    """Validate a parsed SLO document; raise ConfigError listing every problem with its key path."""
    r = KeyPathReader()
    top = data if isinstance(data, Mapping) else {}
    version = top.get("version", 1)
    if version != 1:
        r.problem("version", f"unsupported version {version!r} (this kvwatch reads version 1)")
    read = r.values(data, "", SloFile, also=_FILE_ONLY_KEYS)
    period, bands = read["period"], read["bands"]
    long_bands = r.get(top, "long_bands", "", lambda v: _bands(v, bands), default=_default_long(bands))
    short_bands = r.get(top, "short_bands", "", lambda v: _bands(v, bands), default=_default_short(bands))
    overlap = sorted(set(long_bands) & set(short_bands))
    if overlap:
        r.problem("short_bands", f"{', '.join(overlap)} cannot be both a long and a short band")
    defaults = SloDefaults(
        **r.values(top.get("defaults"), "defaults", SloDefaults),
        matchers=(top.get("defaults") or {}).get("matchers")
        if isinstance(top.get("defaults"), Mapping)
        else None,
    )

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
            r.problem(
                f"objectives[{i}].name",
                f"duplicate objective name {obj.name!r} (also objectives[{seen[obj.name]}])",
            )
        seen[obj.name] = i
        objectives.append(obj)
    alerts = alert_config_from_mapping(top.get("alerts"), "alerts", r.problems)
    if r.problems:
        raise ConfigError(r.problems, source)
    return SloFile(
        period=period,
        bands=bands,
        long_bands=long_bands,
        short_bands=short_bands,
        objectives=tuple(objectives),
        alerts=alerts,
    )


def load_slo_file(path: str | Path) -> SloFile:
    """Read and validate an SLO file; every problem is reported with its key path."""
    return slo_from_mapping(read_yaml_file(path), str(path))
