"""SGLang ``/metrics`` (0.3 -> 0.5.23) -> ReplicaSample per DP rank.

Replica key = (scrape target, ``model_name``, ``dp_rank``); without ``dp_rank`` the page is one
replica. Every TP rank may report the same logical counts under its own ``tp_rank`` (with
``--enable-metrics-for-all-schedulers``, and always for HiCache), so each name is read from the
lowest ``tp_rank`` / ``pp_rank`` present for the replica, never summed (the HiCache doc string says
"read one rank rather than summing ranks"). Tokenizer-side families (latency histograms, token
counters) carry no rank: on a page with several DP ranks they belong to no single rank and stay None.

SGLang counts KV in tokens, exactly: ``token_usage`` = used / capacity where radix-cached (evictable)
tokens are not used; ``kv_used_tokens`` (0.5.12+, else ``num_used_tokens``) is what running requests
hold. With the default page size of 1 that is token-exact, so it is also ``live_tokens``; with larger
pages (``sglang:page_size`` > 1) used slots are whole pages and live tokens stay None. Capacity is
``max_total_num_tokens`` (0.5.6+); older pages have no capacity gauge and it stays None rather than
being reverse-engineered from the usage ratio. KV bytes per token (per GPU) come from
``kv_cache_memory_usage_gb`` (0.5.12+, GiB) over the pool's slots (``kv_bytes_per_token``).

Token counters: ``prompt_tokens_total`` / ``generation_tokens_total`` (tokenizer side) move only when
a request finishes, by its whole length, so over a window where requests decode and none finishes
they stand still: no measure of how fast the pool grows. Where the scheduler's
``realtime_tokens_total{mode}`` is on the page (0.5.8+, per rank) the sample's token counters are
that, counted as each batch runs (prompt = ``prefill_compute`` + ``prefill_cache``, generation =
``decode``); on older pages they are the tokenizer's, marked ``token_counters_at_finish`` (headroom
is then unknown). Prefix-cache queries stay the tokenizer's prompt tokens, the base its
``cached_tokens_total`` hits are counted against.

Finished requests: ``num_requests_total`` (tokenizer side, no reason label) is kept as
``finished_requests_total = (("all", n),)``; headroom sums every reason, so one key serves it.
Per-request ``prompt_tokens_histogram`` / ``generation_tokens_histogram`` become the ``prompt_tokens``
/ ``generation_tokens`` histograms headroom reads the size of finished requests from.

Retractions (SGLang's preemptions): ``num_retracted_requests_total`` is a counter (0.5.8+). The older
``num_retracted_reqs`` gauge (0.5.3+, ``total_retracted_reqs`` in 0.4.10-0.5.1) holds the count of the
last log interval and is reset each interval, with a ``pid`` label from multiprocess mode. It cannot
be turned into a counter: scraping faster than the log interval would count one interval twice,
slower would miss intervals. Such pages get ``preemptions_total = None`` and say so in the version
hint. ``recomputed_tokens_total`` = retracted input + output tokens: an upper bound of the recompute
(some of it is re-hit in the radix cache).
"""

from __future__ import annotations

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

BACKEND = "sglang"
PREFIX = "sglang:"

#: Copy labels: read the lowest one present, never sum across them.
COPY_LABELS = ("tp_rank", "pp_rank", "attn_cp_rank", "moe_ep_rank")

ANCHORS = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:num_used_tokens",
    "sglang:max_total_num_tokens",
)

FIELDS: tuple[Field, ...] = (
    Field("kv_usage_ratio", ("sglang:token_usage",)),
    Field("kv_used_tokens", ("sglang:kv_used_tokens", "sglang:num_used_tokens")),
    Field("kv_evictable_tokens", ("sglang:kv_evictable_tokens",)),
    Field("kv_capacity_tokens", ("sglang:max_total_num_tokens",)),
    Field("requests_running", ("sglang:num_running_reqs",)),
    Field("requests_waiting", ("sglang:num_queue_reqs",)),
    Field("requests_swapped_or_paused", ("sglang:num_paused_reqs",)),
    Field("preemptions_total", ("sglang:num_retracted_requests_total",)),
    Field("prompt_tokens_total", ("sglang:prompt_tokens_total",)),
    Field("generation_tokens_total", ("sglang:generation_tokens_total",)),
)
RETRACTED_TOKENS = ("sglang:num_retracted_input_tokens_total", "sglang:num_retracted_output_tokens_total")
CACHED_TOKENS = "sglang:cached_tokens_total"
FINISHED = "sglang:num_requests_total"
#: ``finished_requests_total`` key: SGLang counts finished requests without a reason split
FINISHED_ALL = "all"
KV_MEMORY_GIB = "sglang:kv_cache_memory_usage_gb"
REALTIME = "sglang:realtime_tokens_total"  # scheduler side, per rank, by mode (0.5.8+)
GIB = 1024**3  # SGLang's ``GB`` (mem_cache/memory_pool.py: GB = 1024 * 1024 * 1024)

HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("sglang:time_to_first_token_seconds",),
    "e2e": ("sglang:e2e_request_latency_seconds",),
    "itl": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    "prompt_tokens": ("sglang:prompt_tokens_histogram",),
    "generation_tokens": ("sglang:generation_tokens_histogram",),
    "num_preemptions": ("sglang:num_retractions",),
}

VERSION_HINTS: tuple[VersionHint, ...] = (
    VersionHint(("sglang:kv_used_tokens",), (), "sglang>=0.5.12 (kv_used/available/evictable_tokens)"),
    VersionHint(
        ("sglang:max_total_num_tokens", "sglang:num_retracted_requests_total"),
        (),
        "sglang 0.5.8-0.5.11 (max_total_num_tokens, retraction counters)",
    ),
    VersionHint(
        ("sglang:max_total_num_tokens",),
        (),
        "sglang 0.5.6-0.5.8 (max_total_num_tokens; retractions only as a per-interval gauge)",
    ),
    VersionHint(
        ("sglang:num_retracted_reqs",),
        (),
        "sglang 0.5.3-0.5.5 (no capacity gauge; retractions only as a per-interval gauge)",
    ),
    VersionHint(
        ("sglang:total_retracted_reqs",),
        (),
        "sglang 0.4.10-0.5.1 (no capacity gauge; retractions only as a per-interval gauge)",
    ),
)
DEFAULT_HINT = "sglang<=0.4.9 (no capacity gauge, no retraction metrics)"

#: HiCache L1 (GPU) <-> L2 (host): (src, dst, tokens, bytes, duration histogram)
HICACHE = (
    (
        "host",
        "gpu",
        "sglang:load_back_tokens_total",
        "sglang:load_back_bytes_total",
        "sglang:load_back_duration_seconds",
    ),
    (
        "gpu",
        "host",
        "sglang:hicache_backup_tokens_total",
        "sglang:hicache_backup_bytes_total",
        "sglang:hicache_backup_duration_seconds",
    ),
)
#: HiCache L2 (host) <-> L3 storage: (direction, tokens counter); the L3 tier from `storage_backend`.
STORAGE = (("load", "sglang:prefetched_tokens_total"), ("store", "sglang:backuped_tokens_total"))
STORAGE_TIERS = {"file": "disk", "local": "disk", "disk": "disk"}  # mooncake, hf3fs, nixl, ... -> remote


def detect(expo: Exposition) -> bool:
    return any(expo.has(name) for name in ANCHORS) or expo.has("sglang:prompt_tokens_total")


def ranks(expo: Exposition) -> list[tuple[str | None, str | None]]:
    """(model_name, dp_rank) pairs; a page with only tokenizer families (no rank) is one replica."""
    return rank_keys(expo, ANCHORS, "dp_rank") or rank_keys(expo, ("sglang:prompt_tokens_total",), "dp_rank")


def _kv_pool(view: RankView, name: str) -> float | None:
    """Token counters split by ``pool`` (kv, swa, mamba): the full-attention ``kv`` pool."""
    if any("pool" in labels for labels, _ in view.series(name)):
        return view.value(name, pool="kv")
    return view.value(name)


def _duration(view: RankView, name: str) -> float | None:
    return view.value(f"{name}_sum")


def _tier_traffic(view: RankView) -> list[TierTraffic | None]:
    out = [
        traffic(
            "sglang_hicache",
            src,
            dst,
            tokens_total=_kv_pool(view, tokens),
            bytes_total=view.value(bytes_),
            seconds_total=_duration(view, hist),
        )
        for src, dst, tokens, bytes_, hist in HICACHE
    ]
    for direction, name in STORAGE:
        backends = sorted({lab.get("storage_backend", "") for lab, _ in view.series(name)})
        for backend in backends:
            tier = STORAGE_TIERS.get(backend.lower(), "remote")
            src, dst = (tier, "host") if direction == "load" else ("host", tier)
            tokens = view.value(name, storage_backend=backend) if backend else view.value(name)
            out.append(traffic("sglang_storage", src, dst, tokens_total=tokens))
    return out


