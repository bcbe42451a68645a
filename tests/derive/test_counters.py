"""Counter increase and rate: the restart rule every derived rate uses."""

import pytest

from kvwatch.derive import counters


@pytest.mark.parametrize(
    ("previous", "current", "expected"),
    [
        (10.0, 15.0, 5.0),  # ordinary increase
        (10.0, 10.0, 0.0),  # no change
        (10.0, 3.0, 3.0),  # engine restarted: counted again from zero
        (None, 3.0, None),  # first read
        (3.0, None, None),  # counter disappeared
    ],
)
def test_increase_follows_the_prometheus_reset_rule(previous, current, expected):
    assert counters.increase(previous, current) == expected


@pytest.mark.parametrize(
    ("previous", "current", "reset"),
    [(10.0, 3.0, True), (10.0, 10.0, False), (None, 3.0, False), (3.0, None, False)],
)
def test_was_reset_only_when_the_counter_went_backwards(previous, current, reset):
    assert counters.was_reset(previous, current) is reset


@pytest.mark.parametrize(("seconds", "expected"), [(5.0, 2.0), (0.0, None), (-1.0, None)])
def test_per_second_needs_a_positive_interval(seconds, expected):
    assert counters.per_second(0.0, 10.0, seconds) == expected


@pytest.mark.parametrize(("values", "expected"), [([1.0, 2.0], 3.0), ([], 0.0), ([1.0, None], None)])
def test_total_is_unknown_when_any_part_is(values, expected):
    assert counters.total(values) == expected
