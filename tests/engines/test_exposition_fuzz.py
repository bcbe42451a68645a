"""The exposition fuzz target (fuzz/exposition.py) under hypothesis, time-boxed for the normal suite.

atheris runs the same ``one_input`` with coverage guidance by hand (docs/security.md); here
hypothesis feeds it pages built from the grammar's pieces, and random bytes.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.local import fuzz_target

fuzz = fuzz_target("exposition")

PIECES = [
    "vllm:x",
    "m_total",
    "h_bucket",
    "{",
    "}",
    'a="1"',
    'engine="',
    '"',
    ",",
    "=",
    " ",
    "\t",
    "1",
    "-5",
    "NaN",
    "+Inf",
    "1e3",
    "\\",
    "\\n",
    "\n",
    "\r\n",
    "# TYPE m counter\n",
    "# HELP m x\n",
    "# EOF",
    "_created",
    "other",
    "²",
    "\x1b",
    "\x07",
    "\u202e",
    "\x00",
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(PIECES), max_size=80).map("".join))
def test_grammar_pieces_parse_the_same_in_any_slices(text):
    fuzz.one_input(text.encode())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_parse_or_refuse(data):
    fuzz.one_input(data)


CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus" / "exposition"


def test_the_hostile_seeds_in_the_corpus_hold_the_invariants():
    seeds = sorted(CORPUS.iterdir())
    hostile = {"label-value-esc-bel", "label-value-escaped-newline", "absurd-counter-value"}
    assert hostile <= {s.name for s in seeds}
    for seed in seeds:
        fuzz.one_input(seed.read_bytes())
