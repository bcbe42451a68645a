"""Per-band service health: completion, truncation and abandonment ratios."""

import pytest

from kvwatch.derive.band_health import band_health, outcome_increase


def key(band, outcome, replica="r0", model="m", source="proxy"):
    return (replica, model, band, source, outcome)


def test_ratios_are_over_every_finished_request_of_the_band():
    counts = {
        key("20k+", "completed"): 6,
        key("20k+", "truncated"): 2,
        key("20k+", "aborted"): 1,
        key("20k+", "error"): 1,
        key("0-1k", "completed"): 5,
    }
    health = band_health(counts)
    long = health[("m", "20k+")]
    ratios = (long.completed_ratio, long.truncated_ratio, long.aborted_ratio)
    assert (long.finished, ratios) == (10, (0.6, 0.2, 0.1))
    assert health[("m", "0-1k")].completed_ratio == 1.0


def test_default_grouping_sums_replicas_and_sources():
    counts = {
        key("1k-5k", "completed", replica="r0"): 1,
        key("1k-5k", "aborted", replica="r1", source="otlp"): 1,
    }
    assert band_health(counts)[("m", "1k-5k")].aborted_ratio == 0.5


def test_grouping_by_replica_keeps_them_apart():
    counts = {key("1k-5k", "completed", replica="r0"): 1, key("1k-5k", "aborted", replica="r1"): 1}
    health = band_health(counts, group_by=("replica", "length_band"))
    assert health[("r0", "1k-5k")].aborted_ratio == 0.0
    assert health[("r1", "1k-5k")].aborted_ratio == 1.0


def test_empty_band_has_no_ratio():
    assert band_health({key("0-1k", "completed"): 0})[("m", "0-1k")].completed_ratio is None


def test_unknown_group_label_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot group by \\['outcome'\\]"):
        band_health({}, group_by=("outcome",))


def test_window_counts_are_increases_with_resets_handled():
    now = {key("0-1k", "completed"): 10, key("0-1k", "aborted"): 1, key("1k-5k", "completed"): 2}
    earlier = {key("0-1k", "completed"): 4, key("0-1k", "aborted"): 3}
    assert outcome_increase(now, earlier) == {
        key("0-1k", "completed"): 6,
        key("0-1k", "aborted"): 1,
        key("1k-5k", "completed"): 2,
    }


def test_band_outcomes_take_the_proxy_view_where_a_proxy_saw_the_replica():
    from kvwatch.derive.band_health import band_outcomes

    counts = {
        key("0-1k", "completed"): 3,
        key("0-1k", "aborted"): 1,
        key("0-1k", "completed", source="otlp"): 4,  # the same requests seen engine-side
        key("0-1k", "completed", replica="r1", source="otlp"): 2,
        key("0-1k", "error", replica="r1", source="sglang_files"): 2,
    }
    bands = band_outcomes(counts)
    assert bands[("r0", "0-1k")].counts == {"completed": 3, "aborted": 1}
    assert bands[("r1", "0-1k")].counts == {"completed": 2, "error": 2}  # no proxy: every engine source
    every = bands[(None, "0-1k")]
    assert every.counts == {"completed": 5, "aborted": 1, "error": 2}
    assert (every.health.completed_ratio, every.health.aborted_ratio) == (5 / 8, 1 / 8)