def _prefix_hits(view: RankView) -> float | None:
    """Device (GPU radix cache) hits: ``cache_source="device"`` from 0.5.12, unlabelled before."""
    if any("cache_source" in labels for labels, _ in view.series(CACHED_TOKENS)):
        return view.value(CACHED_TOKENS, cache_source="device")
    return view.value(CACHED_TOKENS)


def kv_bytes_per_token(
    memory_gib: float | None, capacity_tokens: float | None, page_size: int | None
) -> float | None:
    """``kv_cache_memory_usage_gb x 2^30 / (max_total_num_tokens + page_size)``, per GPU.

    The gauge (0.5.12+) is the KV pool's ``mem_usage``: the K and V buffers of one TP rank in GiB
    (SGLang's ``GB`` is 1024^3). Each buffer holds ``max_total_num_tokens + page_size`` slots (one
    padding page for dummy writes), so that is the divisor. On hybrid pools (SWA, Mamba) the bytes
    include the other pool and this is an average over the full-attention slots.
    """
    if not memory_gib or not capacity_tokens or memory_gib <= 0 or capacity_tokens <= 0:
        return None
    return memory_gib * GIB / (capacity_tokens + (page_size or 1))


def _finished(view: RankView) -> tuple[tuple[str, float], ...]:
    """Finished requests (tokenizer side, summed over ``is_streaming``) under one ``all`` key."""
    total = view.value(FINISHED)
    return () if total is None else ((FINISHED_ALL, total),)


def _realtime_tokens(view: RankView) -> tuple[float, float] | None:
    """(prompt, generation) tokens from the scheduler's ``realtime_tokens_total`` (0.5.8+), counted as
    each batch runs, per rank; None on pages without it. A mode not yet run has no series (0)."""
    if not view.series(REALTIME):
        return None
    prompt = sum(view.value(REALTIME, mode=mode) or 0.0 for mode in ("prefill_compute", "prefill_cache"))
    return prompt, view.value(REALTIME, mode="decode") or 0.0


def _sum_or_none(*values: float | None) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def parse(expo: Exposition, replica: str, scraped_at: float) -> list[ReplicaSample]:
    scrape = Scrape(replica, BACKEND, scraped_at, version_hint(expo, VERSION_HINTS, DEFAULT_HINT))
    out = []
    for model, dp_rank, view in rank_views(expo, ranks(expo), "dp_rank", lowest=COPY_LABELS):
        values = read_fields(view, FIELDS)
        finished_prompts = values["prompt_tokens_total"]  # what the prefix-cache hits are counted against
        realtime = _realtime_tokens(view)
        if realtime is not None:
            values["prompt_tokens_total"], values["generation_tokens_total"] = realtime
        page = as_int(view.value("sglang:page_size"))
        tiers = [t for t in _tier_traffic(view) if t is not None]
        tiers.extend(lmcache.tier_traffic(view, model))
        out.append(
            scrape.sample(
                model_name=model,
                dp_rank=dp_rank,
                block_size=page,
                num_gpu_blocks=as_int(view.value("sglang:num_pages")),
                kv_bytes_per_token=kv_bytes_per_token(
                    view.value(KV_MEMORY_GIB), values["kv_capacity_tokens"], page
                ),
                finished_requests_total=_finished(view),
                live_tokens=values["kv_used_tokens"] if page in (None, 1) else None,
                recomputed_tokens_total=_sum_or_none(*(view.value(n) for n in RETRACTED_TOKENS)),
                prefix_cache_queries_total=finished_prompts,
                token_counters_at_finish=realtime is None and values["generation_tokens_total"] is not None,
                prefix_cache_hits_total=_prefix_hits(view),
                tier_traffic=tuple(tiers),
                histograms=read_histograms(view, HISTOGRAMS),
                **values,
            )
        )
    return out


def notes(expo: Exposition) -> list[str]:
    out = []
    dps = {dp for _, dp in ranks(expo)}
    if len(dps) > 1:
        out.append(
            f"{len(dps)} data-parallel ranks (dp_rank): tokenizer-side token counters and "
            "latency histograms carry no rank and are left out of the per-rank samples"
        )
    if expo.has("sglang:num_retracted_reqs") and not expo.has("sglang:num_retracted_requests_total"):
        out.append(
            "sglang:num_retracted_reqs is a per-interval gauge, not a counter: preemptions_total left None"
        )
    if expo.has_prefix("dynamo_component_"):
        out.append("Dynamo worker page: KV read from the sglang: families; dynamo_component_* ignored")
    return out
