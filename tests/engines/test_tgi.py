"""TGI router: queue and batch gauges, capacity budget, no KV occupancy."""

from __future__ import annotations

from .helpers import only


def test_tgi_router_page():
    s = only("tgi_3_3_router.prom")
    assert (s.backend, s.model_name, s.dp_rank) == ("tgi", None, None)
    assert (s.requests_waiting, s.requests_running, s.kv_capacity_tokens) == (3.0, 24.0, 131072.0)
    assert (s.prompt_tokens_total, s.generation_tokens_total) == (700000.0, 2100000.0)
    assert dict(s.finished_requests_total) == {"error": 10.0, "success": 1000.0}
    assert s.histogram("e2e").count == 1000.0


def test_tgi_exports_no_kv_occupancy_or_preemptions():
    s = only("tgi_3_3_router.prom")
    assert (s.kv_usage_ratio, s.kv_used_tokens, s.preemptions_total, s.prefix_cache_hits_total) == (
        None,
        None,
        None,
        None,
    )
