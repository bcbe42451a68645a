"""Prometheus text exposition (format 0.0.4) -> a plain lookup structure, with line-numbered errors.

Why not ``prometheus_client.parser``: it renames what it parses (a Rust counter ``kvbm_offload_blocks_d2h``
comes back as ``..._total``; llama.cpp's ``n_tokens_max`` typed counter likewise), its errors carry no
line number, and it is about 4x slower on real engine pages (``bench/exposition_parse.py``). Engine adapters
must match the names *as exposed* (what the engines' own dashboards
query), so this parser keeps them verbatim.

Quirks of real engine pages handled here:

* ``*_created`` samples and families (prometheus_client single-process mode) are dropped.
* multiprocess mode: ``_sum``/``_count`` before buckets, HELP/TYPE with no samples, extra ``pid`` label.
* Rust exporters: counters without ``_total``, ``le="1"`` instead of ``le="1.0"`` (adapters parse ``le``
  as a float), ``le`` in any label position.
* hand-written llama.cpp TYPE lines (a gauge typed ``counter``): types are recorded, never enforced.
* ``NaN``, ``+Inf``, ``-Inf`` values; optional timestamps; ``\\r\\n`` line ends; OpenMetrics ``# EOF``.

A body that does not end with a newline was cut in the middle of a line (a scrape interrupted mid-
transfer): it raises ``ExpositionError`` rather than being served with its last sample silently
missing or, worse, a truncated number (``12`` of ``1234``) read as a value.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, KeysView
from dataclasses import dataclass, field

Labels = dict[str, str]

#: Known ``# TYPE`` words (0.0.4 plus OpenMetrics); anything else is malformed.
TYPES = frozenset({
    "counter", "gauge", "histogram", "summary", "untyped", "unknown", "info", "stateset",
    "gaugehistogram",
})

#: Suffixes a family's samples may carry on top of the family name.
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_info", "_gcount", "_gsum")

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_SAMPLE = re.compile(
    r"([a-zA-Z_:][a-zA-Z0-9_:]*)[ \t]*(?:\{(.*)\})?[ \t]*([^ \t{}]+)(?:[ \t]+(-?[0-9]+))?[ \t]*\Z"
)
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|\Z)')
_MAX_SHOWN = 80


class ExpositionError(ValueError):
    """The text is not a valid exposition; ``line`` is 1-based."""

    def __init__(self, line: int, message: str) -> None:
        self.line = line
        self.message = message
        super().__init__(f"line {line}: {message}")


@dataclass(slots=True)
class Family:
    """One metric family: declared type (``untyped`` when none) and its samples in page order."""

    name: str
    type: str = "untyped"
    samples: list[tuple[str, Labels, float]] = field(default_factory=list)


class Exposition:
    """A parsed page: families by name, and samples by their exposed name (what adapters look up)."""

    __slots__ = ("_by_name", "families", "lines")

    def __init__(self, families: dict[str, Family], lines: int) -> None:
        self.families = families
        self.lines = lines
        by_name: dict[str, list[tuple[Labels, float]]] = {}
        for fam in families.values():
            for name, labels, value in fam.samples:
                series = by_name.get(name)
                if series is None:
                    by_name[name] = [(labels, value)]
                else:
                    series.append((labels, value))
        self._by_name = by_name

    def series(self, name: str) -> list[tuple[Labels, float]]:
        """Samples exposed under exactly this name (``vllm:num_preemptions_total``); [] if none."""
        return self._by_name.get(name, [])

    def has(self, name: str) -> bool:
        return name in self._by_name

    def names(self) -> KeysView[str]:
        """Every exposed sample name on the page."""
        return self._by_name.keys()

    def has_prefix(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self._by_name)

    def type_of(self, family: str) -> str | None:
        fam = self.families.get(family)
        return fam.type if fam else None

    def __iter__(self) -> Iterator[Family]:
        return iter(self.families.values())

    def __len__(self) -> int:
        return len(self.families)


def _shown(text: str) -> str:
    return repr(text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "...")


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    out, i = [], 0
    while i < len(value):
        ch = value[i]
        if ch == "\\" and i + 1 < len(value):
            nxt = value[i + 1]
            out.append({"n": "\n", "\\": "\\", '"': '"'}.get(nxt, "\\" + nxt))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _labels(text: str, lineno: int, line: str) -> Labels:
    labels: Labels = {}
    pos, end = 0, len(text)
    while pos < end:
        m = _LABEL.match(text, pos)
        if m is None:
            if not text[pos:].strip():
                break
            raise ExpositionError(lineno, f"malformed label set in {_shown(line)}")
        labels[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return labels


def _family_of(name: str, families: dict[str, Family]) -> str:
    if name in families:
        return name
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if base in families:
                return base
    return name


def parse_text(text: str) -> Exposition:
    """Parse an exposition; raise ``ExpositionError`` (with line number) on anything malformed."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    elif lines:
        last = lines[-1].strip()
        if last and last != "# EOF":
            raise ExpositionError(
                len(lines),
                f"body ends without a newline inside {_shown(lines[-1])}: the scrape was truncated",
            )
    families: dict[str, Family] = {}
    family_of: dict[str, Family] = {}  # sample name -> family (cache)
    for lineno, raw in enumerate(lines, 1):
        line = raw[:-1] if raw.endswith("\r") else raw
        if not line or line.isspace():
            continue
        if line[0] == "#":
            _comment(line, lineno, families)
            continue
        m = _SAMPLE.match(line.strip())
        if m is None:
            raise ExpositionError(lineno, f"not a sample line: {_shown(line)}")
        name, label_text, value_text = m.group(1), m.group(2), m.group(3)
        try:
            value = float(value_text)
        except ValueError:
            raise ExpositionError(lineno, f"value {value_text!r} is not a number in {_shown(line)}") from None
        if name.endswith("_created"):
            continue
        labels = _labels(label_text, lineno, line) if label_text else {}
        fam = family_of.get(name)
        if fam is None:
            fam_name = _family_of(name, families)
            fam = families.get(fam_name)
            if fam is None:
                fam = families[fam_name] = Family(fam_name)
            family_of[name] = fam
        fam.samples.append((name, labels, value))
    return Exposition(families, len(lines))


def _comment(line: str, lineno: int, families: dict[str, Family]) -> None:
    parts = line.split(None, 3)
    if len(parts) < 2 or parts[1] not in ("HELP", "TYPE"):
        return  # plain comment, or OpenMetrics "# EOF"
    if len(parts) < 3:
        raise ExpositionError(lineno, f"{parts[1]} without a metric name: {_shown(line)}")
    name = parts[2]
    if not _NAME.match(name):
        raise ExpositionError(lineno, f"invalid metric name {name!r} in {parts[1]} line")
    if name.endswith("_created"):
        return
    fam = families.get(name)
    if parts[1] == "HELP":
        if fam is None:
            families[name] = Family(name)
        return
    kind = parts[3].strip().lower() if len(parts) > 3 else ""
    if kind not in TYPES:
        raise ExpositionError(lineno, f"unknown metric type {kind!r} for {name} (expected one of "
                                      f"{', '.join(sorted(TYPES))})")
    if fam is None:
        families[name] = Family(name, kind)
    else:
        fam.type = kind
