"""The records fuzz target (fuzz/records.py) under hypothesis, time-boxed for the normal suite.

atheris runs the same ``one_input`` with coverage guidance by hand (docs/security.md); here hypothesis
feeds it the corpus's seeds (one valid input per reader, and the hostile ones kept there) with
random bytes spliced in, and random bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.local import fuzz_target

fuzz = fuzz_target("records")

SEEDS = sorted((Path(fuzz.__file__).parent / "corpus" / "records").iterdir())


@pytest.mark.parametrize("seed", SEEDS, ids=[p.name for p in SEEDS])
def test_every_seed(seed: Path) -> None:
    fuzz.one_input(seed.read_bytes())


@st.composite
def spliced(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)).read_bytes())
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(1, len(data)))
        cut = draw(st.integers(0, 8))
        data[at : at + cut] = draw(
            st.binary(max_size=12) | st.sampled_from([b"-1", b"1e999", b"NaN", b"[", b'"', b"{}", b"null"])
        )
    return bytes(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spliced() | st.binary(max_size=256))
def test_readers_return_or_raise_their_own_error(data: bytes) -> None:
    fuzz.one_input(data)
