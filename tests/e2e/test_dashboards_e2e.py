"""Every panel query of the shipped dashboards returns data from a real Prometheus scraping
``kvwatch demo`` (the alerting stack of ``test_alerting_e2e``: a pressure node and a healthy one per
metrics profile, the shipped recording rules evaluated).

The queries come from ``panel_queries()`` with the dashboards' default variable values (every node,
model, replica and band), the cluster variable set to the two clusters of the profile under test:
every panel selects on ``$cluster``, so the lean run proves the lean series feed every panel.
Queries marked *sparse* (series that exist only after an event: XIDs, engine scrape errors, firing
alerts) or *external* (dcgm-exporter) may be empty and are left out; every other one must return at
least one series: range panels over the last 5 minutes, instant panels at now.
"""

from __future__ import annotations

import time

import httpx
import pytest

from kvwatch.mixin.dashboards.check import PanelQuery, panel_queries

from .alerting import AlertingStack
from .stack import wait_until

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

#: the stack needs its first minutes anyway (rate windows, the 2-minute budget rule group)
DATA_DEADLINE_S = 300.0
RANGE_S = 300
STEP_S = 15


def _has_data(stack: AlertingStack, q: PanelQuery) -> str | None:
    """None when the query returns a series, else why not."""
    now = time.time()
    if q.instant:
        params = {"query": q.concrete, "time": now}
        path = "query"
    else:
        params = {"query": q.concrete, "start": now - RANGE_S, "end": now, "step": STEP_S}
        path = "query_range"
    response = httpx.get(f"{stack.prometheus.url}/api/v1/{path}", params=params, timeout=30)
    body = response.json()
    if body.get("status") != "success":
        return f"{body.get('errorType')}: {body.get('error')}"
    return None if body["data"]["result"] else "no data"


def test_every_non_sparse_panel_query_returns_data_from_the_demo(alerting_stack):
    stack = alerting_stack
    clusters = f"{stack.pressure.name}|{stack.healthy.name}"
    queries = [q for q in panel_queries({"cluster": clusters}) if not q.sparse and not q.external]
    assert all(clusters in q.concrete for q in queries)  # no panel reads the other profile's nodes
    assert len(queries) > 50
    failing: dict[PanelQuery, str] = {}

    def all_have_data() -> bool:
        failing.clear()
        for q in queries:
            problem = _has_data(stack, q)
            if problem is not None:
                failing[q] = problem
        return not failing

    try:
        wait_until(all_have_data, max(DATA_DEADLINE_S - stack.elapsed(), 1.0), "data for every panel", 10.0)
    except AssertionError:
        lines = [
            f"  {q.dashboard} / {q.panel} / {q.ref_id}: {why}\n      {q.concrete}"
            for q, why in failing.items()
        ]
        pytest.fail(
            f"{len(failing)} of {len(queries)} panel queries have no data:\n" + "\n".join(lines),
            pytrace=False,
        )
