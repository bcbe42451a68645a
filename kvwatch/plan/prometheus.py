"""Calibration from the engine's own histograms, read from Prometheus over a time range.

For each rate window (``query_range`` with ``step = window``) and each engine series, one
observation of the window's mean step::

    steps          = increase(vllm:iteration_tokens_total_count[w])
    tokens/step    = increase(vllm:iteration_tokens_total_sum[w]) / steps
    step seconds   = min(increase(vllm:inter_token_latency_seconds_sum[w]) / increase(..._count[w]),
                         w / steps)
    decode seqs    = avg_over_time(vllm:num_requests_running[w])
    prefill tokens = max(0, tokens/step - decode seqs)
    KV tokens      = avg_over_time(vllm:kv_cache_usage_perc[w]) x num_gpu_blocks x block_size

Both terms of the minimum over-state the mean step, each in its own windows, so the smaller is the
closer. The mean inter-token latency is the mean step while every decoding sequence gets one token
per step, but a request that sat steps out (preempted, then resumed) has one gap spanning them all
(1.5x the window over its steps in a preempting window of the real CPU vLLM; fitted, that made the
step proportional to the batch: docs/planning.md, run 6). The window over its steps is the mean
step while the engine is busy throughout, and more where it idled. Windows without tokens are
skipped. This is a fit of window means, not of single steps: it sees how the mean step moves with
the mean batch, so its R² is over windows, and a window that mixes a burst of prefills with quiet
decode is one point. The engine's shape comes from ``vllm:cache_config_info``.
"""

from __future__ import annotations

import re
import time

import httpx

from kvwatch.humanize import utc
from kvwatch.jsonsafe import loads
from kvwatch.plan.calibration import EngineShape
from kvwatch.plan.fit import StepObservation
from kvwatch.plan.sources import SourceError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _tp_of(value: str | None, tp_label: str | None, key: tuple) -> int | None:
    if tp_label is None:
        return None
    if value is None or not value.isdigit() or int(value) < 1:
        raise SourceError(
            f"series instance={key[0]!r} engine={key[1]!r}: label {tp_label}={value!r} is not a TP degree "
            "(an integer >= 1)"
        )
    return int(value)


def duration_seconds(text: str, what: str) -> float:
    text = text.strip()
    try:
        return float(text[:-1]) * _UNITS[text[-1]] if text and text[-1] in _UNITS else float(text)
    except ValueError:
        raise SourceError(f"{what} {text!r} is not a duration like 30s, 5m or 1h") from None


Series = dict[tuple, dict[float, float]]


def _query_range(
    url: str, expr: str, start: float, end: float, step: float, tp_label: str | None = None
) -> Series:
    try:
        response = httpx.get(
            f"{url}/api/v1/query_range",
            params={"query": expr, "start": start, "end": end, "step": step},
            timeout=30,
        )
        body = loads(response.content)
    except (httpx.HTTPError, ValueError) as exc:
        raise SourceError(f"{url}: query_range failed for {expr}: {exc}") from None
    out: dict[tuple, dict[float, float]] = {}
    try:
        for series in _result(body, url, expr):
            metric = series["metric"]
            key = (metric.get("instance"), metric.get("engine"), metric.get(tp_label) if tp_label else None)
            out[key] = {float(t): float(v) for t, v in series["values"]}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise SourceError(f"{url}: the answer to {expr} is not a Prometheus range vector") from None
    return out


def _result(body: object, url: str, expr: str) -> list:
    """``data.result`` of a Prometheus API answer; SourceError for a refusal or anything else."""
    if not isinstance(body, dict):
        raise SourceError(f"{url}: the answer to {expr} is not a Prometheus API response")
    if body.get("status") != "success":
        raise SourceError(f"{url}: Prometheus refused {expr}: {str(body.get('error', body))[:300]}")
    data = body.get("data")
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list):
        raise SourceError(f"{url}: the answer to {expr} has no data.result list")
    return result


