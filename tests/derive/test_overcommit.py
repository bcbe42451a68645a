"""Over-commitment: running requests whose max_tokens could not all fit if every one ran to its limit."""

import pytest

from kvwatch.derive.overcommit import footprint, overcommitted_requests

from .factories import request


@pytest.mark.parametrize(
    ("tokens", "block_size", "slots"), [(17, 16, 32), (16, 16, 16), (0, 16, 0), (17, None, 17), (17, 1, 17)]
)
def test_footprint_rounds_up_to_whole_blocks(tokens, block_size, slots):
    assert footprint(tokens, block_size) == slots


def test_requests_beyond_the_capacity_in_admission_order_are_overcommitted():
    in_flight = [
        request(3.0, 100, max_tokens=400),  # third: 500 -> 1500 total, over 1200
        request(1.0, 100, max_tokens=400),  # first: 500
        request(2.0, 100, max_tokens=400),  # second: 1000
        request(4.0, 100, max_tokens=400),
    ]  # fourth: 2000, over
    result = overcommitted_requests(in_flight, capacity_tokens=1200)
    assert (result.requests, result.running, result.worst_case_tokens) == (2, 4, 2000.0)


def test_everything_fits_means_no_overcommitment():
    result = overcommitted_requests([request(1.0, 100, max_tokens=100)] * 3, capacity_tokens=600)
    assert result.requests == 0


def test_queued_requests_are_not_running_and_not_counted():
    in_flight = [request(float(i), 100, max_tokens=400) for i in range(4)]
    result = overcommitted_requests(in_flight, capacity_tokens=1200, running=2)
    assert (result.requests, result.running) == (0, 2)


def test_requests_without_max_tokens_add_what_they_hold_and_are_never_counted():
    in_flight = [
        request(1.0, 1000, generated=150),  # no limit: holds 1150
        request(2.0, 100, max_tokens=100),
    ]  # 1150 + 200 > 1200
    result = overcommitted_requests(in_flight, capacity_tokens=1200)
    assert (result.requests, result.worst_case_tokens) == (1, 1350.0)
    assert overcommitted_requests([request(1.0, 5000)], capacity_tokens=1200).requests == 0


def test_block_rounding_makes_small_requests_overcommit_sooner():
    in_flight = [request(1.0, 10, max_tokens=7)] * 3  # 17 tokens each: 32 slots in 16-token blocks
    assert overcommitted_requests(in_flight, capacity_tokens=64).requests == 0
    assert overcommitted_requests(in_flight, capacity_tokens=64, block_size=16).requests == 1
