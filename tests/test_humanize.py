"""The number formats every view shares: a unit boundary never prints as ``1e+03k``."""

from __future__ import annotations

import math
import random
import re

import pytest

from kvwatch import humanize as h

FIGURE = re.compile(r"^-?\d+(\.\d+)?")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (999_600, "1M"),  # rounds to 1000k: one unit up
        (999.7, "1k"),
        (950, "950"),
        (12_345, "12.3k"),
        (1.34e12, "1.34T"),
        (0.5, "0.5"),
        (-1_200, "-1.2k"),
    ],
)
def test_si_moves_up_a_unit_where_rounding_reaches_1000(value: float, text: str) -> None:
    assert h.si(value) == text


def test_si_with_two_digits_shows_a_whole_part_whole() -> None:
    # a preemption rate of 150/s read "1.5e+02" with two significant digits
    assert h.si(150, 2) == "150"
    assert h.si(99.7, 2) == "100"
    assert h.si(12_345, 2) == "12k"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.9996, "1s"),  # not "1e+03ms"
        (0.000_999_6, "1ms"),  # not "1000us"
        (999.7, "17m"),  # not "1e+03s"
        (0.85, "850ms"),
        (12.5, "12.5s"),
        (450, "450s"),
        (9_000, "2.5h"),
        (0.000_123_4, "123us"),
    ],
)
def test_seconds_at_unit_boundaries(value: float, text: str) -> None:
    assert h.seconds(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1023.7 * 2**30, "1TiB"),  # not "1.02e+03GiB"
        (1000 * 2**30, "0.977TiB"),  # 1,000-1,023 of a unit read in the next
        (80 * 2**30, "80GiB"),
        (900, "900B"),
        (1024, "1KiB"),
    ],
)
def test_nbytes_at_unit_boundaries(value: float, text: str) -> None:
    assert h.nbytes(value) == text


def test_no_format_prints_an_exponent_or_a_four_digit_figure() -> None:
    rng = random.Random(7)
    for _ in range(20_000):
        value = 10 ** rng.uniform(-5, 14) * rng.choice((1, -1))
        for text in (h.si(value), h.si(value, 2), h.nbytes(value)):
            figure = FIGURE.match(text)  # no unit suffix holds an "e"
            assert "e" not in text and figure is not None and abs(float(figure.group())) < 1000, (value, text)
        if abs(value) < 7200:
            assert "e" not in h.seconds(value), value


def test_unknown_values_read_as_missing() -> None:
    for fmt in (h.si, h.seconds, h.nbytes, h.ratio, h.count):
        assert fmt(None) == h.MISSING
        assert fmt(math.nan) == h.MISSING
