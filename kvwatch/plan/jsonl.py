"""JSON lines as the planner's inputs hold them (ledgers, step samples): one value a line, blanks skipped."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from kvwatch.jsonsafe import loads


def json_lines(
    lines: Iterable[str | bytes], path: object, error: type[ValueError]
) -> Iterator[tuple[str, Any]]:
    """(``"<path> line N"``, the value) of each non-blank line; a line that is not JSON raises ``error``
    naming it, so the caller's own error class reaches the user."""
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text:
            continue
        where = f"{path} line {number}"
        try:
            value = loads(text)
        except ValueError as exc:
            raise error(f"{where}: not JSON ({exc})") from None
        yield where, value
