"""PromQL building blocks shared by the rule and dashboard generators, and the name check.

Every query kvwatch ships is built here or from these helpers, and every one is checked against the
metric catalog (``kvwatch/catalog.py``): a query on a name kvwatch does not export is a bug
that can never fire (vLLM's ``rate(vllm:num_preemptions[5m])`` alert is the cautionary tale), so the
generators refuse it. Names from other exporters are allowed only when listed in
``EXTERNAL_METRICS`` / ``EXTERNAL_PREFIXES``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvwatch.catalog import BY_NAME, MetricSpec
from kvwatch.model import LengthBands
from kvwatch.state import PREBINNED_FAMILIES, RequestStats

#: Series from other exporters that kvwatch's rules and dashboards may query, and why.
EXTERNAL_METRICS: Mapping[str, str] = {
    "up": "Prometheus: 1 if the last scrape of a target succeeded (kvwatch's own health)",
    "ALERTS": "Prometheus: series of pending and firing alerts (dashboards show kvwatch's)",
    "ALERTS_FOR_STATE": "Prometheus: activation time of pending and firing alerts",
}

#: Name prefixes of other exporters' families (joined to kvwatch's GPU series on the GPU UUID).
EXTERNAL_PREFIXES: Mapping[str, str] = {
    "DCGM_FI_": "NVIDIA dcgm-exporter GPU fields (label UUID joins kvwatch's uuid)",
}

#: Labels Prometheus or the deployment attaches to every scraped series (never in the catalog).
TARGET_LABELS = frozenset({"instance", "job", "cluster", "namespace", "pod", "container", "node"})

#: Labels kvwatch's fleet-level rules keep when they aggregate across nodes. A label that a
#: Prometheus does not have (a single-cluster setup without ``cluster``) groups as empty: harmless.
FLEET_LABELS: tuple[str, ...] = ("cluster",)

#: Histogram families the protobuf exposition also sends as native histograms: every request histogram
#: ``state.RequestStats`` keeps, but those fed pre-binned (their observations never reach kvwatch).
NATIVE_FAMILIES: frozenset[str] = frozenset(RequestStats(LengthBands()).bounds) - PREBINNED_FAMILIES
_CLASSIC_SUFFIXES = ("_bucket", "_count", "_sum")

_RE2_META = re.compile(r"([\\.+*?()|\[\]{}^$])")


# --------------------------------------------------------------------------------------------
# building selectors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Match:
    """One label matcher: ``op`` is ``=``, ``!=``, ``=~`` or ``!~``."""

    label: str
    op: str
    value: str

    def render(self) -> str:
        return f'{self.label}{self.op}"{quote(self.value)}"'


def quote(value: str) -> str:
    """Escape a value for a double-quoted PromQL string."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def regex_any(values: Iterable[str]) -> str:
    """An RE2 alternation matching exactly these literal values (``20k+`` -> ``20k\\+``)."""
    return "|".join(_RE2_META.sub(r"\\\1", v) for v in values)


def eq(label: str, value: str) -> Match:
    return Match(label, "=", value)


def ne(label: str, value: str) -> Match:
    return Match(label, "!=", value)


def re_(label: str, pattern: str) -> Match:
    return Match(label, "=~", pattern)


def nre(label: str, pattern: str) -> Match:
    return Match(label, "!~", pattern)


def one_of(label: str, values: Iterable[str]) -> Match:
    """``label="v"`` for one value, ``label=~"a|b"`` for several (literal values, escaped)."""
    vals = list(values)
    if len(vals) == 1:
        return eq(label, vals[0])
    return re_(label, regex_any(vals))


def selector(name: str, *matchers: Match | str) -> str:
    """``name{m1, m2}``; a matcher may be a ready string such as ``'instance=~"$node"'``."""
    parts = [m if isinstance(m, str) else m.render() for m in matchers]
    return f"{name}{{{', '.join(parts)}}}" if parts else name


def by(labels: Iterable[str]) -> str:
    return ", ".join(labels)


