"""Theoretical PCIe link bandwidth per generation and width (formula in kvwatch/derive/pcie.py)."""

from __future__ import annotations

import pytest

from kvwatch.derive.pcie import link_bytes_per_second


@pytest.mark.parametrize(
    ("gen", "width", "bytes_per_second"),
    [
        (1, 1, 250e6),  # 2.5 GT/s, 8b/10b
        (2, 1, 500e6),  # 5 GT/s, 8b/10b
        (3, 1, 8e9 * 128 / 130 / 8),  # ~984.6 MB/s
        (4, 1, 16e9 * 128 / 130 / 8),  # ~1969.2 MB/s
        (5, 1, 32e9 * 128 / 130 / 8),  # ~3938.5 MB/s
        (6, 1, 7562.5e6),  # 64 GT/s PAM4, FLIT: 242 of 256 bytes carry TLP/DLP
        (5, 16, 63.015e9),  # H200 SXM as trained at full speed
        (5, 8, 31.508e9),  # the same GPU down-trained to x8: half
        (1, 16, 4e9),  # idle power-saving Gen1
        (4, 16, 31.508e9),
    ],
)
def test_link_bandwidth(gen: int, width: int, bytes_per_second: float):
    assert link_bytes_per_second(gen, width) == pytest.approx(bytes_per_second, rel=1e-4)


@pytest.mark.parametrize(("gen", "width"), [(None, 16), (5, None), (7, 16), (0, 16), (5, 0)])
def test_unknown_link_has_no_bandwidth(gen, width):
    assert link_bytes_per_second(gen, width) is None


def test_each_generation_doubles_from_gen3_on_and_gen6_pays_for_flit():
    rates = [link_bytes_per_second(g, 1) for g in range(1, 7)]
    assert rates[3] == pytest.approx(2 * rates[2]) and rates[4] == pytest.approx(2 * rates[3])
    assert rates[4] * 2 * 242 / 256 / (128 / 130) == pytest.approx(rates[5])
