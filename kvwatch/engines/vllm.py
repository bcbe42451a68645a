"""vLLM ``/metrics`` (V0 and V1, 0.7 -> 0.33) -> ReplicaSample per DP rank.

Replica key = (scrape target, ``model_name``, ``engine``): ``engine`` is the data-parallel rank
(since 0.8.3; absent before, then ``dp_rank`` is None). Renames are handled by listing every exposed
name a field had, newest first (``FIELDS``): ``gpu_cache_usage_perc`` -> ``kv_cache_usage_perc``
(0.9.2, removed 0.12), ``gpu_prefix_cache_*`` -> ``prefix_cache_*``, ``time_per_output_token_seconds``
-> ``inter_token_latency_seconds`` (0.10.2, removed 0.15).

KV capacity = ``kv_cache_size_tokens`` from ``cache_config_info`` where present (correct for hybrid /
sliding-window models), else ``num_gpu_blocks x block_size``. KV bytes per token (per GPU) =
``kv_cache_memory_bytes / (num_gpu_blocks x block_size)`` where that label carries a number: it is
in the 0.12 and 0.32 pages kvwatch was built against, and is ``"None"`` unless the KV budget was
given in bytes (``kv_bytes_per_token``). Capacity counts vLLM's reserved null
block; ``kv_cache_usage_perc`` is relative to the other ``num_gpu_blocks - 1`` blocks, so used blocks
= usage x (num_gpu_blocks - 1). vLLM counts KV in blocks, not tokens: ``kv_used_tokens`` and
``live_tokens`` stay None (derive/ estimates them).
"""

from __future__ import annotations

from typing import TypedDict

from kvwatch.engines import lmcache
from kvwatch.engines.base import (
    Field,
    RankView,
    Scrape,
    VersionHint,
    as_int,
    rank_keys,
    rank_views,
    read_fields,
    read_histograms,
    traffic,
    version_hint,
)
from kvwatch.engines.exposition_parser import Exposition
from kvwatch.model import ReplicaSample, TierTraffic

BACKEND = "vllm"
PREFIX = "vllm:"

