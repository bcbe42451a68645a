"""Strict JSON from kvwatch's records: what ``json.dumps(..., allow_nan=False)`` accepts.

Non-finite floats become the strings Prometheus writes (``"+Inf"``, ``"-Inf"``, ``"NaN"``), tuples
become lists. The status page's JSON and ``kvwatch inspect --json`` both go through ``jsonable``.
"""

from __future__ import annotations

import math
from typing import Any

NON_FINITE = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}


def jsonable(value: Any) -> Any:
    """``value`` with every non-finite float spelt as Prometheus does and every tuple as a list."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value
