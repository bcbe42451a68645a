"""TensorRT-LLM ``trtllm-serve`` Prometheus page (``/prometheus/metrics``).

Labels ``model_name, engine_type="trtllm"``; one replica per server. The 2025 collector (1.1.0rc5) has
five request families and no KV at all; the 2026 one adds block gauges
(``kv_cache_{used,free,max}_blocks``, ``kv_cache_tokens_per_block``), queue gauges and host-tier
traffic (``kv_cache_onboard_bytes`` host->GPU, ``kv_cache_offload_bytes`` GPU->host).

Usage = used / max blocks where both are exposed (the C++ ``KvCacheStats`` definition), else the
``kv_cache_utilization`` gauge. TRT-LLM has no preemption counter: ``num_paused_requests`` (a gauge)
goes to ``requests_swapped_or_paused`` and ``preemptions_total`` stays None. Note TRT-LLM's ``/metrics``
(without ``/prometheus``) is a JSON iteration-stats queue that is drained on read: never scrape it.
"""

from __future__ import annotations

from kvwatch.engines.base import (
    Field,
    RankView,
    Scrape,
    VersionHint,
    as_int,
    read_fields,
    read_histograms,
    traffic,
    version_hint,
)
from kvwatch.engines.exposition_parser import Exposition
from kvwatch.model import ReplicaSample

BACKEND = "trtllm"
PREFIX = "trtllm_"

FIELDS: tuple[Field, ...] = (
    Field("kv_used_blocks", ("trtllm_kv_cache_used_blocks",)),
    Field("requests_running", ("trtllm_num_requests_running",)),
    Field("requests_waiting", ("trtllm_num_requests_waiting",)),
    Field("requests_swapped_or_paused", ("trtllm_num_paused_requests",)),
    Field("prompt_tokens_total", ("trtllm_prompt_tokens_total",)),
    Field("generation_tokens_total", ("trtllm_generation_tokens_total",)),
    Field("prefix_cache_hits_total", ("trtllm_prompt_cached_tokens_total",)),
)
MAX_BLOCKS = "trtllm_kv_cache_max_blocks"
TOKENS_PER_BLOCK = "trtllm_kv_cache_tokens_per_block"
UTILIZATION = "trtllm_kv_cache_utilization"

HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("trtllm_time_to_first_token_seconds",),
    "e2e": ("trtllm_e2e_request_latency_seconds",),
    "itl": ("trtllm_time_per_output_token_seconds",),
}

#: (src, dst, bytes counter)
TRANSFERS = (
    ("host", "gpu", "trtllm_kv_cache_onboard_bytes_total"),
    ("gpu", "host", "trtllm_kv_cache_offload_bytes_total"),
)

VERSION_HINTS: tuple[VersionHint, ...] = (
    VersionHint(("trtllm_kv_cache_used_blocks",), (), "trtllm 2026+ (kv_cache_* block gauges)"),
    VersionHint(("trtllm_kv_cache_utilization",), (), "trtllm 2026 (kv_cache_utilization, no block gauges)"),
)
DEFAULT_HINT = "trtllm 1.1 (2025: request latency families only, no KV gauges)"


def detect(expo: Exposition) -> bool:
    return expo.has_prefix(PREFIX)


def _models(expo: Exposition) -> list[str | None]:
    found = {
        labels.get("model_name")
        for fam in expo
        if fam.name.startswith(PREFIX)
        for _, labels, _ in fam.samples
    }
    return sorted(found, key=lambda m: m or "")


def parse(expo: Exposition, replica: str, scraped_at: float) -> list[ReplicaSample]:
    scrape = Scrape(replica, BACKEND, scraped_at, version_hint(expo, VERSION_HINTS, DEFAULT_HINT))
    out = []
    for model in _models(expo):
        view = RankView(expo, {"model_name": model})
        values = read_fields(view, FIELDS)
        max_blocks = as_int(view.value(MAX_BLOCKS))
        per_block = as_int(view.value(TOKENS_PER_BLOCK))
        used = values["kv_used_blocks"]
        usage = used / max_blocks if used is not None and max_blocks else view.value(UTILIZATION)
        out.append(
            scrape.sample(
                model_name=model,
                block_size=per_block,
                num_gpu_blocks=max_blocks,
                kv_capacity_tokens=float(max_blocks * per_block) if max_blocks and per_block else None,
                kv_usage_ratio=usage,
                prefix_cache_queries_total=(
                    values["prompt_tokens_total"] if values["prefix_cache_hits_total"] is not None else None
                ),
                finished_requests_total=view.by_label("trtllm_request_success_total", "finished_reason"),
                tier_traffic=tuple(
                    t
                    for t in (
                        traffic("trtllm", src, dst, bytes_total=view.value(name))
                        for src, dst, name in TRANSFERS
                    )
                    if t is not None
                ),
                histograms=read_histograms(view, HISTOGRAMS),
                **values,
            )
        )
    return out
