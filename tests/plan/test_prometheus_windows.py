"""What one Prometheus rate window says the engine's mean step was (``kvwatch/plan/prometheus.py``).

Prometheus answers in its own ``query_range`` shape (``resultType: matrix``, ``[time, "value"]``
pairs as strings); each expression gets the series a vLLM engine would have given it.
"""

from __future__ import annotations

import httpx
import pytest

from kvwatch.plan import prometheus
from kvwatch.plan.calibration import EngineShape

WINDOW_S = 4.0
END = 1_700_000_008.0
BUSY, IDLE = END - WINDOW_S, END  # the two windows' end times
# per window: steps, ITL sum (s), ITL count, mean running requests, tokens per window
SERIES = {
    # busy throughout: 400 steps of 10 ms, but one request sat 200 steps out while preempted
    # and resumed, so one of its gaps spans 2 s: the mean gap is 15 ms
    BUSY: {"steps": 400.0, "itl_sum": 6.0, "itl_count": 400.0, "running": 2.0, "tokens": 1200.0},
    # 100 steps of 8 ms, then the engine idled 3.2 s: the window over its steps says 40 ms
    IDLE: {"steps": 100.0, "itl_sum": 0.8, "itl_count": 100.0, "running": 1.0, "tokens": 150.0},
}
QUERIES = {
    "vllm:iteration_tokens_total_count": "steps",
    "vllm:iteration_tokens_total_sum": "tokens",
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "usage",
}


def _answer(url: str, params: dict, **_kw) -> httpx.Response:
    query = params["query"]
    if url.endswith("/api/v1/query"):
        info = {"num_gpu_blocks": "20", "block_size": "128", "model_name": "tiny"}
        result = [{"metric": {"__name__": "vllm:cache_config_info", **info}, "value": [END, "1"]}]
        return httpx.Response(
            200, json={"status": "success", "data": {"resultType": "vector", "result": result}}
        )
    key = next(key for name, key in QUERIES.items() if f"{name}{{" in query)
    values = [[t, str(SERIES[t].get(key, 0.5))] for t in sorted(SERIES)]
    result = [{"metric": {"instance": "10.0.0.1:8000", "engine": "0"}, "values": values}]
    return httpx.Response(200, json={"status": "success", "data": {"resultType": "matrix", "result": result}})


def test_a_window_s_mean_step_is_the_lesser_of_the_mean_gap_and_the_window_over_its_steps(monkeypatch):
    monkeypatch.setattr(prometheus.httpx, "get", _answer)
    obs, _desc, shape = prometheus.observations_from_prometheus(
        "http://prom.test",
        since=f"{int(2 * WINDOW_S)}s",
        until=END,
        window=f"{int(WINDOW_S)}s",
        selector='job="vllm"',
        shape=EngineShape(),
    )
    assert shape.num_gpu_blocks == 20 and shape.block_size == 128
    busy, idle = obs
    # a preempted request's long gap does not make every step of the busy window longer
    assert busy.seconds == pytest.approx(WINDOW_S / 400)
    # the idle part of a window is not a step either: the mean gap is the step there
    assert idle.seconds == pytest.approx(0.8 / 100)
    assert busy.decode_seqs == 2.0 and busy.prefill_tokens == pytest.approx(1200 / 400 - 2)
    assert busy.kv_tokens == pytest.approx(0.5 * 20 * 128)
    # each window's mean stands for its steps, as every other source weighs its means (it counted 1:
    # the summary said "2 engine steps", and a near-idle window pulled the fit as hard as a busy one)
    assert (busy.weight, idle.weight) == (400.0, 100.0)
