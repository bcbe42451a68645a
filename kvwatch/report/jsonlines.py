"""Selected fields of flat JSON-lines records, as columns, fast.

A million ledger lines must be read in seconds, and ``json.loads`` per line is the slow part
(about 7 µs a ledger line here). So each chunk is matched against one regular expression built
from the key order and value types of the chunk's first line. It accepts only a well-formed line
of that shape: every field the report uses is validated (JSON number, string without escapes,
boolean, required, allowed values) and captured; fields it does not use must be a JSON scalar or a
flat array of the same type as in the first line. When every line of the chunk matches, the
captures are joined into a CSV blob that pandas' C parser turns into typed columns (``"`` is the
separator: a captured value never contains one). Any other line (malformed, another key order,
escaped strings, nested objects) goes through ``json.loads`` and the same checks field by field,
so a record's values never depend on which path read it.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvwatch.jsonsafe import finite, loads

if TYPE_CHECKING:
    import pandas as pd

#: a finite number >= 0 (every number of a ledger or trace line is a count, a time or a duration):
#: anything else a line holds there (negative, NaN, ±Infinity, too large for a float) is null
NUM = "num"
STR = "str"
BOOL = "bool"

_NUMBER = rb"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?"
_TEXT = rb'[^"\\\x00-\x1f]'  # a string character that needs no escape
#: a value of a field the report does not use: any JSON scalar or flat array
_SKIP_VALUE = rb"(?:null|" + _NUMBER + rb'|"' + _TEXT + rb'*"|true|false|\[[^\[\]{}\n]*\])'
_KEY_OK = re.compile(r'^[^"\\\x00-\x1f]+$')
_SEP = b'"'
_BOOL_VALUES = {"true": 1.0, True: 1.0, "false": 0.0, False: 0.0}
MAX_EXAMPLES = 5

Compiled = tuple[re.Pattern[bytes], tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class Field:
    """One field to extract. ``required``: a record without it is malformed; ``choices``: allowed values."""

    name: str
    kind: str  # NUM | STR | BOOL
    required: bool = False
    choices: tuple[str, ...] = ()


@dataclass(slots=True)
class Problems:
    """Malformed lines: how many, why, and where the first few are (never their content)."""

    total: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    #: (file, line number or None, reason) of the first few
    examples: list[tuple[str, int | None, str]] = field(default_factory=list)

    def add(self, where: str, line_no: int | None, reason: str) -> None:
        self.total += 1
        self.reasons[reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append((where, line_no, reason))

    def add_count(self, where: str, reason: str, count: int) -> None:
        """``count`` bad rows of one file whose line numbers are not known (CSV rows)."""
        if count <= 0:
            return
        self.total += count
        self.reasons[reason] += count
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append((where, None, f"{count} row(s): {reason}"))

    def merge(self, other: Problems, line_offset: int = 0) -> None:
        """Fold in a later part of the input whose line numbers start ``line_offset`` lines later."""
        self.total += other.total
        self.reasons.update(other.reasons)
        for where, line_no, reason in other.examples:
            if len(self.examples) < MAX_EXAMPLES:
                self.examples.append((where, None if line_no is None else line_no + line_offset, reason))

    def example_lines(self) -> list[str]:
        return [
            f"{where}:{line_no}: {reason}" if line_no is not None else f"{where}: {reason}"
            for where, line_no, reason in self.examples
        ]


class _InvalidLineError(Exception):
    pass


class JsonLinesColumns:
    """Accumulate ``fields`` of every valid line; ``literals`` are keys that must hold a fixed value."""

    def __init__(
        self,
        fields: Sequence[Field],
        literals: dict[str, int] | None = None,
        problems: Problems | None = None,
    ) -> None:
        self.fields = tuple(fields)
        self.literals = dict(literals or {})
        self.problems = problems if problems is not None else Problems()
        self.records = 0
        self.fast_lines = 0
        self._by_name = {f.name: f for f in self.fields}
        self._blobs: dict[tuple[str, ...], list[bytes]] = {}
        self._slow: dict[str, list[Any]] = {f.name: [] for f in self.fields}
        self._patterns: dict[tuple[str, ...], Compiled | None] = {}

    # -- fast path ------------------------------------------------------------------------------
    @staticmethod
    def _value_pattern(f: Field) -> bytes:
        """Pattern of one used field's value with exactly one group (empty when null)."""
        if f.choices:
            value = rb'"(' + b"|".join(re.escape(c.encode()) for c in f.choices) + rb')"'
        elif f.kind == NUM:
            value = rb"(" + _NUMBER + rb")"
        elif f.kind == BOOL:
            value = rb"(true|false)"
        else:
            value = rb'"(' + _TEXT + rb'+)"'
        return value if f.required else rb"(?:" + value + rb"|null)"

    def _pattern_for(self, keys: tuple[str, ...]) -> Compiled | None:
        if keys in self._patterns:
            return self._patterns[keys]
        built: Compiled | None = None
        usable = (
            len(set(keys)) == len(keys)
            and all(_KEY_OK.match(k) for k in keys)
            and all(f.name in keys for f in self.fields if f.required)
            and all(k in keys for k in self.literals)
        )
        if usable:
            parts, captured = [], []
            for key in keys:
                head = re.escape(b'"' + key.encode() + b'":') + rb" ?"
                if key in self.literals:
                    parts.append(head + re.escape(str(self.literals[key]).encode()))
                elif key in self._by_name:
                    parts.append(head + self._value_pattern(self._by_name[key]))
                    captured.append(key)
                else:
                    parts.append(head + _SKIP_VALUE)
            regex = rb"^\{" + rb", ?".join(parts) + rb"\}\r?$"
            built = (re.compile(regex, re.MULTILINE), tuple(captured))
        self._patterns[keys] = built
        return built

    @staticmethod
    def _keys_of(line: bytes) -> tuple[str, ...] | None:
        """Key order of one line, or None when it is not a JSON object."""
        try:
            pairs = loads(line, object_pairs_hook=list)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(pairs, list) or not all(isinstance(p, tuple) for p in pairs):
            return None
        return tuple(k for k, _ in pairs)

    # -- chunks ---------------------------------------------------------------------------------
    def add_chunk(self, chunk: bytes, where: str, first_line_no: int) -> None:
        """Read one chunk of whole lines (ending in ``\\n``); line numbers start at ``first_line_no``."""
        keys = self._keys_of(chunk[: chunk.find(b"\n")])
        compiled = self._pattern_for(keys) if keys else None
        if compiled is not None:
            pattern, captured = compiled
            rows = pattern.findall(chunk)
            if len(rows) == chunk.count(b"\n"):
                self._take_rows(captured, rows)
                return
        self._take_lines(chunk, where, first_line_no, compiled)

    def _take_rows(self, captured: tuple[str, ...], rows: list[Any]) -> None:
        """Captures of fully matched lines, kept as a CSV blob for pandas' parser."""
        if rows:
            joined = b"\n".join(rows) if len(captured) == 1 else b"\n".join(map(_SEP.join, rows))
            self._blobs.setdefault(captured, []).append(joined)
        self.records += len(rows)
        self.fast_lines += len(rows)

    def _take_lines(self, chunk: bytes, where: str, first_line_no: int, compiled: Compiled | None) -> None:
        """A chunk with some line the pattern did not match: line by line, json.loads only where needed."""
        matched: list[Any] = []
        for offset, raw in enumerate(chunk.split(b"\n")[:-1]):
            line = raw.rstrip(b"\r")
            if compiled is not None:
                m = compiled[0].fullmatch(line)
                if m:
                    matched.append(m.groups(b"") if len(compiled[1]) > 1 else (m.group(1) or b""))
                    continue
            if not line.strip():
                continue
            try:
                record = self._parse_line(line)
            except _InvalidLineError as exc:
                self.problems.add(where, first_line_no + offset, str(exc))
                continue
            for f in self.fields:
                self._slow[f.name].append(record[f.name])
            self.records += 1
        if compiled is not None:
            self._take_rows(compiled[1], matched)

    def _parse_line(self, line: bytes) -> dict[str, Any]:
        try:
            obj = loads(line)
        except (ValueError, UnicodeDecodeError):
            raise _InvalidLineError("not JSON") from None
        if not isinstance(obj, dict):
            raise _InvalidLineError("not a JSON object")
        for key, expected in self.literals.items():
            if obj.get(key) != expected or isinstance(obj.get(key), bool):
                raise _InvalidLineError(f"{key} is {obj.get(key)!r}, expected {expected}")
        return {f.name: _checked(f, obj.get(f.name)) for f in self.fields}

    # -- result ---------------------------------------------------------------------------------
    def frame(self) -> pd.DataFrame:
        """One column per field: NUM float64 and BOOL float (1/0, NaN = null); STR categorical."""
        parts = [self._read_blobs(captured, blobs) for captured, blobs in self._blobs.items()]
        if any(self._slow.values()) or not parts:
            parts.append(self._slow_frame())
        return concat_frames(parts, self.fields)

    def _read_blobs(self, captured: tuple[str, ...], blobs: list[bytes]) -> pd.DataFrame:
        import pandas as pd

        dtypes = {name: "float64" if self._by_name[name].kind == NUM else "category" for name in captured}
        df = pd.read_csv(
            io.BytesIO(b"\n".join(blobs)),
            sep=_SEP.decode(),
            header=None,
            names=captured,
            dtype=dtypes,
            quoting=csv.QUOTE_NONE,
            na_values=[""],
            keep_default_na=False,
            skip_blank_lines=False,
            engine="c",
        )
        for f in self.fields:
            if f.name not in df.columns:
                df[f.name] = float("nan") if f.kind != STR else pd.Categorical([None] * len(df))
            elif f.kind == BOOL:
                # the C parser may already have read the category values as booleans
                df[f.name] = df[f.name].map(_BOOL_VALUES).astype(float)
            elif f.kind == NUM:
                df[f.name] = df[f.name].where((df[f.name] >= 0) & (df[f.name] != math.inf))
        return df[[f.name for f in self.fields]]

    def _slow_frame(self) -> pd.DataFrame:
        import pandas as pd

        data: dict[str, Any] = {}
        for f in self.fields:
            values = self._slow[f.name]
            if f.kind == STR:
                data[f.name] = pd.Categorical(values)
            else:
                data[f.name] = pd.array(
                    [math.nan if v is None else float(v) for v in values], dtype="float64"
                )
        return pd.DataFrame(data)


