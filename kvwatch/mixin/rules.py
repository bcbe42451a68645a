"""SLO rules from an SLO file: error ratios per window and multi-window multi-burn-rate alerts.

For every objective (``kvwatch/mixin/slo.py``), grouped by ``cluster, model_name, length_band``:

* ``kvwatch:slo_requests:rate<w>``: eligible requests per second over each window ``w``;
* ``kvwatch:slo_errors:ratio_rate<w>``: the share of them that were bad;
* ``kvwatch:slo_errors:rate5m`` and, over the SLO period, ``kvwatch:slo_errors:ratio_rate<period>``
  and ``kvwatch:slo_error_budget_remaining:ratio``; ``kvwatch:slo_objective:ratio`` per objective.

Alerts follow the Google SRE Workbook ("Alerting on SLOs") with Sloth's extra 3x ticket: a
severity fires when a long *and* a short window both burn faster than the factor, and the band had
at least ``min_requests`` eligible requests in the long window (so one slow request in a quiet band
cannot page). All series carry ``slo`` and ``sli`` labels.

``rule_files`` writes every rule into the file of the place it evaluates (docs/scale.md), so a
Prometheus, Thanos Ruler or Mimir ruler loads whole files:

* ``kvwatch-node.rules.yaml``: node-level recordings and alerts; they read one node's series, keep
  ``instance``, and run in the Prometheus that scrapes the node;
* ``kvwatch-fleet.rules.yaml``: fleet-level recordings and the alerts that read them (replicas of a
  model compared across nodes); they run where every node's series are;
* ``kvwatch-slo.rules.yaml``: the SLO rules, fleet level too.

A rule goes where every series it reads exists: no file reads what another records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvwatch.buckets import le_label
from kvwatch.mixin import alerts, recording
from kvwatch.mixin.promql import CLASSIC, FLEET_LABELS, HistogramForm, Match, by, eq, one_of, selector
from kvwatch.mixin.rulefile import (
    CRITICAL,
    DEFAULT_RUNBOOK_BASE,
    WARNING,
    Alert,
    Group,
    Recording,
    RuleFile,
    render,
)
from kvwatch.mixin.slo import ANY_MODEL, Objective, SloFile, prom_duration_seconds
from kvwatch.mixin.thresholds import AlertConfig

WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")

NODE_FILE = "kvwatch-node.rules.yaml"
FLEET_FILE = "kvwatch-fleet.rules.yaml"
SLO_FILE = "kvwatch-slo.rules.yaml"
NODE, FLEET = "node", "fleet"
#: where each file evaluates: the Prometheus that scrapes a node, or wherever a fleet's series are
LEVELS = {NODE_FILE: NODE, FLEET_FILE: FLEET, SLO_FILE: FLEET}
#: files earlier versions wrote, before the split by level; ``kvwatch rules`` removes them
RETIRED_FILES = ("kvwatch-recording.rules.yaml", "kvwatch-operational.rules.yaml")

LATENCY_ALERT = "KVWatchLatencyBudgetBurn"
COMPLETION_ALERT = "KVWatchCompletionBudgetBurn"

_GROUPING = by((*FLEET_LABELS, "model_name", "length_band"))
_SLI_TITLE = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "End-to-end latency"}


@dataclass(frozen=True, slots=True)
class BurnWindow:
    """A (long, short) window pair that fires when both burn faster than ``factor``."""

    long: str
    short: str
    factor: float


@dataclass(frozen=True, slots=True)
class Severity:
    severity: str
    windows: tuple[BurnWindow, ...]
    for_: str
    pace: str  # word for the summary


#: SRE Workbook table (30-day budget; kvwatch's default period is 28 days, same factors):
#: 2% of the budget in 1h or 5% in 6h pages, 10% in 1d or 10% in 3d opens a ticket.
SEVERITIES = (
    Severity(CRITICAL, (BurnWindow("1h", "5m", 14.4), BurnWindow("6h", "30m", 6.0)), "2m", "fast"),
    Severity(WARNING, (BurnWindow("1d", "2h", 3.0), BurnWindow("3d", "6h", 1.0)), "15m", "steadily"),
)


def num(x: float) -> str:
    """A float for PromQL without binary noise: 14.4 * 0.01 -> ``0.144``."""
    value = round(x, 12)
    return str(int(value)) if value == int(value) else repr(value)


def percent(ratio: float) -> str:
    return f"{num(ratio * 100)}%"


def seconds_text(seconds: float) -> str:
    return f"{num(seconds * 1000)} ms" if seconds < 1 else f"{num(seconds)} s"


# --------------------------------------------------------------------------------------------
# SLI expressions
# --------------------------------------------------------------------------------------------


def _scope(obj: Objective) -> list[Match]:
    matchers = [] if obj.model == ANY_MODEL else [eq("model_name", obj.model)]
    matchers.append(one_of("length_band", obj.bands))
    matchers += [eq(label, value) for label, value in obj.matchers]
    return matchers


def _sum_rate(series: str, matchers: Iterable[Match], window: str) -> str:
    return f"sum by ({_GROUPING}) (rate({selector(series, *matchers)}[{window}]))"


def _rated(obj: Objective, window: str) -> Callable[..., str]:
    """``rate(series{the objective's scope, extra}[window])``, for ``HistogramForm``."""

    def rated(series: str, *extra: Match) -> str:
        return f"rate({selector(series, *_scope(obj), *extra)}[{window}])"

    return rated


def eligible_rate(obj: Objective, window: str, form: HistogramForm = CLASSIC) -> str:
    """Requests per second the SLI counts (the denominator)."""
    if obj.is_latency:
        return form.count(obj.family, _rated(obj, window), _GROUPING)
    outcomes = one_of("outcome", (*obj.good_outcomes, *obj.bad_outcomes))
    return _sum_rate("kvwatch_requests_total", [*_scope(obj), outcomes], window)


def _threshold(obj: Objective) -> float:
    """A latency objective's bucket boundary (the SLO file's validation requires one)."""
    if obj.threshold is None:
        raise ValueError(f"latency SLO {obj.name!r} has no threshold")
    return obj.threshold


def error_rate(obj: Objective, window: str, form: HistogramForm = CLASSIC) -> str:
    """Bad requests per second. Latency: count minus the ``le=threshold`` bucket (exact, the
    threshold is a boundary; ``le`` as kvwatch exports it, which is Prometheus 3's normal form);
    native: the count times ``1 - histogram_fraction`` up to the threshold (exact where the threshold
    is a boundary of the native schema, docs/alerting.md says how far off elsewhere).
    Completion: bad outcomes, or 0 where the band had eligible requests but no bad outcome yet."""
    if obj.is_latency:
        return form.count_above(le_label(_threshold(obj)), obj.family, _rated(obj, window), _GROUPING)
    bad = _sum_rate("kvwatch_requests_total", [*_scope(obj), one_of("outcome", obj.bad_outcomes)], window)
    return f"{bad}\nor\n0 * {eligible_rate(obj, window)}"


def error_ratio(obj: Objective, window: str, form: HistogramForm = CLASSIC) -> str:
    return f"(\n{_indent(error_rate(obj, window, form))}\n)\n/\n({eligible_rate(obj, window, form)} > 0)"


def _indent(text: str, by_: str = "  ") -> str:
    return "\n".join(by_ + line for line in text.splitlines())


# --------------------------------------------------------------------------------------------
# rules
# --------------------------------------------------------------------------------------------


def _labels(obj: Objective) -> tuple[tuple[str, str], ...]:
    return (("slo", obj.name), ("sli", obj.sli))


def _slo_sel(name: str, obj: Objective) -> str:
    return selector(name, eq("slo", obj.name))


def window_rules(obj: Objective, form: HistogramForm = CLASSIC) -> Group:
    rules: list[Recording] = []
    for w in WINDOWS:
        rules.append(Recording(f"kvwatch:slo_requests:rate{w}", eligible_rate(obj, w, form), _labels(obj)))
        rules.append(Recording(f"kvwatch:slo_errors:ratio_rate{w}", error_ratio(obj, w, form), _labels(obj)))
    rules.append(Recording("kvwatch:slo_errors:rate5m", error_rate(obj, "5m", form), _labels(obj)))
    return Group(f"kvwatch-slo-{obj.name}", tuple(rules))


def budget_rules(slo: SloFile) -> Group:
    """Period ratios from the recorded 5m rates (request-weighted, cheap: no 28d raw range)."""
    rules: list[Recording] = []
    p = slo.period
    for obj in slo.objectives:
        ratio = (
            f"sum_over_time({_slo_sel('kvwatch:slo_errors:rate5m', obj)}[{p}])\n/\n"
            f"(sum_over_time({_slo_sel('kvwatch:slo_requests:rate5m', obj)}[{p}]) > 0)"
        )
        remaining = f"1 - {_slo_sel(f'kvwatch:slo_errors:ratio_rate{p}', obj)} / {num(obj.error_budget)}"
        rules += [
            Recording("kvwatch:slo_objective:ratio", f"vector({num(obj.objective)})", _labels(obj)),
            Recording(f"kvwatch:slo_errors:ratio_rate{p}", ratio, _labels(obj)),
            Recording("kvwatch:slo_error_budget_remaining:ratio", remaining, _labels(obj)),
        ]
    # every 2m: cheaper than every evaluation, and samples stay inside the 5m lookback of queries
    return Group("kvwatch-slo-budget", tuple(rules), interval="2m")


def _burn_condition(obj: Objective, w: BurnWindow) -> str:
    threshold = num(w.factor * obj.error_budget)
    window_s = prom_duration_seconds(w.long)
    return (
        f"(\n"
        f"  {_slo_sel(f'kvwatch:slo_errors:ratio_rate{w.long}', obj)} > {threshold}\n"
        f"  and\n"
        f"  {_slo_sel(f'kvwatch:slo_errors:ratio_rate{w.short}', obj)} > {threshold}\n"
        f"  and\n"
        f"  {_slo_sel(f'kvwatch:slo_requests:rate{w.long}', obj)} * {window_s} >= {obj.min_requests}\n"
        f")"
    )


def burn_alert(obj: Objective, sev: Severity, period: str) -> Alert:
    pairs = " or ".join(f"{num(w.factor)}x over {w.long} (and {w.short})" for w in sev.windows)
    if obj.is_latency:
        name = LATENCY_ALERT
        summary = (
            "Requests in an output-length band are slower than their SLO allows; "
            f"the budget burns {sev.pace}."
        )
        bad = f"had {_SLI_TITLE[obj.sli]} above {seconds_text(_threshold(obj))}"
        target = f"{percent(obj.objective)} within {seconds_text(_threshold(obj))}"
    else:
        name = COMPLETION_ALERT
        summary = (
            "Requests in an output-length band fail more often than their SLO allows; "
            f"the budget burns {sev.pace}."
        )
        bad = f"ended in {' or '.join(obj.bad_outcomes)}"
        target = f"{percent(obj.objective)} {' or '.join(obj.good_outcomes)}"
    description = (
        f"{{{{ $value | humanizePercentage }}}} of {{{{ $labels.model_name }}}} requests in length band "
        f"{{{{ $labels.length_band }}}} {bad} (SLO {obj.name}: {target} over {period}, "
        f"error budget {percent(obj.error_budget)}). The budget is burning at least {pairs}; "
        f"at least {obj.min_requests} requests were counted in the long window."
    )
    expr = "\nor\n".join(_burn_condition(obj, w) for w in sev.windows)
    return Alert(name, expr, sev.severity, summary, description, for_=sev.for_, labels=_labels(obj))


def slo_rule_file(slo: SloFile, source: str = "slo.yaml", form: HistogramForm = CLASSIC) -> RuleFile:
    groups = [window_rules(obj, form) for obj in slo.objectives]
    groups.append(budget_rules(slo))
    groups.append(
        Group(
            "kvwatch-slo-alerts",
            tuple(burn_alert(obj, sev, slo.period) for obj in slo.objectives for sev in SEVERITIES),
        )
    )
    command = "kvwatch rules --native" if form.native else "kvwatch rules"
    native = (
        "Native-histogram variant: latency SLIs read the native series (histogram_count,\n"
        "histogram_fraction) that a Prometheus with native histograms on keeps instead of the\n"
        "classic ones.\n"
        if form.native
        else ""
    )
    header = (
        f"kvwatch SLO rules: per-band error ratios, error budget and burn-rate alerts. Fleet level:\n"
        f"load this file (with kvwatch-fleet.rules.yaml) where every node's series are.\n"
        f"{native}"
        f"Generated by `{command}` from {source} (relative to this file).\n"
        f"Do not edit: change the SLO file and re-run `{command}`."
    )
    return RuleFile(SLO_FILE, header, tuple(groups))


# --------------------------------------------------------------------------------------------
# files, by where they evaluate
# --------------------------------------------------------------------------------------------


def node_rule_file(
    job: str = alerts.DEFAULT_JOB, cfg: AlertConfig | None = None, form: HistogramForm = CLASSIC
) -> RuleFile:
    command = "kvwatch rules --native" if form.native else "kvwatch rules"
    header = (
        "kvwatch node-level rules: recordings per replica and GPU, KV, tier, GPU and kvwatch-health\n"
        "alerts. They read each node's series on its own and keep `instance`: load this file in\n"
        "every Prometheus that scrapes kvwatch agents (docs/scale.md).\n"
        f"Generated by `{command}`. Do not edit: change kvwatch/mixin/recording.py or\n"
        "kvwatch/mixin/alerts.py and re-run it."
    )
    return RuleFile(NODE_FILE, header, (recording.node_group(), *alerts.node_alert_groups(job, cfg, form)))


def fleet_rule_file(slo: SloFile) -> RuleFile:
    header = (
        "kvwatch fleet-level rules: outcome ratios per band and stranded KV capacity across nodes,\n"
        "and the alerts on them (stranded capacity, long-request starvation). They aggregate by\n"
        "cluster and model_name: load this file (with kvwatch-slo.rules.yaml) where every node's\n"
        "series are: the cluster Prometheus, or a global Prometheus / Thanos Ruler / Mimir ruler\n"
        "(docs/scale.md).\n"
        "Generated by `kvwatch rules`. Do not edit: change kvwatch/mixin/recording.py or\n"
        "kvwatch/mixin/alerts.py and re-run it."
    )
    return RuleFile(FLEET_FILE, header, (recording.fleet_group(), alerts.fleet_alert_group(slo)))


def rule_files(
    slo: SloFile, source: str = "slo.yaml", job: str = alerts.DEFAULT_JOB, form: HistogramForm = CLASSIC
) -> list[RuleFile]:
    """Everything ``kvwatch rules`` writes, node level first; ``form`` says how histograms are read
    (the fleet file reads none)."""
    return [node_rule_file(job, slo.alerts, form), fleet_rule_file(slo), slo_rule_file(slo, source, form)]


def render_rule_files(files: Iterable[RuleFile], runbook_base: str = DEFAULT_RUNBOOK_BASE) -> dict[str, str]:
    return {f.filename: render(f, runbook_base) for f in files}
