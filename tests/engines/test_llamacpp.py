"""llama.cpp: /metrics of old and new builds, and /slots as the KV source."""

from __future__ import annotations

import dataclasses

import pytest

from kvwatch.engines import llamacpp
from kvwatch.engines.llamacpp import SlotsError, apply_slots, parse_slots

from .helpers import LLAMACPP_TINY, only, page


def test_real_tiny_capture_new_build():
    s = only(LLAMACPP_TINY)
    assert (s.backend, s.model_name) == ("llamacpp", None)
    assert (s.requests_running, s.requests_waiting, s.generation_tokens_total) == (0.0, 0.0, 24.0)
    # 2026 builds: prompt_tokens_total excludes cached tokens; total prompt = processed + cached
    assert (s.prompt_tokens_total, s.prefix_cache_hits_total) == (67.0, 0.0)
    assert s.prefix_cache_queries_total == 67.0
    assert s.kv_usage_ratio is None and s.kv_capacity_tokens is None
    assert s.version_hint == "llama.cpp 2026 (prompt_tokens_cached_total; KV only on /slots)"


def test_old_build_kv_gauges():
    s = only("llamacpp_2024_kv_cache_usage_ratio.prom")
    assert (s.kv_usage_ratio, s.kv_used_tokens) == (0.4375, 1792.0)
    assert (s.prompt_tokens_total, s.prefix_cache_hits_total) == (5120.0, None)
    assert s.version_hint.startswith("llama.cpp <= early 2025")


def test_slots_of_a_2026_build():
    slots = parse_slots(page("llamacpp_slots_2026_two_slots.json"))
    assert [(s.slot_id, s.n_ctx, s.tokens_in_use, s.is_processing) for s in slots] == [
        (0, 256, 42, True),
        (1, 256, 217, False),
    ]


def test_slots_keep_no_prompt_or_generated_text():
    slots = parse_slots(page("llamacpp_slots_2026_two_slots.json"))
    assert "SECRET" not in repr(slots)
    assert {f.name for f in dataclasses.fields(slots[0])} == {
        "slot_id",
        "n_ctx",
        "tokens_in_use",
        "is_processing",
    }


def test_slots_of_a_2024_build_with_state_field():
    slots = parse_slots(page("llamacpp_slots_2024_state_field.json"))
    assert [(s.n_ctx, s.tokens_in_use, s.is_processing) for s in slots] == [
        (2048, None, True),
        (2048, None, False),
    ]


def test_tokens_in_use_falls_back_to_parts_when_prompt_count_is_the_prompt_only():
    slots = parse_slots(
        '[{"id": 0, "n_ctx": 100, "is_processing": true, "n_prompt_tokens": 10, '
        '"n_prompt_tokens_processed": 4, "n_prompt_tokens_cache": 6, '
        '"next_token": {"n_decoded": 5}}]'
    )
    assert slots[0].tokens_in_use == 15


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("<html>nope</html>", "not JSON"),
        ('{"error": "slots disabled"}', "expected a JSON list"),
        ("[1, 2]", "slot 0 is a int"),
    ],
)
def test_bad_slots_body_raises_slots_error(body, fragment):
    with pytest.raises(SlotsError, match=fragment):
        parse_slots(body)


def test_apply_slots_fills_capacity_usage_live_and_evictable():
    s = apply_slots(only(LLAMACPP_TINY), parse_slots(page("llamacpp_slots_2026_two_slots.json")))
    assert s.kv_capacity_tokens == 512.0
    assert (s.live_tokens, s.kv_used_tokens, s.kv_evictable_tokens) == (42.0, 42.0, 217.0)
    assert s.kv_usage_ratio == pytest.approx(42 / 512)
    assert s.version_hint.endswith("KV from /slots (2 slots)")


def test_apply_slots_keeps_the_old_builds_own_kv_gauges():
    base = only("llamacpp_2024_kv_cache_usage_ratio.prom")
    s = apply_slots(base, parse_slots(page("llamacpp_slots_2024_state_field.json")))
    assert (s.kv_usage_ratio, s.kv_used_tokens, s.kv_capacity_tokens) == (0.4375, 1792.0, 4096.0)
    assert s.live_tokens is None  # this build's slots carry no token counts


def test_the_cells_idle_slots_keep_are_evictable_not_used_where_the_slots_count_them():
    """A build with both the old /metrics KV gauges (used cells, idle slots' kept prompts included)
    and token counts on /slots: used + evictable came to more than the pool (7,000 + 6,000 of 8,192)."""
    from kvwatch.model import SlotSample

    base = dataclasses.replace(
        only("llamacpp_2024_kv_cache_usage_ratio.prom"), kv_used_tokens=7000.0, kv_usage_ratio=7000 / 8192
    )
    slots = (SlotSample(0, 4096, 1000, True), SlotSample(1, 4096, 6000, False))
    s = apply_slots(base, slots)
    assert (s.kv_used_tokens, s.kv_evictable_tokens, s.live_tokens) == (1000.0, 6000.0, 1000.0)
    assert s.kv_usage_ratio == pytest.approx(1000 / 8192)


def test_apply_no_slots_changes_nothing():
    base = only(LLAMACPP_TINY)
    assert apply_slots(base, ()) is base


def test_detect_needs_llamacpp_families():
    from kvwatch.engines.exposition_parser import parse_text

    assert not llamacpp.detect(parse_text("process_cpu_seconds_total 1\n"))
