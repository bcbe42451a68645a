"""Reading numbers from outsider-controlled records (OTLP span attributes, SGLang request-file lines).

One rule for both sources: a present value must be a finite, non-negative number (an integer for
counts; ``True`` is not 1); absent or null is ``None``. A bad value raises ``ValueError`` naming the
key, which each source turns into its own malformed-record error.

And one range for every count a request source takes from outside (tokens, preemptions: proxy
usage and ``max_tokens``, OTLP spans, plugin datagrams, request-file lines): at most ``MAX_COUNT``.
A larger one (``completion_tokens`` of 1 followed by 400 zeros) is no count any request has, and
Python's int would carry it into float arithmetic (TPOT, histograms) that overflows, so
``bounded_count`` drops it: the request is still recorded, that field unknown (``None``) and named
in ``RequestRecord.dropped_values``; the sink counts it in ``kvwatch_request_values_dropped_total``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvwatch.jsonsafe import finite
from kvwatch.model import MAX_COUNT

#: the counter of values dropped for being out of range (labels replica, source, reason)
VALUES_DROPPED = "kvwatch_request_values_dropped"


def out_of_range(field: str) -> str:
    """The ``reason`` label of ``kvwatch_request_values_dropped_total`` for ``field``."""
    return f"{field}_out_of_range"


def bounded_count(value: int | None, field: str, dropped: list[str]) -> int | None:
    """``value`` if it is at most MAX_COUNT; else None, with ``field`` noted in ``dropped``."""
    if value is not None and value > MAX_COUNT:
        dropped.append(field)
        return None
    return value


#: outsider free text becomes a ledger field only as a short token of this alphabet, else ``other``
SAFE_TOKEN = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")
OTHER = "other"


def safe_token(value: str) -> str:
    """Outsider text as a ledger/log field (a finish reason): itself if short and plain, else ``other``."""
    return value if SAFE_TOKEN.fullmatch(value) else OTHER


def shown(value: Any) -> str:
    """A bad value for an error message or log line: ASCII, at most ~40 characters, never the bulk."""
    text = ascii(value)
    return text if len(text) <= 40 else f"a {type(value).__name__} of {len(text)} characters"


def non_negative_number(fields: Mapping[str, Any], key: str) -> float | None:
    value = fields.get(key)
    if value is None:
        return None
    number = finite(value)
    if number is None or number < 0:
        raise ValueError(f"{key} must be a non-negative number, got {shown(value)}")
    return number


def non_negative_int(fields: Mapping[str, Any], key: str) -> int | None:
    value = fields.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {shown(value)}")
    return value
