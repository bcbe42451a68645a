"""Grafana dashboard JSON as plain dicts: panels, a grid packer, template variables.

vLLM's pattern (tools/generate_grafana_dashboards.py): no Grafana library, just functions that
return the JSON Grafana stores, so a dashboard is reviewable code and its output diffable. Panels
carry their queries as ``Query`` objects under a private key (``_queries``) that ``dashboard_json``
strips; ``kvwatch.mixin.dashboards.check.panel_queries`` reads them to list every query.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39  # Grafana 10.4 / 11.x
GRID_WIDTH = 24
_PRIVATE = "_queries"
#: threshold steps, lowest first: (value the colour starts at, None for the base colour; colour)
Steps = Sequence[tuple[float | None, str]]


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL target. ``sparse``: the query returns series only once the event it counts has
    happened (XIDs, scrape errors, firing alerts) or where an optional feature is in use (KV offload
    tiers: a node without one has no tier traffic), so an empty result is normal."""

    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False  # format "table" (one row per series)
    heatmap: bool = False  # format "heatmap" (buckets by le)
    sparse: bool = False

    def target(self, ref_id: str) -> dict[str, Any]:
        fmt = "table" if self.table else "heatmap" if self.heatmap else "time_series"
        out: dict[str, Any] = {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": self.expr,
            "format": fmt,
            "instant": self.instant,
            "legendFormat": self.legend or "__auto",
            "range": not self.instant,
            "refId": ref_id,
        }
        return out


def _ref(i: int) -> str:
    return chr(ord("A") + i)


def _thresholds(steps: Steps) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for value, color in steps]}


GREEN = ((None, "green"),)


def _last_value() -> dict[str, Any]:
    """How stat and bar gauge panels reduce a series: to its last value."""
    return {"calcs": ["lastNotNull"], "fields": "", "values": False}


@dataclass(frozen=True, slots=True)
class Axis:
    """What a panel's values are: their Grafana unit and the fixed ends of the range (None: fitted to
    the data)."""

    unit: str = "short"
    min_: float | None = None
    max_: float | None = None


PLAIN = Axis()


def _panel(
    kind: str,
    title: str,
    queries: Sequence[Query],
    description: str,
    axis: Axis,
    options: dict[str, Any],
    *,
    custom: dict[str, Any] | None = None,
    thresholds: Steps = GREEN,
    links: Sequence[dict[str, Any]] = (),
    transformations: Sequence[dict[str, Any]] = (),
    decimals: int | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": axis.unit, "thresholds": _thresholds(thresholds)}
    if custom is not None:
        defaults["custom"] = custom
    if axis.min_ is not None:
        defaults["min"] = axis.min_
    if axis.max_ is not None:
        defaults["max"] = axis.max_
    if decimals is not None:
        defaults["decimals"] = decimals
    if links:
        defaults["links"] = list(links)
    panel: dict[str, Any] = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [q.target(_ref(i)) for i, q in enumerate(queries)],
        _PRIVATE: list(queries),
    }
    if transformations:
        panel["transformations"] = list(transformations)
    return panel


def timeseries(
    title: str,
    queries: Sequence[Query],
    description: str,
    axis: Axis = PLAIN,
    *,
    thresholds: Steps = GREEN,
    stack: bool = False,
    step: bool = False,
) -> dict[str, Any]:
    """Lines over time; thresholds other than the all-green default are drawn as dashed lines."""
    custom = {
        "drawStyle": "line",
        "lineInterpolation": "stepAfter" if step else "linear",
        "lineWidth": 1,
        "fillOpacity": 20 if stack else 0,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "normal" if stack else "none"},
        "thresholdsStyle": {"mode": "off" if tuple(thresholds) == GREEN else "dashed"},
    }
    options = {
        "legend": {
            "displayMode": "table",
            "placement": "right",
            "calcs": ["lastNotNull", "max"],
            "showLegend": True,
        },
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return _panel(
        "timeseries", title, queries, description, axis, options, custom=custom, thresholds=thresholds
    )


def stat(
    title: str,
    queries: Sequence[Query],
    description: str,
    *,
    unit: str = "short",
    thresholds: Steps = GREEN,
    decimals: int | None = None,
) -> dict[str, Any]:
    options = {
        "colorMode": "value",
        "graphMode": "area",
        "justifyMode": "auto",
        "textMode": "auto",
        "orientation": "auto",
        "reduceOptions": _last_value(),
    }
    return _panel(
        "stat", title, queries, description, Axis(unit), options, thresholds=thresholds, decimals=decimals
    )


def bargauge(
    title: str,
    queries: Sequence[Query],
    description: str,
    axis: Axis = PLAIN,
    *,
    thresholds: Steps = GREEN,
) -> dict[str, Any]:
    options = {
        "displayMode": "gradient",
        "orientation": "horizontal",
        "showUnfilled": True,
        "valueMode": "color",
        "namePlacement": "auto",
        "reduceOptions": _last_value(),
    }
    return _panel("bargauge", title, queries, description, axis, options, thresholds=thresholds)


def table(
    title: str,
    queries: Sequence[Query],
    description: str,
    *,
    unit: str = "short",
    links: Sequence[dict[str, Any]] = (),
    hide: Iterable[str] = ("Time",),
    thresholds: Steps = GREEN,
) -> dict[str, Any]:
    """Instant table queries merged into one row per label set; ``hide`` drops columns."""
    transformations = [
        {"id": "merge", "options": {}},
        {"id": "organize", "options": {"excludeByName": dict.fromkeys(hide, True)}},
    ]
    options = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}
    return _panel(
        "table",
        title,
        queries,
        description,
        Axis(unit),
        options,
        links=links,
        transformations=transformations,
        thresholds=thresholds,
    )


