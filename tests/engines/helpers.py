"""Fixture pages for engine tests: real captures and pages written from the engines' source (one per
version boundary)."""

from __future__ import annotations

from pathlib import Path

from kvwatch.engines.registry import ParseResult, parse_exposition
from kvwatch.model import ReplicaSample

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "engines"
#: real captures of engine /metrics pages (from the project's shared fixture set)
CAPTURED = FIXTURES / "captured"

VLLM_DYNAMO_LMCACHE = CAPTURED / "vllm-0.13-0.14-v1-lmcache-dynamo-2026-01-2.prom"
SGLANG_DYNAMO = CAPTURED / "sglang-0.5.6-0.5.8-dynamo-2026-01-2.prom"
LLAMACPP_TINY = CAPTURED / "llamacpp-0.5.0dev-tiny.prom"

SCRAPED_AT = 1_800_000_000.0


def page(name: str | Path) -> str:
    path = name if isinstance(name, Path) else FIXTURES / name
    return path.read_text(encoding="utf-8")


def parse(name: str | Path, backend: str = "auto", replica: str = "r0") -> ParseResult:
    return parse_exposition(page(name), replica, backend, scraped_at=SCRAPED_AT)


def samples(name: str | Path, backend: str = "auto") -> tuple[ReplicaSample, ...]:
    return parse(name, backend).samples


def only(name: str | Path, backend: str = "auto") -> ReplicaSample:
    found = samples(name, backend)
    assert len(found) == 1, [s.key for s in found]
    return found[0]


def tiers(sample: ReplicaSample) -> dict[tuple[str, str, str], object]:
    """(family, src, dst) -> TierTraffic."""
    return {(t.family, t.src_tier, t.dst_tier): t for t in sample.tier_traffic}