def _checked(f: Field, value: Any) -> Any:
    """A JSON value of field ``f`` after the same checks the fast pattern makes."""
    if value is None or (f.kind == STR and value == ""):
        if f.required:
            raise _InvalidLineError(f"missing {f.name}")
        return None
    if f.kind == NUM:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _InvalidLineError(f"{f.name} is not a number")
        number = finite(value)
        return number if number is not None and number >= 0 else None
    if f.kind == BOOL:
        if not isinstance(value, bool):
            raise _InvalidLineError(f"{f.name} is not true or false")
        return value
    if not isinstance(value, str):
        raise _InvalidLineError(f"{f.name} is not a string")
    if f.choices and value not in f.choices:
        raise _InvalidLineError(f"{f.name} {value!r} is not one of {', '.join(f.choices)}")
    return value


def concat_frames(parts: list[pd.DataFrame], fields: tuple[Field, ...]) -> pd.DataFrame:
    """Stack parts; string columns stay categorical (with the union of categories).

    A part without rows (a piece of the input holding only malformed lines) is left out: its empty
    categories have another dtype than those of parts with strings, which ``union_categoricals``
    refuses.
    """
    import pandas as pd
    from pandas.api.types import union_categoricals

    parts = [p for p in parts if len(p)] or parts[:1]
    if len(parts) == 1:
        return parts[0].reset_index(drop=True)
    out = pd.concat(parts, ignore_index=True)
    for f in fields:
        if f.kind == STR:
            out[f.name] = union_categoricals([pd.Categorical(p[f.name]) for p in parts])
    return out