def heatmap(title: str, query: Query, description: str, *, unit: str = "short") -> dict[str, Any]:
    options = {
        "calculate": False,
        "cellGap": 1,
        "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
        "yAxis": {"unit": unit},
        "rowsFrame": {"layout": "auto"},
        "legend": {"show": True},
        "tooltip": {"show": True, "yHistogram": True},
    }
    return _panel("heatmap", title, [query], description, Axis(unit), options)


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


class Layout:
    """Packs panels left to right into Grafana's 24-column grid; ``row`` starts a new band and sets the
    size of the panels added to it."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self._x = 0
        self._y = 0
        self._row_height = 0
        self._size = (GRID_WIDTH, 8)

    def _next_line(self) -> None:
        self._y += self._row_height
        self._x = 0
        self._row_height = 0

    def row(self, title: str, w: int, h: int) -> None:
        """A row header; the panels added after it are ``w`` x ``h`` unless ``add`` says otherwise."""
        if self._x:
            self._next_line()
        panel = row(title)
        panel["gridPos"] = {"x": 0, "y": self._y, "w": GRID_WIDTH, "h": 1}
        self.panels.append(panel)
        self._y += 1
        self._size = (w, h)

    def add(self, *panels: dict[str, Any], w: int | None = None, h: int | None = None) -> None:
        """Place ``panels`` in order, each ``w`` x ``h`` (default: the row's size)."""
        width = self._size[0] if w is None else w
        height = self._size[1] if h is None else h
        for panel in panels:
            self._place(panel, width, height)

    def _place(self, panel: dict[str, Any], w: int, h: int) -> None:
        if not 0 < w <= GRID_WIDTH:
            raise ValueError(f"panel {panel['title']!r}: width {w} outside 1..{GRID_WIDTH}")
        if self._x + w > GRID_WIDTH:
            self._next_line()
        panel["gridPos"] = {"x": self._x, "y": self._y, "w": w, "h": h}
        self._x += w
        self._row_height = max(self._row_height, h)
        self.panels.append(panel)


# --------------------------------------------------------------------------------------------
# template variables and the dashboard
# --------------------------------------------------------------------------------------------


def datasource_variable() -> dict[str, Any]:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "options": [],
    }


def query_variable(name: str, label: str, query: str, *, multi: bool = True) -> dict[str, Any]:
    """A label_values() variable with an "All" that matches series without the label too (``.*``)."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-values"},
        "refresh": 2,
        "sort": 1,
        "multi": multi,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "hide": 0,
        "regex": "",
        "options": [],
    }


def custom_variable(
    name: str, label: str, values: Sequence[str], default: str, description: str
) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "custom",
        "description": description,
        "query": ",".join(values),
        "multi": False,
        "includeAll": False,
        "hide": 0,
        "current": {"selected": True, "text": default, "value": default},
        "options": [{"selected": v == default, "text": v, "value": v} for v in values],
    }


def dashboard_json(
    *,
    uid: str,
    title: str,
    description: str,
    variables: Sequence[dict[str, Any]],
    panels: Sequence[dict[str, Any]],
    links: Sequence[dict[str, Any]] = (),
    tags: Sequence[str] = ("kvwatch",),
    refresh: str = "30s",
    time_from: str = "now-1h",
) -> dict[str, Any]:
    """The dashboard as Grafana stores it, panel ids assigned in order, private keys removed."""
    clean = []
    for i, panel in enumerate(panels, start=1):
        p = {k: v for k, v in panel.items() if k != _PRIVATE}
        p["id"] = i
        clean.append(p)
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": list(tags),
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "time": {"from": time_from, "to": "now"},
        "refresh": refresh,
        "timezone": "",
        "links": list(links),
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": list(variables)},
        "panels": clean,
    }


def queries_of(panel: dict[str, Any]) -> list[Query]:
    return list(panel.get(_PRIVATE, ()))
