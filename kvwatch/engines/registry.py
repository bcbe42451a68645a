"""Which adapter reads a page, and the one call sources use: ``parse_exposition``.

Detection order matters. Dynamo worker pages re-export the engine's own families (``vllm:``,
``lmcache:``, ``sglang:``, ``trtllm_``) next to ``dynamo_component_*``: such a page is that engine's
for KV purposes, because the engine families are the source and carry the engine's ranks, capacity
and counters, while Dynamo's KV stats are a coarser copy. So the engine adapters are tried first
and ``dynamo`` only claims pages without engine families: the frontend, KVBM, and workers whose
engine metrics are not passed through.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

from kvwatch.engines import dynamo, llamacpp, sglang, tgi, trtllm, vllm
from kvwatch.engines.base import ExtraPage
from kvwatch.engines.exposition_parser import Exposition, parse_text
from kvwatch.model import ReplicaSample


class EngineAdapter(Protocol):
    """What every adapter module provides. Optional: ``notes(expo) -> list[str]`` (what ``inspect``
    says about a page), ``refuse(expo) -> str | None`` (why a page with the engine's names is not an
    engine's) and ``EXTRA_PAGE`` (a page read besides ``/metrics``)."""

    BACKEND: str

    def detect(self, expo: Exposition) -> bool: ...

    def parse(self, expo: Exposition, replica: str, scraped_at: float) -> list[ReplicaSample]: ...


#: backend -> adapter module, in detection order
ADAPTERS: dict[str, EngineAdapter] = {
    vllm.BACKEND: vllm,
    sglang.BACKEND: sglang,
    trtllm.BACKEND: trtllm,
    llamacpp.BACKEND: llamacpp,
    tgi.BACKEND: tgi,
    dynamo.BACKEND: dynamo,
}


class NoEngineMetricsError(ValueError):
    """The page parsed but holds no family an engine adapter recognises."""


@dataclass(frozen=True, slots=True)
class ParseResult:
    backend: str
    samples: tuple[ReplicaSample, ...]
    notes: tuple[str, ...] = field(default=())
    #: (reason, count) of page samples dropped or folded while parsing (catalog.REJECTED_SAMPLE_REASONS)
    rejected: tuple[tuple[str, int], ...] = field(default=())


def extra_page(backend: str) -> ExtraPage | None:
    """The page the backend's adapter reads besides ``/metrics``, if it has one."""
    return getattr(ADAPTERS.get(backend), "EXTRA_PAGE", None)


def detect_backend(expo: Exposition) -> str | None:
    """The first adapter (in ``ADAPTERS`` order) that recognises the page, or None."""
    for backend, adapter in ADAPTERS.items():
        if adapter.detect(expo):
            return backend
    return None


def _why_nothing(expo: Exposition, backend: str) -> str:
    names = expo.names()
    first = list(islice(names, 8))  # page order: sorting every name of a huge page would stall
    shown = ", ".join(first) + (", ..." if len(names) > 8 else "") if names else "no samples at all"
    wanted = "any known engine family" if backend == "auto" else f"{backend} families"
    hint = ""
    if expo.has("http_requests_total") or expo.has_prefix("http_request"):
        hint = " (a vLLM started with --disable-log-stats exposes only http_* metrics)"
    return f"expected {wanted}, found {len(names)} other series names: {shown}{hint}"


def parse_families(
    expo: Exposition, replica: str, backend: str = "auto", scraped_at: float | None = None
) -> ParseResult:
    """Parse an already-parsed page with the given (or detected) backend's adapter."""
    when = time.time() if scraped_at is None else scraped_at
    chosen = detect_backend(expo) if backend == "auto" else backend
    adapter = ADAPTERS.get(chosen) if chosen else None
    if backend != "auto" and adapter is None:
        raise ValueError(f"unknown backend {backend!r} (one of auto, {', '.join(ADAPTERS)})")
    if chosen is None or adapter is None or not adapter.detect(expo):
        raise NoEngineMetricsError(_why_nothing(expo, backend))
    refusal = adapter.refuse(expo) if hasattr(adapter, "refuse") else None
    if refusal:
        raise NoEngineMetricsError(refusal)
    samples = tuple(adapter.parse(expo, replica, when))
    if not samples:
        raise NoEngineMetricsError(f"{chosen} families present but no replica could be identified")
    notes = tuple(adapter.notes(expo)) if hasattr(adapter, "notes") else ()
    return ParseResult(chosen, samples, notes, tuple(sorted(expo.dropped.items())))


def parse_exposition(
    text: str, replica: str, backend: str = "auto", scraped_at: float | None = None
) -> ParseResult:
    """Exposition text -> the replicas on it. Raises ``ExpositionError`` (malformed text) or
    ``NoEngineMetricsError`` (valid text without engine families)."""
    return parse_families(parse_text(text), replica, backend, scraped_at)
