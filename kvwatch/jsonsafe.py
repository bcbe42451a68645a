"""JSON in and out, safely.

Out: strict JSON from kvwatch's records, what ``json.dumps(..., allow_nan=False)`` accepts.
Non-finite floats become the strings Prometheus writes (``"+Inf"``, ``"-Inf"``, ``"NaN"``), tuples
become lists. The status page's JSON and ``kvwatch inspect --json`` both go through ``jsonable``.

In: ``loads``, which every reader of JSON that kvwatch did not write goes through (engine pages,
watch streams, OTLP attributes, request bodies, ledgers and trace files). ``json.loads`` raises
``RecursionError``, not ``ValueError``, on arrays or objects nested deeper than the interpreter's
recursion limit: about 2 KB of ``[`` would escape every ``except ValueError`` and end a parse, a
watch or a command with a traceback. ``finite`` reads a number from outside for the same reason:
an integer too large for a float raises OverflowError.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

NON_FINITE = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}


class TooDeepError(ValueError):
    """JSON nested deeper than the interpreter's recursion limit."""


def loads(
    text: str | bytes | bytearray, *, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None
) -> Any:
    """``json.loads``, with nesting too deep to decode raised as a ``ValueError`` like any other."""
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise TooDeepError("JSON nested too deeply to decode") from None


def finite(value: object) -> float | None:
    """A number from outside (JSON, YAML) as a finite float; None for anything else: a bool, a string,
    NaN, ±Infinity (``json.loads`` reads them), or an int too large for a float. ``math.isfinite`` and
    ``float`` raise OverflowError, not ValueError, on 1 followed by 400 zeros."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def jsonable(value: Any) -> Any:
    """``value`` with every non-finite float spelt as Prometheus does and every tuple as a list."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value