# --------------------------------------------------------------------------------------------
# reading a histogram: classic series or the native one
# --------------------------------------------------------------------------------------------

#: ``rated(series, *extra matchers)``: the range function over one series, e.g. ``rate(x{...}[5m])``
Rated = Callable[..., str]


def _sum_by(grouping: str | None, inner: str) -> str:
    return f"sum by ({grouping}) ({inner})" if grouping is not None else f"sum({inner})"


@dataclass(frozen=True, slots=True)
class HistogramForm:
    """How a generated query reads a histogram family.

    Classic: the ``_bucket`` / ``_count`` / ``_sum`` series. Native (``kvwatch rules --native``): for
    the families in ``NATIVE_FAMILIES``, the one native series per label set read with
    ``histogram_count`` / ``histogram_sum`` / ``histogram_quantile`` (no ``le``) /
    ``histogram_fraction``; a Prometheus that ingests the native form of a family keeps no classic
    series of it (2.42 with ``--enable-feature=native-histograms``), so a native query must not
    read them. Families without a native form stay classic either way.
    """

    native: bool = False

    def is_native(self, family: str) -> bool:
        return self.native and family in NATIVE_FAMILIES

    def count(self, family: str, rated: Rated, grouping: str | None = None) -> str:
        """Observations (per second for a rate), summed ``by (grouping)`` (None: per series)."""
        return self._total("count", family, rated, grouping)

    def sum(self, family: str, rated: Rated, grouping: str | None = None) -> str:
        """The sum of the observations, as ``count`` groups it."""
        return self._total("sum", family, rated, grouping)

    def _total(self, part: str, family: str, rated: Rated, grouping: str | None) -> str:
        """``part`` (count or sum) of a histogram: ``histogram_<part>`` of the native series, or the
        classic ``_<part>`` series."""
        native = self.is_native(family)
        inner = rated(family if native else f"{family}_{part}")
        grouped = _sum_by(grouping, inner) if grouping is not None else inner
        return f"histogram_{part}({grouped})" if native else grouped

    def quantile(self, q: float, family: str, rated: Rated, grouping: str | None) -> str:
        """``histogram_quantile`` of the sum ``by (grouping)`` (None: across everything selected)."""
        if self.is_native(family):
            return f"histogram_quantile({q}, {_sum_by(grouping, rated(family))})"
        labels = f"le, {grouping}" if grouping is not None else "le"
        return f"histogram_quantile({q}, sum by ({labels}) ({rated(family + '_bucket')}))"

    def share_at_most(self, threshold: str, family: str, rated: Rated, grouping: str) -> str:
        """Share of the observations at most ``threshold`` (a PromQL number or a dashboard variable).
        Classic: exact when the threshold is a bucket boundary. Native: ``histogram_fraction``, exact at
        a boundary of the native schema, else interpolated within the bucket holding the threshold."""
        if self.is_native(family):
            return f"histogram_fraction(-Inf, {threshold}, {_sum_by(grouping, rated(family))})"
        good = _sum_by(grouping, rated(family + "_bucket", eq("le", threshold)))
        return f"{good}\n/\n({self.count(family, rated, grouping)} > 0)"

    def count_above(self, threshold: str, family: str, rated: Rated, grouping: str) -> str:
        """Observations above ``threshold`` (per second for a rate), 0 where there were none at all.
        Native: the count times ``1 - histogram_fraction`` where the count is positive (the fraction of
        an empty histogram is NaN, which would poison every sum over time of the result)."""
        count = self.count(family, rated, grouping)
        if self.is_native(family):
            h = _sum_by(grouping, rated(family))
            return f"({count} > 0) * (1 - histogram_fraction(-Inf, {threshold}, {h}))\nor\n{count}"
        good = _sum_by(grouping, rated(family + "_bucket", eq("le", threshold)))
        return f"{count}\n-\n{good}"


CLASSIC = HistogramForm()
NATIVE = HistogramForm(native=True)


