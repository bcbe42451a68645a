"""llama.cpp ``llama-server --metrics`` (``llamacpp:*``, hand-written, no labels) and ``GET /slots``.

``/metrics``: requests processing/deferred, token counters. Builds up to early 2025 also had
``kv_cache_usage_ratio`` (used cells / n_ctx) and ``kv_cache_tokens``; newer builds have no KV gauge and
the per-slot state on ``/slots`` is the only KV source. In 2026 builds ``prompt_tokens_total`` excludes
cached prompt tokens (``prompt_tokens_cached_total`` counts those), so prompt tokens = processed + cached.

``/slots``: one JSON object per slot (``-np``), each with its own ``n_ctx``. With ``-np N`` the
context is split evenly between the slots, and their ``n_ctx`` add up to the pool. Without ``-np``,
llama-server (since late 2025, ggml-org/llama.cpp#16736) runs 4 slots sharing one pool
(``kv_unified``), and each slot's ``n_ctx`` is the whole pool (or the model's training context, if
smaller): nothing on ``/slots`` or ``/props`` tells the two apart, so the sum stands, 4 equal slots get
a hint in the version line, and ``replicas[].kv_capacity_tokens`` gives the pool (``-c``). A slot keeps
its tokens in the KV cache after a request ends, for prompt reuse. Tokens held
(``SlotSample.tokens_in_use``):

* 2025+ builds: ``n_prompt_tokens`` is the slot's whole token list (prompt *and* generated so far;
  seen live: 42 = 18 processed + 24 decoded); ``n_prompt_tokens_processed + n_prompt_tokens_cache +
  next_token.n_decoded`` gives the same while generating. The larger of the two is used, which is
  also right for builds where ``n_prompt_tokens`` was the prompt alone.
* older builds without token counts: None.

``apply_slots`` fills the sample: capacity = sum of slot ``n_ctx``; live tokens = tokens of processing
slots (= ``kv_used_tokens``, the usage ratio's numerator, matching vLLM/SGLang where cached-but-idle
KV counts as free); tokens kept by idle slots = ``kv_evictable_tokens``. The slot JSON also carries
the prompt and generated text: only the numbers above are read, the text is never kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvwatch.engines.base import (
    ExtraPage,
    Field,
    RankView,
    Scrape,
    VersionHint,
    read_fields,
    version_hint,
)
from kvwatch.engines.exposition_parser import Exposition
from kvwatch.engines.fetch import ACCEPT_JSON
from kvwatch.jsonsafe import loads
from kvwatch.model import MAX_COUNT, ReplicaSample, SlotSample

BACKEND = "llamacpp"
PREFIX = "llamacpp:"

FIELDS: tuple[Field, ...] = (
    Field("requests_running", ("llamacpp:requests_processing",)),
    Field("requests_waiting", ("llamacpp:requests_deferred",)),
    Field("generation_tokens_total", ("llamacpp:tokens_predicted_total",)),
    Field("kv_usage_ratio", ("llamacpp:kv_cache_usage_ratio",)),
    Field("kv_used_tokens", ("llamacpp:kv_cache_tokens",)),
)
PROMPT_PROCESSED = "llamacpp:prompt_tokens_total"
PROMPT_CACHED = "llamacpp:prompt_tokens_cached_total"

VERSION_HINTS: tuple[VersionHint, ...] = (
    VersionHint(
        ("llamacpp:kv_cache_usage_ratio",),
        (),
        "llama.cpp <= early 2025 (kv_cache_usage_ratio, kv_cache_tokens)",
    ),
    VersionHint((PROMPT_CACHED,), (), "llama.cpp 2026 (prompt_tokens_cached_total; KV only on /slots)"),
)
DEFAULT_HINT = "llama.cpp 2025 (no KV gauge; KV only on /slots)"


class SlotsError(ValueError):
    """``/slots`` did not hold a list of slot objects."""


def detect(expo: Exposition) -> bool:
    return expo.has_prefix(PREFIX)


def parse(expo: Exposition, replica: str, scraped_at: float) -> list[ReplicaSample]:
    view = RankView(expo, {})
    scrape = Scrape(replica, BACKEND, scraped_at, version_hint(expo, VERSION_HINTS, DEFAULT_HINT))
    values = read_fields(view, FIELDS)
    processed, cached = view.value(PROMPT_PROCESSED), view.value(PROMPT_CACHED)
    prompt = processed + cached if processed is not None and cached is not None else processed
    return [
        scrape.sample(
            prompt_tokens_total=prompt,
            prefix_cache_queries_total=prompt if cached is not None else None,
            prefix_cache_hits_total=cached,
            **values,
        )
    ]


def _int(value: Any) -> int | None:
    """A slot's count, or None: not an integer, negative, or over MAX_COUNT (no slot is that long,
    and float() of a 400-digit int overflows the KV arithmetic)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    return None


