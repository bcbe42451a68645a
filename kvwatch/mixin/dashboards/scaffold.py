"""What the three dashboards share: the variables, the scope that applies them, the board record,
axes (unit and range), threshold colour steps, the SLO panels two boards show and the link bar. A
board module builds panels; this one knows Grafana's variables and how a selector picks them up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvwatch import buckets
from kvwatch.catalog import BY_NAME
from kvwatch.mixin import grafana as g
from kvwatch.mixin.grafana import Query
from kvwatch.mixin.promql import CLASSIC, FLEET_LABELS, NATIVE, HistogramForm, Match, catalog_family, selector
from kvwatch.mixin.thresholds import AlertConfig

#: grafana.com dashboard 12239, NVIDIA's dcgm-exporter dashboard (grafana/dcgm-exporter-dashboard.json)
DCGM_DASHBOARD_UID = "Oxed_c6Wz"
DEFAULT_JOB = "kvwatch"

NODE_UID = "kvwatch-node"
LATENCY_UID = "kvwatch-latency-by-band"
FLEET_UID = "kvwatch-fleet"

#: dashboard variable -> the label it filters
VARIABLE_LABELS: Mapping[str, str] = {
    "cluster": "cluster",
    "node": "instance",
    "model": "model_name",
    "replica": "replica",
    "band": "length_band",
}

#: what panel_queries() puts in for each variable by default (regexes match everything)
DEFAULT_VALUES: Mapping[str, str] = {
    "datasource": "prometheus",
    "cluster": ".*",
    "job": DEFAULT_JOB,
    "node": ".*",
    "model": ".*",
    "replica": ".*",
    "band": ".*",
    "ttft_slo": "2.0",
    "tpot_slo": "0.06",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
}

RATE = "$__rate_interval"
SLO_OBJECTIVE = "kvwatch:slo_objective:ratio"

# labels of the recorded series the dashboards read (fleet-level ones have no instance)
FLEET_BAND = (*FLEET_LABELS, "model_name", "length_band")
FLEET_MODEL = (*FLEET_LABELS, "model_name")
SLO_LABELS = (*FLEET_BAND, "slo", "sli")
# node-level recorded series keep every label of the replica series; tier ratios drop dp_rank
REPLICA_LABELS = (*BY_NAME["kvwatch_preemptions"].labels, "cluster", "instance")
TIER_LABELS = ("replica", "model_name", "cluster", "instance")


@dataclass(frozen=True, slots=True)
class Options:
    dcgm_dashboard_uid: str = DCGM_DASHBOARD_UID
    job: str = DEFAULT_JOB
    #: read native histograms (``kvwatch dashboards --native``) instead of classic buckets
    native: bool = False

    @property
    def form(self) -> HistogramForm:
        return NATIVE if self.native else CLASSIC


@dataclass(frozen=True, slots=True)
class Scope:
    """The variables a dashboard has; ``sel`` applies those whose label a series carries."""

    variables: tuple[str, ...]

    def sel(self, name: str, *extra: Match | str, labels: Sequence[str] | None = None) -> str:
        if labels is None:
            spec = catalog_family(name)
            if spec is None:
                raise KeyError(f"{name}: not a catalog series; pass the labels of recorded series")
            labels = (*spec.labels, "cluster", "instance")
        matchers = [
            f'{VARIABLE_LABELS[v]}=~"${v}"' for v in self.variables if VARIABLE_LABELS.get(v) in labels
        ]
        return selector(name, *matchers, *extra)

    def rate(self, name: str, *extra: Match | str, window: str = RATE) -> str:
        return f"rate({self.sel(name, *extra)}[{window}])"


@dataclass(frozen=True, slots=True)
class Board:
    uid: str
    title: str
    description: str
    variables: tuple[dict[str, Any], ...]
    panels: tuple[dict[str, Any], ...]
    links: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    @property
    def filename(self) -> str:
        return f"{self.uid}.json"

    def json(self) -> dict[str, Any]:
        return g.dashboard_json(
            uid=self.uid,
            title=self.title,
            description=self.description,
            variables=self.variables,
            panels=self.panels,
            links=self.links,
        )


def quantile(
    q: float, family: str, scope: Scope, by: str = "length_band", form: HistogramForm = CLASSIC
) -> str:
    return form.quantile(q, family, scope.rate, by)


def links() -> tuple[dict[str, Any], ...]:
    return (
        {
            "title": "kvwatch",
            "type": "dashboards",
            "tags": ["kvwatch"],
            "asDropdown": False,
            "includeVars": True,
            "keepTime": True,
            "targetBlank": False,
        },
    )


def dcgm_link(opts: Options) -> dict[str, Any]:
    return {
        "title": "NVIDIA DCGM Exporter dashboard",
        "type": "link",
        "icon": "dashboard",
        "url": f"/d/{opts.dcgm_dashboard_uid}",
        "keepTime": True,
        "targetBlank": True,
        "tooltip": "dcgm-exporter's dashboard (grafana.com 12239); kvwatch's uuid = its UUID",
    }


#: label_values() variables: name -> (label, family, the label whose values it offers, and the
#: (variable, label) filters it takes from the variables before it, where the board has them)
_QUERY_VARIABLES: Mapping[str, tuple[str, str, str, tuple[tuple[str, str], ...]]] = {
    "cluster": ("Cluster", "kvwatch_build_info", "cluster", ()),
    "node": ("Node", "kvwatch_build_info", "instance", (("cluster", "cluster"),)),
    "model": ("Model", "kvwatch_replica_info", "model_name", (("cluster", "cluster"), ("node", "instance"))),
    "replica": (
        "Replica",
        "kvwatch_replica_info",
        "replica",
        (("cluster", "cluster"), ("node", "instance"), ("model", "model_name")),
    ),
    "band": (
        "Length band",
        "kvwatch_requests_total",
        "length_band",
        (("cluster", "cluster"), ("model", "model_name")),
    ),
}


def _values_query(name: str, defined: set[str]) -> tuple[str, str]:
    """(label, query) of a label_values() variable, filtered only by variables the board defines:
    an undefined ``$node`` stays literal text, and its regex matches nothing."""
    label, family, offered, filters = _QUERY_VARIABLES[name]
    matchers = ", ".join(f'{key}=~"${var}"' for var, key in filters if var in defined)
    return (
        label,
        f"label_values({family}{{{matchers}}}, {offered})"
        if matchers
        else f"label_values({family}, {offered})",
    )


#: latency targets picked from a histogram's bucket boundaries: name -> (label, family, boundaries)
_TARGET_VARIABLES: Mapping[str, tuple[str, str, Sequence[float]]] = {
    "ttft_slo": ("TTFT target (s)", "kvwatch_request_ttft_seconds", buckets.TTFT_SECONDS),
    "tpot_slo": ("TPOT target (s)", "kvwatch_request_tpot_seconds", buckets.TPOT_SECONDS),
}


def variables(names: Iterable[str], job: str) -> tuple[dict[str, Any], ...]:
    out = [g.datasource_variable()]
    defined: set[str] = set()
    for name in names:
        if name in _QUERY_VARIABLES:
            out.append(g.query_variable(name, *_values_query(name, defined)))
        elif name in _TARGET_VARIABLES:
            label, family, bounds = _TARGET_VARIABLES[name]
            values = [buckets.le_label(b) for b in bounds]
            description = f"A bucket boundary of {family}"
            out.append(g.custom_variable(name, label, values, DEFAULT_VALUES[name], description))
        elif name == "job":
            var = g.query_variable(
                "job", "Job", 'label_values(kvwatch_build_info{cluster=~"$cluster"}, job)', multi=False
            )
            var.update(includeAll=False, current={"selected": True, "text": job, "value": job})
            out.append(var)
        else:
            raise ValueError(f"unknown dashboard variable {name!r}")
        defined.add(name)
    return tuple(out)


# what panels show, by unit and range
#: a share of a whole, 0 to 100%
WHOLE_SHARE = g.Axis("percentunit", 0, 1)
#: a ratio from 0, the top fitted to the data
SHARE = g.Axis("percentunit", 0)
#: an error budget's share left: at most 100%, below 0 once overspent
BUDGET_LEFT = g.Axis("percentunit", max_=1)
SECONDS = g.Axis("s", 0)
COUNT = g.Axis("short", 0)
#: a 0/1 state
ON_OFF = g.Axis("short", 0, 1)
REQUESTS_PER_S = g.Axis("reqps", 0)
BYTES_PER_S = g.Axis("Bps", 0)
BYTES = g.Axis("bytes", 0)

#: the alert thresholds kvwatch ships: a panel of an alerting ratio marks where its alert fires
SHIPPED_ALERTS = AlertConfig()


def fires_above(threshold: float) -> g.Steps:
    """Threshold steps: green up to an alert's threshold, red above it."""
    return ((None, "green"), (threshold, "red"))


