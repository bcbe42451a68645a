"""Fuzz target for the engine-page parser (``kvwatch/engines/exposition_parser.py``).

Invariants, for any bytes an engine could serve:

- ``parse_text`` returns an ``Exposition`` or raises ``ExpositionError``; nothing else escapes;
- the slice size changes nothing: parsing in 64-character slices gives the same series (or the same
  refusal) as in one go;
- time is linear: a hang or a slow input is a finding (run atheris with ``-timeout=2``);
- every label value read is printable: an engine's ESC, BEL or bidi override comes out as a visible
  escape (``kvwatch/safetext.py``), never raw, since label values reach /metrics and terminals.

Run by hand, with coverage guidance::

    .venv/bin/pip install atheris
    cp tests/fixtures/engines/*.prom fuzz/corpus/exposition/   # next to the hostile seeds kept there
    .venv/bin/python fuzz/exposition.py -timeout=2 -max_total_time=600 fuzz/corpus/exposition

The normal test suite runs the same ``one_input`` under hypothesis for a few seconds
(``tests/engines/test_exposition_fuzz.py``).
"""

from __future__ import annotations

from kvwatch.cooperative import run_now
from kvwatch.engines.exposition_parser import ExpositionError, Limits, parse_steps, parse_text

SMALL = Limits(max_line_length=512, max_series=200, max_label_values=4, max_ranks=3)


def _outcome(text: str, slice_chars: int | None) -> object:
    try:
        if slice_chars is None:
            expo = parse_text(text, SMALL)
        else:
            expo = run_now(parse_steps(text, SMALL, slice_chars))
    except ExpositionError as exc:
        return ("error", exc.line)
    for name in expo.names():
        for labels, _ in expo.series(name):
            assert all(value.isprintable() for value in labels.values()), labels
    return sorted((name, sorted(map(repr, expo.series(name)))) for name in expo.names())


def one_input(data: bytes) -> None:
    text = data.decode("utf-8", errors="replace")
    assert _outcome(text, None) == _outcome(text, 64)


if __name__ == "__main__":
    from atheris_main import fuzz  # fuzz/ is the script's folder, so it is on sys.path

    fuzz(one_input)
