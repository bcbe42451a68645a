"""``kvwatch dashboards --check`` and the dashboard tests: every query names a known series, and
every query of every panel as concrete PromQL (variables substituted) to run on a real Prometheus."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvwatch.mixin import grafana as g
from kvwatch.mixin.dashboards import boards
from kvwatch.mixin.dashboards.scaffold import DEFAULT_VALUES, Board, Options
from kvwatch.mixin.promql import referenced_metrics, unknown_names
from kvwatch.mixin.rulefile import recorded_names
from kvwatch.mixin.rules import rule_files
from kvwatch.mixin.slo import slo_from_mapping


def recorded_series() -> set[str]:
    """Names kvwatch's rules record (SLO names do not depend on the objectives)."""
    slo = slo_from_mapping(
        {
            "objectives": [
                {"name": "l", "sli": "ttft", "threshold": 1, "objective": 0.99, "bands": "*"},
                {"name": "c", "sli": "completion", "objective": 0.99, "bands": "*"},
            ]
        }
    )
    return recorded_names(rule_files(slo))


_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*\w+\)$", re.DOTALL)


def variable_selectors(board: Board) -> list[str]:
    """The series selector inside each label_values() variable query."""
    out = []
    for var in board.variables:
        if var.get("type") == "query":
            m = _LABEL_VALUES.match(var["definition"])
            if not m:
                raise ValueError(f"{board.uid}: variable {var['name']} is not label_values(selector, label)")
            out.append(m.group(1))
    return out


def name_problems(all_boards: Sequence[Board], native: bool = False) -> list[str]:
    """Every panel or variable query that reads a series kvwatch does not export, record or allow; with
    ``native``, also every read of a classic series of a native histogram."""
    recorded = recorded_series()
    problems = []
    for board in all_boards:
        for panel in board.panels:
            for q in g.queries_of(panel):
                found = unknown_names(q.expr, recorded, native)
                problems += [f"{board.uid}: {panel['title']}: {p}" for p in found]
        for sel in variable_selectors(board):
            problems += [f"{board.uid}: variable: {p}" for p in unknown_names(sel, recorded)]
    return problems


# names start with a letter or "_": "$1" in label_replace() is a regex group, not a variable
_VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)|\[\[([A-Za-z_]\w*)\]\]")


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Replace Grafana variables (``$x``, ``${x}``, ``[[x]]``) by concrete values; KeyError names an
    unknown variable."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise KeyError(f"no value for dashboard variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(repl, expr)


@dataclass(frozen=True, slots=True)
class PanelQuery:
    """One query of one panel, with its variables substituted."""

    dashboard: str  # uid
    panel: str  # title
    ref_id: str
    expr: str  # as in the dashboard JSON
    concrete: str  # variables replaced
    instant: bool
    sparse: bool  # only has series once an event happened (XIDs, scrape errors, firing alerts) or
    # with an optional feature in use (KV offload tiers)
    external: bool  # reads another exporter's series (dcgm-exporter): empty without it


def panel_queries(values: Mapping[str, str] | None = None, opts: Options | None = None) -> list[PanelQuery]:
    """Every (dashboard, panel, query) kvwatch ships, with concrete PromQL to run against a real
    Prometheus. ``values`` overrides DEFAULT_VALUES (e.g. ``{"node": "127.0.0.1:9477"}``)."""
    merged = {**DEFAULT_VALUES, **(values or {})}
    out = []
    for board in boards(opts):
        for panel in board.panels:
            for i, q in enumerate(g.queries_of(panel)):
                names = referenced_metrics(q.expr)
                out.append(
                    PanelQuery(
                        dashboard=board.uid,
                        panel=panel["title"],
                        ref_id=chr(ord("A") + i),
                        expr=q.expr,
                        concrete=substitute(q.expr, merged),
                        instant=q.instant,
                        sparse=q.sparse,
                        external=any(n.startswith("DCGM_FI_") for n in names),
                    )
                )
    return out