FIELDS: tuple[Field, ...] = (
    Field("kv_usage_ratio", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    Field("requests_running", ("vllm:num_requests_running",)),
    Field("requests_waiting", ("vllm:num_requests_waiting",)),
    Field("requests_swapped_or_paused", ("vllm:num_requests_swapped",)),  # V0 only
    Field("preemptions_total", ("vllm:num_preemptions_total",)),
    Field("prompt_tokens_total", ("vllm:prompt_tokens_total",)),
    Field("generation_tokens_total", ("vllm:generation_tokens_total",)),
    Field(
        "prefix_cache_queries_total",
        ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    ),
    Field("prefix_cache_hits_total", ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")),
)

HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "e2e": ("vllm:e2e_request_latency_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "prompt_tokens": ("vllm:request_prompt_tokens",),
    "generation_tokens": ("vllm:request_generation_tokens",),
    "num_preemptions": ("vllm:request_num_preemptions",),
}

#: Families every vLLM engine rank exposes; their (model_name, engine) pairs are the ranks.
ANCHORS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
)

CACHE_CONFIG = "vllm:cache_config_info"
ENGINE_LABEL_FACT = "label:engine"  # pseudo-name: the page carries the `engine` label

#: Most specific first. Markers are families vLLM emits by default from the named release on.
VERSION_HINTS: tuple[VersionHint, ...] = (
    VersionHint(("vllm:num_requests_swapped",), (), "vllm V0 engine (num_requests_swapped; <=0.10)"),
    VersionHint(("vllm:cpu_cache_usage_perc",), (), "vllm V0 engine (cpu_cache_usage_perc; <=0.10)"),
    VersionHint(
        ("vllm:prompt_tokens_cached_by_source_total",), (), "vllm>=0.32 (prompt_tokens_cached_by_source)"
    ),
    VersionHint(("vllm:request_num_preemptions_count",), (), "vllm>=0.30 (request_num_preemptions)"),
    VersionHint(("vllm:num_requests_waiting_by_reason",), (), "vllm>=0.20 (num_requests_waiting_by_reason)"),
    VersionHint(("vllm:prompt_tokens_by_source_total",), (), "vllm>=0.16 (prompt_tokens_by_source)"),
    VersionHint(
        ("vllm:kv_cache_usage_perc",),
        ("vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds_count"),
        "vllm>=0.12 (kv_cache_usage_perc; no gpu_cache_usage_perc)",
    ),
    VersionHint(
        ("vllm:kv_cache_usage_perc", "vllm:time_per_output_token_seconds_count"),
        ("vllm:gpu_cache_usage_perc",),
        "vllm 0.11-0.14 (kv_cache_usage_perc; gpu_cache_usage_perc hidden or removed)",
    ),
    VersionHint(
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        (),
        "vllm 0.9.2-0.11 (both kv_cache_usage_perc and deprecated gpu_cache_usage_perc)",
    ),
    VersionHint(
        ("vllm:gpu_cache_usage_perc", ENGINE_LABEL_FACT),
        (),
        "vllm 0.8.3-0.9.1 (engine label; gpu_cache_usage_perc only)",
    ),
    VersionHint(("vllm:gpu_cache_usage_perc",), (), "vllm 0.7-0.8.2 (no engine label)"),
)

#: vLLM secondary offload tiers (``tier`` label) in plain tier words; others count as remote.
SECONDARY_TIERS = {
    "fs": "disk",
    "file": "disk",
    "disk": "disk",
    "obj": "object",
    "object": "object",
    "s3": "object",
}

#: Native CPU offloading (0.24+): (src, dst, bytes counter, seconds counter)
OFFLOAD = (
    ("host", "gpu", "vllm:kv_offload_load_bytes_total", "vllm:kv_offload_load_time_total"),
    ("gpu", "host", "vllm:kv_offload_store_bytes_total", "vllm:kv_offload_store_time_total"),
)
#: Prompt tokens served from each cache tier (0.32+); ``source="host"`` is the CPU offload tier
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
#: Legacy form (0.16+, still emitted for CPU offloading): transfer_type -> (src, dst)
OFFLOAD_LEGACY = {"CPU_to_GPU": ("host", "gpu"), "GPU_to_CPU": ("gpu", "host")}
OFFLOAD_LEGACY_BYTES = "vllm:kv_offload_total_bytes_total"
OFFLOAD_LEGACY_TIME = "vllm:kv_offload_total_time_total"
#: Tiered offloading (0.28+): read = secondary -> CPU, write = CPU -> secondary, per `tier`.
TIERING = (
    ("read", "vllm:kv_offload_tiering_read_bytes_total", "vllm:kv_offload_tiering_read_time_total"),
    ("write", "vllm:kv_offload_tiering_write_bytes_total", "vllm:kv_offload_tiering_write_time_total"),
)


def detect(expo: Exposition) -> bool:
    return any(expo.has(name) for name in ANCHORS)


#: families only vllm-project/production-stack's router exports (vllm_router metrics_service), each
#: ``vllm:``-named and labelled by ``server`` (a backend's URL), beside its own sums of the engines'
#: ``num_requests_running`` / ``_waiting``
ROUTER_ONLY = ("vllm:healthy_pods_total", "vllm:current_qps")


def refuse(expo: Exposition) -> str | None:
    """Why a page with vLLM's names is no engine's: the production-stack router's page, whose
    per-backend gauges would read as one made-up replica with every backend summed."""
    if any(labels.get("server") for name in ROUTER_ONLY for labels, _ in expo.series(name)):
        return (
            "this is vllm-project/production-stack's router page (vllm:healthy_pods_total, "
            "vllm:current_qps by server), not an engine's: scrape each vLLM engine's /metrics"
        )
    return None


def ranks(expo: Exposition) -> list[tuple[str | None, str | None]]:
    """(model_name, engine) pairs on the page, ordered by model then numeric rank."""
    return rank_keys(expo, ANCHORS, "engine")


def _has_engine_label(keys: list[tuple[str | None, str | None]]) -> bool:
    return any(engine is not None for _, engine in keys)


def hint(expo: Exposition) -> str:
    facts = frozenset({ENGINE_LABEL_FACT}) if _has_engine_label(ranks(expo)) else frozenset()
    return version_hint(expo, VERSION_HINTS, "vllm (version not recognised)", facts)


def _offload_traffic(view: RankView) -> list[TierTraffic | None]:
    # the offload connector's byte counters say what crossed; the prompt tokens it served from the
    # host tier (0.32+, `source="host"`) are the tokens loaded back instead of recomputed
    host_hits = view.value(CACHED_BY_SOURCE, source="host")
    out: list[TierTraffic | None] = [
        traffic(
            "vllm_offload",
            src,
            dst,
            bytes_total=view.value(b),
            seconds_total=view.value(t),
            **({"tokens_total": host_hits} if dst == "gpu" and view.value(b) is not None else {}),
        )
        for src, dst, b, t in OFFLOAD
    ]
    if not any(out):  # the legacy family only where the new one is absent: never count twice
        for transfer_type, (src, dst) in OFFLOAD_LEGACY.items():
            out.append(
                _transfer(
                    view,
                    ("vllm_offload_legacy", src, dst),
                    OFFLOAD_LEGACY_BYTES,
                    OFFLOAD_LEGACY_TIME,
                    transfer_type=transfer_type,
                )
            )
    for direction, bytes_name, time_name in TIERING:
        for tier in sorted({lab["tier"] for lab, _ in view.series(bytes_name) if "tier" in lab}):
            plain = SECONDARY_TIERS.get(tier.lower(), "remote")
            src, dst = (plain, "host") if direction == "read" else ("host", plain)
            out.append(_transfer(view, ("vllm_tiering", src, dst), bytes_name, time_name, tier=tier))
    return out


def _transfer(
    view: RankView, direction: tuple[str, str, str], bytes_name: str, time_name: str, **where: str
) -> TierTraffic | None:
    """(family, src, dst) from a bytes and a seconds counter, both read at the labels ``where``."""
    return traffic(
        *direction,
        bytes_total=view.value(bytes_name, shared=False, **where),
        seconds_total=view.value(time_name, shared=False, **where),
    )


class _Capacity(TypedDict):
    """The pool as ``vllm:cache_config_info`` labels describe it (ReplicaSample fields)."""

    block_size: int | None
    num_gpu_blocks: int | None
    kv_capacity_tokens: float | None
    cache_dtype: str | None
    kv_bytes_per_token: float | None


def _capacity(view: RankView) -> _Capacity:
    labels = view.labels_of(CACHE_CONFIG) or {}
    block_size = as_int(labels.get("block_size"))
    num_blocks = as_int(labels.get("num_gpu_blocks"))
    capacity = as_int(labels.get("kv_cache_size_tokens"))
    if capacity is None and block_size is not None and num_blocks is not None:
        capacity = block_size * num_blocks
    return {
        "block_size": block_size,
        "num_gpu_blocks": num_blocks,
        "kv_capacity_tokens": float(capacity) if capacity is not None else None,
        "cache_dtype": labels.get("cache_dtype"),
        "kv_bytes_per_token": kv_bytes_per_token(
            as_int(labels.get("kv_cache_memory_bytes")), num_blocks, block_size
        ),
    }


def kv_bytes_per_token(
    memory_bytes: int | None, num_blocks: int | None, block_size: int | None
) -> float | None:
    """``kv_cache_memory_bytes / (num_gpu_blocks x block_size)``, per GPU; None unless all are known.

    ``kv_cache_memory_bytes`` is the per-GPU KV budget given with ``--kv-cache-memory-bytes`` (or a
    saved startup plan); it is ``"None"`` when vLLM sized the pool from ``gpu_memory_utilization``.
    vLLM cuts the budget into whole blocks, the reserved null block included (it takes memory like
    any other), so the denominator is every block. Not ``kv_cache_size_tokens``: on hybrid models
    that counts what the pool serves per full-attention token, not the slots the bytes hold. The
    remainder of the cut makes this at most one block's worth high (< 1 / num_gpu_blocks).
    """
    if not memory_bytes or not num_blocks or not block_size or memory_bytes <= 0:
        return None
    return memory_bytes / (num_blocks * block_size)


def parse(expo: Exposition, replica: str, scraped_at: float) -> list[ReplicaSample]:
    scrape = Scrape(replica, BACKEND, scraped_at, hint(expo))
    out = []
    for model, engine, view in rank_views(expo, ranks(expo), "engine"):
        values = read_fields(view, FIELDS)
        capacity = _capacity(view)
        usage, blocks = values["kv_usage_ratio"], capacity["num_gpu_blocks"]
        used_blocks = round(usage * (blocks - 1)) if usage is not None and blocks else None
        tiers = [t for t in _offload_traffic(view) if t is not None]
        tiers.extend(lmcache.tier_traffic(view, model))
        out.append(
            scrape.sample(
                model_name=model,
                dp_rank=engine,
                kv_used_blocks=float(used_blocks) if used_blocks is not None else None,
                finished_requests_total=view.by_label("vllm:request_success_total", "finished_reason"),
                tier_traffic=tuple(tiers),
                histograms=read_histograms(view, HISTOGRAMS),
                **values,
                **capacity,
            )
        )
    return out


def notes(expo: Exposition) -> list[str]:
    """What a reader of ``inspect`` should know about this page."""
    out = []
    keys = ranks(expo)
    engines = {engine for _, engine in keys}
    if len(engines) > 1:
        out.append(f"{len(engines)} data-parallel ranks (vLLM `engine` label): one replica sample each")
        if lmcache.present(expo):
            out.append("lmcache:* families carry no DP rank: LMCache traffic not attributed to a rank")
    if expo.has_prefix("dynamo_component_"):
        out.append("Dynamo worker page: KV read from the vllm: families; dynamo_component_* ignored")
    if expo.has(OFFLOAD_LEGACY_BYTES) and any(expo.has(b) for _, _, b, _ in OFFLOAD):
        out.append("legacy kv_offload_total_bytes{transfer_type} ignored: kv_offload_{load,store}_* present")
    return out
