"""Reading numbers from outsider-controlled records (OTLP span attributes, SGLang request-file lines).

One rule for both sources: a present value must be a finite, non-negative number (an integer for
counts; ``True`` is not 1); absent or null is ``None``. A bad value raises ``ValueError`` naming the
key, which each source turns into its own malformed-record error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def shown(value: Any) -> str:
    """A bad value for an error message or log line: ASCII, at most ~40 characters, never the bulk."""
    text = ascii(value)
    return text if len(text) <= 40 else f"a {type(value).__name__} of {len(text)} characters"


def non_negative_number(fields: Mapping[str, Any], key: str) -> float | None:
    value = fields.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key} must be a non-negative number, got {shown(value)}")
    return float(value)


def non_negative_int(fields: Mapping[str, Any], key: str) -> int | None:
    value = fields.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {shown(value)}")
    return value
