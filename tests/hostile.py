"""Records from outside made hostile, one value at a time: the hypothesis strategies the property tests
of outside input share (``tests/test_outsider_records_property.py``, the SLO file's)."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

EXTREMES = [10**400, -(10**400), 2**31, 2**31 + 1, 2**63, -1, 0, 1, True, False, None, "", "1", "NaN"]

JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from(EXTREMES)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every place in a JSON value: (key or index, ...) from the root."""
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*path, index))
    return found


@st.composite
def hostile(draw: st.DrawFn, base: Any, changes: int = 3) -> Any:
    """``base`` with up to ``changes`` values replaced by any JSON, or dict keys dropped."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, changes))):
        places = [p for p in _paths(doc) if p]
        if not places:
            break
        where = draw(st.sampled_from(places))
        parent = doc
        for step in where[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and draw(st.booleans()):
            del parent[where[-1]]
        else:
            parent[where[-1]] = draw(JSON_VALUES)
    return doc