PCT_HIGH_BAD = ((None, "green"), (0.9, "orange"), (0.98, "red"))
ANY_IS_BAD = ((None, "green"), (1, "orange"))
ANY_IS_RED = ((None, "green"), (1, "red"))
PAGE_BURN = ((None, "green"), (6, "orange"), (14.4, "red"))
BUDGET = ((None, "red"), (0, "orange"), (0.25, "green"))


SLO_LEGEND = "{{slo}} {{model_name}} {{length_band}}"


def burn_rate(window: str, s: Scope) -> str:
    """The error ratio over the budget. Each Prometheus a global one federates adds its own labels
    (``cluster``) to the objective series: one budget per ``slo`` (they are equal), or the match
    finds several and the query fails."""
    ratio = s.sel(f"kvwatch:slo_errors:ratio_rate{window}", labels=SLO_LABELS)
    return f"{ratio}\n/ on (slo) group_left ()\nmax by (slo) (1 - {SLO_OBJECTIVE})"


def burn_rate_panel(
    window: str, s: Scope, description: str, thresholds: g.Steps = PAGE_BURN
) -> dict[str, Any]:
    """Each objective's error ratio over ``window`` / its error budget, per model and band."""
    return g.timeseries(
        f"Burn rate, {window}",
        [Query(burn_rate(window, s), SLO_LEGEND)],
        description,
        COUNT,
        thresholds=thresholds,
    )


def budget_left_panel(s: Scope, description: str) -> dict[str, Any]:
    """Each objective's error budget not yet spent, per model and band."""
    budget = s.sel("kvwatch:slo_error_budget_remaining:ratio", labels=SLO_LABELS)
    return g.bargauge(
        "Error budget left", [Query(budget, SLO_LEGEND)], description, BUDGET_LEFT, thresholds=BUDGET
    )
