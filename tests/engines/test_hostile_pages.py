"""Engine pages an attacker would serve: each is read in linear time, within limits, or refused.

Every case here once hurt a running agent: a long line that made the sample regex
backtrack for 30 s, 3,200 ranks read quadratically, 20,000 label values exported as 20,000 series,
duplicates summed, impossible values exported, odd rank labels failing the replica.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from kvwatch.engines.base import rank_sort_key
from kvwatch.engines.exposition_parser import ExpositionError, Limits, parse_text
from kvwatch.engines.registry import parse_exposition, parse_families
from kvwatch.safetext import terminal_safe
from tests.engines import hostile
from tests.timing import fastest

UNCAPPED = Limits(max_line_length=10**9)


@pytest.mark.parametrize("shape", sorted(hostile.LONG_LINES))
def test_a_long_hostile_line_takes_linear_time(shape):
    """200,000 characters: linear is milliseconds; the old regex needed hours on some of these."""
    line = hostile.LONG_LINES[shape](200_000) + "\n"

    def parse() -> None:
        with contextlib.suppress(ExpositionError):
            parse_text(line, UNCAPPED)

    assert fastest(parse, under_s=0.5) < 0.5  # fastest of up to 3 tries (tests/timing.py)


def test_a_line_over_the_cap_is_malformed_and_names_the_limit():
    limits = Limits(max_line_length=100)
    assert parse_text("m " + "1" * 98 + "\n", limits).series("m")  # exactly at the cap: fine
    with pytest.raises(ExpositionError) as err:
        parse_text("ok 1\nm " + "1" * 99 + "\n", limits)
    assert err.value.line == 2
    assert "101 characters" in str(err.value) and "scrape.max_line_length" in str(err.value)


def test_the_default_cap_refuses_the_40000_character_line_at_once():
    page = hostile.vllm_page() + hostile.LONG_LINES["name then junk"](40_000) + "\n"

    def refuse() -> None:
        with pytest.raises(ExpositionError, match="max_line_length"):
            parse_text(page)

    assert fastest(refuse, under_s=0.5) < 0.5


def test_3200_ranks_fold_into_the_rank_cap_and_read_fast():
    text = hostile.many_ranks(3200)
    assert 0.8e6 < len(text) < 2e6  # the ~1 MB page that once took 11.6 s
    results = []
    assert fastest(lambda: results.append(parse_exposition(text, "r0", "vllm")), under_s=3.0) < 3.0
    result = results[-1]
    ranks = [s.dp_rank for s in result.samples]
    assert len(ranks) == 129 and ranks[-1] == "other"  # 128 ranks kept, the rest folded
    assert dict(result.rejected)["label_values_cap"] > 0


def test_vllm_parse_is_linear_in_the_ranks_when_every_rank_is_kept():
    """No cap in the way: each rank's view reads its own series, not every series on the page."""
    text = hostile.many_ranks(3200)
    expo = parse_text(text, Limits(max_ranks=10**6))
    results = []
    assert fastest(lambda: results.append(parse_families(expo, "r0", "vllm")), under_s=3.0) < 3.0
    samples = results[-1].samples
    assert len(samples) == 3200
    assert {s.requests_running for s in samples} == {
        parse_families(parse_text(hostile.vllm_page()), "r0", "vllm").samples[0].requests_running
    }


def test_20000_finished_reasons_fold_into_other_with_their_sum():
    text = hostile.many_finished_reasons(20_000)
    expo = parse_text(text)
    (sample,) = parse_families(expo, "r0", "vllm").samples
    reasons = dict(sample.finished_requests_total)
    assert len(reasons) <= 257
    (plain,) = parse_families(parse_text(hostile.vllm_page()), "r0", "vllm").samples
    real = dict(plain.finished_requests_total)
    assert sum(reasons.values()) == sum(real.values()) + 20_000  # nothing lost, just folded
    assert reasons["other"] >= 20_000 - 256
    assert expo.dropped["label_values_cap"] == 20_000 - (len(reasons) - 1 - len(real))


def test_duplicate_series_are_dropped_not_summed():
    page = hostile.vllm_page()
    line = next(x for x in page.splitlines() if x.startswith("vllm:num_requests_running{"))
    doubled = page.replace(line, f"{line}\n{line}\n{line}")
    result = parse_exposition(doubled, "r0", "vllm")
    once = parse_exposition(page, "r0", "vllm").samples[0].requests_running
    assert result.samples[0].requests_running == once
    assert dict(result.rejected)["duplicate"] == 2
    reordered = parse_text('m{a="1",b="2"} 3\nm{b="2",a="1"} 3\n')  # same series, labels reordered
    assert reordered.series("m") == [({"a": "1", "b": "2"}, 3.0)]
    assert reordered.dropped["duplicate"] == 1


def test_impossible_values_are_dropped_and_counted():
    page = hostile.vllm_page()
    preempt = next(x for x in page.splitlines() if x.startswith("vllm:num_preemptions_total{"))
    usage = next(x for x in page.splitlines() if x.startswith("vllm:kv_cache_usage_perc{"))
    bad = page.replace(preempt, preempt.rsplit(" ", 1)[0] + " -5")
    bad = bad.replace(usage, usage.rsplit(" ", 1)[0] + " +Inf")
    result = parse_exposition(bad, "r0", "vllm")
    (sample,) = result.samples
    assert sample.preemptions_total is None and sample.kv_usage_ratio is None
    assert dict(result.rejected) == {"negative_counter": 1, "not_finite": 1}


@pytest.mark.parametrize("engine", ["²", "9" * 5000, "٣", "-1", "x\x1b[2J"])
def test_an_odd_engine_label_does_not_take_the_replica_down(engine):
    result = parse_exposition(hostile.engine_label(engine), "r0", "vllm")
    assert [s.dp_rank for s in result.samples] == [terminal_safe(engine)]  # ESC as a visible escape
    assert rank_sort_key("2") < rank_sort_key("10") < rank_sort_key(terminal_safe(engine))


def test_a_page_of_unrelated_series_reads_in_linear_time():
    small, large = hostile.unrelated_series(500_000), hostile.unrelated_series(2_000_000)
    timings = []
    for text in (small, large):
        started = time.perf_counter()
        result = parse_exposition(text, "r0", "vllm")
        timings.append(time.perf_counter() - started)
        assert len(result.samples) == 1
    assert timings[1] < 10 * timings[0] + 0.2  # 4x the input: linear is ~4x, quadratic ~16x