def _shape(url: str, selector: str, at: float, shape: EngineShape) -> EngineShape:
    try:
        response = httpx.get(
            f"{url}/api/v1/query",
            params={"query": f"vllm:cache_config_info{{{selector}}}", "time": at},
            timeout=30,
        )
        body = loads(response.content)
    except (httpx.HTTPError, ValueError) as exc:
        raise SourceError(f"{url}: cannot read vllm:cache_config_info: {exc}") from None
    result = _result(body, url, "vllm:cache_config_info")
    if not result:
        raise SourceError(
            f"{url}: no vllm:cache_config_info{{{selector}}} in the range: is Prometheus "
            "scraping a vLLM engine with these labels?"
        )
    try:
        labels = result[0]["metric"]
        blocks, block = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError, TypeError):
        raise SourceError(f"{url}: vllm:cache_config_info has no usable num_gpu_blocks/block_size") from None
    return EngineShape(
        model_name=shape.model_name or labels.get("model_name"),
        block_size=block,
        num_gpu_blocks=blocks,
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        max_model_len=shape.max_model_len,
    )


def observations_from_prometheus(
    url: str,
    *,
    since: str,
    until: float | None,
    window: str,
    selector: str,
    shape: EngineShape,
    tp_label: str | None = None,
) -> tuple[list[StepObservation], str, EngineShape]:
    """Observations (module doc), a description of the range, and the engine's shape. With
    ``tp_label`` each observation carries the TP degree its series' label says (vLLM exports none:
    the label comes from the scrape config), and a series without it is refused by name."""
    if tp_label is not None and not _LABEL.fullmatch(tp_label):
        raise SourceError(f"--tp-label {tp_label!r} is not a Prometheus label name")
    end = until if until is not None else time.time()
    start = end - duration_seconds(since, "--since")
    w = duration_seconds(window, "--window")
    rng = f"[{int(w)}s]"
    sel = f"{{{selector}}}"
    shape = _shape(url, selector, end, shape)
    blocks, block_size = shape.num_gpu_blocks, shape.block_size
    assert blocks is not None and block_size is not None  # _shape read both or raised SourceError
    capacity = blocks * block_size

    by = "instance, engine" + (f", {tp_label}" if tp_label else "")

    def q(expr: str) -> dict[tuple, dict[float, float]]:
        return _query_range(url, f"sum by ({by}) ({expr})", start + w, end, w, tp_label)

    steps = q(f"increase(vllm:iteration_tokens_total_count{sel}{rng})")
    tokens = q(f"increase(vllm:iteration_tokens_total_sum{sel}{rng})")
    itl_sum = q(f"increase(vllm:inter_token_latency_seconds_sum{sel}{rng})")
    itl_count = q(f"increase(vllm:inter_token_latency_seconds_count{sel}{rng})")
    running = q(f"avg_over_time(vllm:num_requests_running{sel}{rng})")
    usage = q(f"avg_over_time(vllm:kv_cache_usage_perc{sel}{rng})")
    obs = []
    for key, by_time in steps.items():
        for t, n in by_time.items():
            gaps = itl_count.get(key, {}).get(t, 0.0)
            if n <= 0 or gaps <= 0:
                continue
            seqs = running.get(key, {}).get(t)
            if seqs is None:
                continue
            per_step = tokens.get(key, {}).get(t, 0.0) / n
            kv = usage.get(key, {}).get(t)
            tp = _tp_of(key[2], tp_label, key)
            obs.append(
                StepObservation(
                    prefill_tokens=max(0.0, per_step - seqs),
                    decode_seqs=seqs,
                    seconds=min(itl_sum[key][t] / gaps, w / n),  # module doc
                    kv_tokens=None if kv is None else kv * capacity,
                    weight=n,  # the steps this window mean stands for, as every source weighs its means
                    tp=tp,
                )
            )
    if not obs:
        raise SourceError(
            f"{url}: no window with engine steps between {start:.0f} and {end:.0f} "
            f"(selector {{{selector}}}): did the engine serve anything then?"
        )
    desc = f"Prometheus {url}, {utc(start, '%Y-%m-%dT%H:%M:%SZ')} + {since}, {int(w)} s windows"
    return obs, desc, shape