def _slot(raw: Any, index: int) -> SlotSample:
    if not isinstance(raw, dict):
        raise SlotsError(f"slot {index} is a {type(raw).__name__}, expected an object")
    next_token = raw.get("next_token")
    if isinstance(next_token, list):  # 2025+ builds: a one-element list
        next_token = next_token[0] if next_token else None
    decoded = _int(next_token.get("n_decoded")) if isinstance(next_token, dict) else None
    listed = _int(raw.get("n_prompt_tokens"))
    parts = (_int(raw.get("n_prompt_tokens_processed")), _int(raw.get("n_prompt_tokens_cache")), decoded)
    summed = sum(p for p in parts if p is not None) if all(p is not None for p in parts) else None
    candidates = [v for v in (listed, summed) if v is not None]
    processing = raw.get("is_processing")
    if processing is None and "state" in raw:  # 2024 builds: state 0 = idle
        processing = raw.get("state") != 0
    slot_id = _int(raw.get("id"))
    return SlotSample(
        slot_id=slot_id if slot_id is not None else index,
        n_ctx=_int(raw.get("n_ctx")),
        tokens_in_use=max(candidates) if candidates else None,
        is_processing=bool(processing),
    )


def parse_slots(text: str | bytes) -> tuple[SlotSample, ...]:
    """``GET /slots`` body -> SlotSamples (numbers only; prompt/generated text is dropped)."""
    try:
        data = loads(text)
    except ValueError as exc:
        raise SlotsError(f"not JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("slots"), list):
        data = data["slots"]
    if not isinstance(data, list):
        raise SlotsError(f"expected a JSON list of slots, got {type(data).__name__}")
    return tuple(_slot(raw, i) for i, raw in enumerate(data))


def _total(values: Sequence[int | None]) -> float | None:
    """Sum, or None when any slot did not report the number (an empty selection sums to 0)."""
    if any(v is None for v in values):
        return None
    return float(sum(v for v in values if v is not None))


#: slots llama-server runs without -np, all sharing one KV pool (kv_unified)
DEFAULT_UNIFIED_SLOTS = 4


def apply_slots(replica_sample: ReplicaSample, slots: Sequence[SlotSample]) -> ReplicaSample:
    """Fill KV capacity, usage and live tokens from slots. Where the slots count their tokens, used
    tokens are the processing slots' (``/metrics``' ``kv_cache_tokens`` of older builds counts the
    cells idle slots keep for prompt reuse too, which are ``kv_evictable_tokens`` here: free on
    demand, as vLLM and SGLang count them); else what ``/metrics`` said."""
    if not slots:
        return replica_sample
    capacity = _total([s.n_ctx for s in slots])
    live = _total([s.tokens_in_use for s in slots if s.is_processing])
    idle = _total([s.tokens_in_use for s in slots if not s.is_processing])
    used, usage = replica_sample.kv_used_tokens, replica_sample.kv_usage_ratio
    counted = used is None or all(s.tokens_in_use is not None for s in slots)
    if live is not None and counted:
        used = live
        usage = live / capacity if capacity else usage
    elif usage is None and used is not None and capacity:
        usage = used / capacity
    hint = replica_sample.version_hint or DEFAULT_HINT
    sizes = {s.n_ctx for s in slots}
    shared = (
        f"; {len(slots)} slots of equal n_ctx, as llama-server's default without -np, whose slots share "
        "one pool: if so, set kv_capacity_tokens to its -c"
        if len(slots) == DEFAULT_UNIFIED_SLOTS and len(sizes) == 1
        else ""
    )
    return dataclasses.replace(
        replica_sample,
        kv_capacity_tokens=replica_sample.kv_capacity_tokens or capacity,
        kv_used_tokens=used,
        kv_usage_ratio=usage,
        kv_evictable_tokens=idle,
        live_tokens=live,
        version_hint=f"{hint}; KV from /slots ({len(slots)} slots){shared}",
    )


def _with_slots(body: bytes, samples: tuple[ReplicaSample, ...]) -> tuple[ReplicaSample, ...]:
    slots = parse_slots(body)
    return tuple(apply_slots(s, slots) for s in samples)


#: ``/slots``, fetched after ``/metrics``: the only KV source of newer builds
EXTRA_PAGE = ExtraPage(
    "/slots",
    ACCEPT_JSON,
    _with_slots,
    "KV numbers from /slots unavailable (start llama-server with --slots, or set replicas[].slots_url)",
)
