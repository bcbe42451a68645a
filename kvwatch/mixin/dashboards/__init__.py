"""kvwatch's Grafana dashboards, as code: Node, Latency by length band, Fleet (one module each).

``kvwatch dashboards`` renders them to ``dashboards/*.json``; ``--check`` fails when the committed
JSON differs. Every query goes through ``scaffold.Scope.sel`` (filters only by the dashboard
variables whose label the series has, so choosing a model never blanks the GPU panels) and is
checked against the metric catalog, the recording rules and the external allow-list before
anything is written (``check.name_problems``).

``check.panel_queries()`` lists every query of every panel with the template variables replaced by
concrete values, for tests that run them against a real Prometheus.
"""

from __future__ import annotations

import json

from kvwatch.mixin.dashboards.fleet import fleet_board
from kvwatch.mixin.dashboards.latency import latency_board
from kvwatch.mixin.dashboards.node import node_board
from kvwatch.mixin.dashboards.scaffold import Board, Options


def boards(opts: Options | None = None) -> list[Board]:
    """The dashboards; with ``opts.native`` only the one that reads histograms (Latency by length band,
    under its own uid): the Node and Fleet dashboards read none and serve either kind of Prometheus."""
    opts = opts or Options()
    if opts.native:
        return [latency_board(opts)]
    return [node_board(opts), latency_board(opts), fleet_board(opts)]


def render_dashboards(opts: Options | None = None) -> dict[str, str]:
    return {b.filename: json.dumps(b.json(), indent=2, ensure_ascii=False) + "\n" for b in boards(opts)}