# --------------------------------------------------------------------------------------------
# the name check
# --------------------------------------------------------------------------------------------

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_SELECTOR = re.compile(r"(?<![\w:])([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^{}]*)\}")
_IDENT = re.compile(r"(?<![\w:.])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])(?!\s*\()")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        "inf",
        "nan",
    }
)


def _strip(expr: str) -> str:
    text = _GRAFANA_VAR.sub("", expr)
    text = _STRING.sub('""', text)
    while True:  # nested brackets (subqueries) collapse from the inside out
        shorter = _BRACKETS.sub("", text)
        if shorter == text:
            break
        text = shorter
    return _GROUPING.sub(" ", text)


def referenced_selectors(expr: str) -> list[tuple[str, tuple[str, ...]]]:
    """``(metric name, label names matched)`` for every vector selector in an expression.

    A light tokenizer, not a parser: it knows PromQL's strings, label matchers, range brackets,
    grouping clauses, function calls and keywords, which is all kvwatch's generated queries use.
    ``promtool`` parses every generated query for real (see the tests).
    """
    text = _strip(expr)
    found: list[tuple[str, tuple[str, ...]]] = []
    matched_spans: list[tuple[int, int]] = []
    for m in _SELECTOR.finditer(text):
        labels = tuple(_MATCHER_LABEL.findall(m.group(2)))
        if m.group(1) and m.group(1).lower() not in _KEYWORDS:
            found.append((m.group(1), labels))
        matched_spans.append(m.span())
    rest = list(text)
    for start, end in matched_spans:
        rest[start:end] = " " * (end - start)
    for m in _IDENT.finditer("".join(rest)):
        name = m.group(1)
        if name.lower() not in _KEYWORDS:
            found.append((name, ()))
    return found


def referenced_metrics(expr: str) -> set[str]:
    """Series names an expression reads (recording-rule names included)."""
    return {name for name, _ in referenced_selectors(expr)}


def catalog_family(series: str) -> MetricSpec | None:
    """The catalog family a series name belongs to (``kvwatch_requests_total`` -> kvwatch_requests; a
    native histogram's one series is its family's name)."""
    if series in NATIVE_FAMILIES:
        return BY_NAME.get(series)
    for suffix in ("_total", "_bucket", "_count", "_sum", "_info", ""):
        if suffix and not series.endswith(suffix):
            continue
        spec = BY_NAME.get(series[: len(series) - len(suffix)] if suffix else series)
        if spec is not None and series in spec.series_names:
            return spec
    return None


def is_external(name: str) -> bool:
    return name in EXTERNAL_METRICS or any(name.startswith(p) for p in EXTERNAL_PREFIXES)


def unknown_names(expr: str, recorded: Iterable[str] = (), native: bool = False) -> list[str]:
    """Names in ``expr`` that are neither exported by kvwatch, recorded by its rules, nor allowed
    external names; and labels matched on a kvwatch family that the family does not carry. With
    ``native``, also the classic series of a family that Prometheus then ingests in native form only."""
    recorded = set(recorded)
    problems: list[str] = []
    for name, labels in referenced_selectors(expr):
        if name in recorded or is_external(name):
            continue
        if native and any(name == f + s for f in NATIVE_FAMILIES for s in _CLASSIC_SUFFIXES):
            problems.append(
                f"{name} is a classic series of a native histogram: a native-histogram query "
                "reads the native series (histogram_count, histogram_sum, histogram_fraction, "
                "histogram_quantile without le)"
            )
            continue
        spec = catalog_family(name)
        if spec is None:
            problems.append(
                f"{name} is not a kvwatch metric (kvwatch/catalog.py), not recorded by "
                "kvwatch's rules and not an allowed external metric "
                f"({', '.join([*EXTERNAL_METRICS, *(p + '*' for p in EXTERNAL_PREFIXES)])})"
            )
            continue
        allowed = set(spec.labels) | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())
        for label in labels:
            if label not in allowed:
                problems.append(f"{name} has no label {label!r} (labels: {', '.join(spec.labels) or 'none'})")
    return problems
