"""JSON lines as the planner's inputs hold them (ledgers, step samples): one value a line, blanks skipped."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from kvwatch.jsonsafe import loads

Line = TypeVar("Line", str, bytes)


def json_lines(lines: Iterable[Line], path: object, error: type[ValueError]) -> Iterator[tuple[str, Any]]:
    """(``"<path> line N"``, the value) of each non-blank line; a line that is not JSON raises ``error``
    naming it, so the caller's own error class reaches the user."""
    for where, value, _text in json_records(lines, path, error):
        yield where, value


def json_records(
    lines: Iterable[Line], path: object, error: type[ValueError]
) -> Iterator[tuple[str, Any, Line]]:
    """``json_lines`` with each line's text, stripped: a ledger's recorded report reads the lines a
    replay kept again, as ``kvwatch report`` reads them."""
    for number, line in enumerate(_read(lines, path, error), start=1):
        text = line.strip()
        if not text:
            continue
        where = f"{path} line {number}"
        try:
            value = loads(text)
        except ValueError as exc:
            raise error(f"{where}: not JSON ({exc})") from None
        yield where, value, text


def _read(lines: Iterable[Line], path: object, error: type[ValueError]) -> Iterator[Line]:
    """The lines; a truncated or corrupt gzip (or a failed read) raises ``error`` naming the file, in
    ``kvwatch report``'s words, not a traceback from deep in ``gzip``."""
    it = iter(lines)
    while True:
        try:
            line = next(it)
        except StopIteration:
            return
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise error(f"{path}: cannot decompress: {exc}") from None
        except OSError as exc:
            raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
        yield line
