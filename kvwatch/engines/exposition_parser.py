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
* optional timestamps; ``\\r\\n`` line ends; OpenMetrics ``# EOF``.

A body that does not end with a newline was cut in the middle of a line (a scrape interrupted mid-
transfer): it raises ``ExpositionError`` rather than being served with its last sample silently
missing or, worse, a truncated number (``12`` of ``1234``) read as a value.

The page is written by the engine, so it is parsed as hostile input (``Limits``):

* time linear in the input: every pattern below uses possessive quantifiers only, and each one is
  tried at most once per position, so nothing backtracks (a lone quadratic regex once let a
  40,000-character line block the agent for 30 s);
* a line longer than ``max_line_length`` is malformed; more than ``max_series`` series is too large
  (what Prometheus calls ``sample_limit``: it bounds the time and memory of one page);
* a label with more than ``max_label_values`` distinct values on the page (``rank_labels``: more
  than ``max_ranks``) has the excess folded into the value ``other``, their values summed;
* a sample that cannot be true is dropped: ±Inf or NaN, a negative counter, and a second copy of a
  series already read (never summed into the first). ``Exposition.dropped`` counts all of these
  by reason (the reasons are ``catalog.REJECTED_SAMPLE_REASONS``);
* ``parse_steps`` parses in slices of about ``slice_chars`` and yields between them, so a caller on
  an event loop can let other work run (``kvwatch.cooperative``).
"""

from __future__ import annotations

import gc
import math
import re
from collections import Counter
from collections.abc import Generator, Iterator, KeysView
from dataclasses import dataclass, field

from kvwatch.cooperative import run_now
from kvwatch.safetext import terminal_safe

Labels = dict[str, str]

#: Known ``# TYPE`` words (0.0.4 plus OpenMetrics); anything else is malformed.
TYPES = frozenset(
    {
        "counter",
        "gauge",
        "histogram",
        "summary",
        "untyped",
        "unknown",
        "info",
        "stateset",
        "gaugehistogram",
    }
)

#: Suffixes a family's samples may carry on top of the family name.
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_info", "_gcount", "_gsum")
#: Sample names that are cumulative whatever the TYPE line says: they cannot be negative.
_CUMULATIVE_SUFFIXES = ("_total", "_count", "_bucket")

#: the value excess label values are folded into
OTHER = "other"

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*+\Z")
_NAME_AT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*+")
_LABEL_PAIR = re.compile(
    r'[ \t]*+([a-zA-Z_][a-zA-Z0-9_]*+)[ \t]*+=[ \t]*+"([^"\\]*+(?:\\.[^"\\]*+)*+)"[ \t]*+([,}])'
)
_LABELS_END = re.compile(r"[ \t]*+}")
_SEPARATOR = re.compile(r"[_:]")
_MAX_SHOWN = 80
_INF = math.inf


@dataclass(frozen=True, slots=True)
class Limits:
    """What one engine page may hold; see the module docstring (config keys under ``scrape``)."""

    max_line_length: int = 16 * 1024
    max_series: int = 100_000
    max_label_values: int = 256
    max_ranks: int = 128
    rank_labels: frozenset[str] = frozenset({"engine", "dp_rank"})


DEFAULT_LIMITS = Limits()


class ExpositionError(ValueError):
    """The text is not a valid exposition; ``line`` is 1-based."""

    def __init__(self, line: int, message: str) -> None:
        self.line = line
        self.message = message
        super().__init__(f"line {line}: {message}")


class TooManySeriesError(ExpositionError):
    """The page holds more series than ``Limits.max_series`` (Prometheus's ``sample_limit``)."""


@dataclass(slots=True)
class Family:
    """One metric family: declared type (``untyped`` when none) and its samples in page order."""

    name: str
    type: str = "untyped"
    samples: list[tuple[str, Labels, float]] = field(default_factory=list)


class Exposition:
    """A parsed page: families by name, and samples by their exposed name (what adapters look up)."""

    __slots__ = ("_by_name", "_groups", "_prefixes", "dropped", "families", "lines")

    def __init__(
        self,
        families: dict[str, Family],
        lines: int,
        by_name: dict[str, list[tuple[Labels, float]]] | None = None,
        dropped: Counter[str] | None = None,
        prefixes: set[str] | None = None,
    ) -> None:
        self.families = families
        self.lines = lines
        self.dropped: Counter[str] = dropped if dropped is not None else Counter()
        if by_name is None:
            by_name = {}
            for fam in families.values():
                for name, labels, value in fam.samples:
                    by_name.setdefault(name, []).append((labels, value))
        self._by_name = by_name
        self._groups: dict[tuple[str, tuple[str, ...]], dict[tuple[str | None, ...], list[int]]] = {}
        self._prefixes: set[str] | None = prefixes

    def series(self, name: str) -> list[tuple[Labels, float]]:
        """Samples exposed under exactly this name (``vllm:num_preemptions_total``); [] if none."""
        return self._by_name.get(name, [])

    def grouped(self, name: str, keys: tuple[str, ...]) -> dict[tuple[str | None, ...], list[int]]:
        """Positions in ``series(name)`` grouped by the values of ``keys`` (None: label absent).

        Built once per (name, keys), so reading one rank's series costs that rank's series, not the
        page's: a page of thousands of ranks stays linear.
        """
        index = self._groups.get((name, keys))
        if index is None:
            index = {}
            for pos, (labels, _) in enumerate(self.series(name)):
                index.setdefault(tuple(labels.get(k) for k in keys), []).append(pos)
            self._groups[(name, keys)] = index
        return index

    def has(self, name: str) -> bool:
        return name in self._by_name

    def names(self) -> KeysView[str]:
        """Every exposed sample name on the page."""
        return self._by_name.keys()

    def has_prefix(self, prefix: str) -> bool:
        """Any sample name starting with ``prefix``; O(1) for prefixes ending in ``_`` or ``:``."""
        if prefix[-1:] in ("_", ":"):
            if self._prefixes is None:
                self._prefixes = set()
                for name in self._by_name:
                    _add_prefixes(name, self._prefixes)
            return prefix in self._prefixes
        return any(n.startswith(prefix) for n in self._by_name)

    def type_of(self, family: str) -> str | None:
        fam = self.families.get(family)
        return fam.type if fam else None

    def __iter__(self) -> Iterator[Family]:
        return iter(self.families.values())

    def __len__(self) -> int:
        return len(self.families)


def _add_prefixes(name: str, prefixes: set[str]) -> None:
    """Every prefix of ``name`` that ends at a ``_`` or ``:`` (what ``has_prefix`` looks up)."""
    for m in _SEPARATOR.finditer(name):
        prefixes.add(name[: m.end()])


def _shown(text: str) -> str:
    return repr(text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "...")


_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    out, i = [], 0
    while i < len(value):
        ch = value[i]
        if ch == "\\" and i + 1 < len(value):
            nxt = value[i + 1]
            out.append(_ESCAPES.get(nxt, "\\" + nxt))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _labels(line: str, pos: int, lineno: int) -> tuple[Labels, int]:
    """The label set starting just after ``{`` at ``pos``; returns it and the position after ``}``."""
    labels: Labels = {}
    while True:
        m = _LABEL_PAIR.match(line, pos)
        if m is None:
            end = _LABELS_END.match(line, pos)
            if end is None:
                raise ExpositionError(lineno, f"malformed label set in {_shown(line)}")
            return labels, end.end()
        labels[m[1]] = terminal_safe(_unescape(m[2]))  # an engine's ESC or BEL never reaches /metrics
        pos = m.end()
        if m[3] == "}":
            return labels, pos


def _value(rest: str, lineno: int, line: str) -> float:
    """The value (and optional integer timestamp) after the name and labels."""
    parts = rest.split()
    if not parts or len(parts) > 2 or "{" in rest or "}" in rest:
        raise ExpositionError(lineno, f"not a sample line: {_shown(line)}")
    text = parts[0]
    if len(parts) == 2:
        stamp = parts[1][1:] if parts[1][:1] == "-" else parts[1]
        if not (stamp.isascii() and stamp.isdigit()):
            raise ExpositionError(lineno, f"not a sample line: {_shown(line)}")
    try:
        if "_" in text:
            raise ValueError(text)
        return float(text)
    except ValueError:
        raise ExpositionError(lineno, f"value {_shown(text)} is not a number in {_shown(line)}") from None


def _family_of(name: str, families: dict[str, Family]) -> str:
    if name in families:
        return name
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if base in families:
                return base
    return name


def _check_ending(text: str) -> None:
    """A body must end with a newline, unless its last line is blank or OpenMetrics ``# EOF``."""
    if not text or text.endswith("\n"):
        return
    cut = text.rfind("\n")
    last = text[cut + 1 :]
    if last.strip() and last.strip() != "# EOF":
        raise ExpositionError(
            text.count("\n") + 1,
            f"body ends without a newline inside {_shown(last)}: the scrape was truncated",
        )


class _Folder:
    """Distinct values seen per label name on this page; excess values become ``other``."""

    __slots__ = ("caps", "default_cap", "seen")

    def __init__(self, limits: Limits) -> None:
        self.default_cap = limits.max_label_values
        self.caps = dict.fromkeys(limits.rank_labels, limits.max_ranks)
        self.seen: dict[str, set[str]] = {}

    def fold(self, labels: Labels) -> bool:
        """Fold over-cap values in place; True when one was folded."""
        folded = False
        for key, value in labels.items():
            seen = self.seen.get(key)
            if seen is None:
                seen = self.seen[key] = set()
            if value in seen:
                continue
            if len(seen) < self.caps.get(key, self.default_cap):
                seen.add(value)
            elif value != OTHER:
                labels[key] = OTHER
                folded = True
        return folded


class _Page:
    """What has been read of one page so far; ``read`` takes the next lines."""

    def __init__(self, limits: Limits) -> None:
        self.families: dict[str, Family] = {}
        self.by_name: dict[str, list[tuple[Labels, float]]] = {}
        self.family_of: dict[str, Family] = {}  # sample name -> family (cache)
        # series already read -> (position in its family, position in by_name)
        self.seen: dict[tuple[str, frozenset[tuple[str, str]]], tuple[int, int]] = {}
        self.dropped: Counter[str] = Counter()
        self.prefixes: set[str] = set()
        self.folder = _Folder(limits)
        self.max_line = limits.max_line_length
        self.max_series = limits.max_series
        self.lineno = 0

    def read(self, lines: list[str]) -> None:
        for raw in lines:
            self.lineno += 1
            if len(raw) > self.max_line:
                raise ExpositionError(
                    self.lineno,
                    f"line of {len(raw)} characters, over the {self.max_line}"
                    "-character limit (scrape.max_line_length)",
                )
            line = raw[:-1] if raw.endswith("\r") else raw
            if not line or line.isspace():
                continue
            if line[0] == "#":
                _comment(line, self.lineno, self.families)
                continue
            self._sample(line.strip(), self.lineno)

    def _sample(self, line: str, lineno: int) -> None:
        m = _NAME_AT.match(line)
        if m is None:
            raise ExpositionError(lineno, f"not a sample line: {_shown(line)}")
        name = m[0]
        at = m.end()
        while at < len(line) and line[at] in " \t":
            at += 1
        labels: Labels
        if at < len(line) and line[at] == "{":
            labels, at = _labels(line, at + 1, lineno)
        else:
            labels = {}
            if at == m.end():
                raise ExpositionError(lineno, f"not a sample line: {_shown(line)}")
        value = _value(line[at:], lineno, line)
        if name.endswith("_created"):
            return
        fam = self.family_of.get(name)
        if fam is None:
            fam_name = _family_of(name, self.families)
            fam = self.families.get(fam_name)
            if fam is None:
                fam = self.families[fam_name] = Family(fam_name)
            self.family_of[name] = fam
        if not -_INF < value < _INF:
            self.dropped["not_finite"] += 1
            return
        if value < 0 and (fam.type == "counter" or name.endswith(_CUMULATIVE_SUFFIXES)):
            self.dropped["negative_counter"] += 1
            return
        self._keep(fam, name, labels, value)

    def _keep(self, fam: Family, name: str, labels: Labels, value: float) -> None:
        """Add a sample; a repeated series is dropped, unless folding made it the ``other`` total."""
        folded = self.folder.fold(labels) if labels else False
        if folded:
            self.dropped["label_values_cap"] += 1
        key = (name, frozenset(labels.items()))
        where = self.seen.get(key)
        series = self.by_name.get(name)
        if series is None:
            series = self.by_name[name] = []
            _add_prefixes(name, self.prefixes)
        if where is None:
            if len(self.seen) >= self.max_series:
                raise TooManySeriesError(
                    self.lineno, f"more than {self.max_series} series on one page (scrape.max_series)"
                )
            self.seen[key] = (len(fam.samples), len(series))
            fam.samples.append((name, labels, value))
            series.append((labels, value))
        elif folded:
            in_family, in_series = where
            total = fam.samples[in_family][2] + value
            fam.samples[in_family] = (name, labels, total)
            series[in_series] = (labels, total)
        else:
            self.dropped["duplicate"] += 1

    def exposition(self) -> Exposition:
        return Exposition(self.families, self.lineno, self.by_name, self.dropped, self.prefixes)


def parse_steps(
    text: str, limits: Limits = DEFAULT_LIMITS, slice_chars: int = 32 * 1024
) -> Generator[None, None, Exposition]:
    """Parse an exposition, yielding after every ~``slice_chars`` of input; returns the Exposition.

    Raises ``ExpositionError`` (with line number) on anything malformed.
    """
    _check_ending(text)
    page = _Page(limits)
    pos, size = 0, len(text)
    while pos < size:
        end = text.find("\n", min(pos + slice_chars, size - 1))
        end = size if end < 0 else end + 1
        lines = text[pos:end].split("\n")
        pos = end
        if lines[-1] == "":
            lines.pop()
        collecting = gc.isenabled()
        gc.disable()  # a slice allocates thousands of small objects: collect between slices, not in them
        try:
            page.read(lines)
        finally:
            if collecting:
                gc.enable()
        yield
    return page.exposition()


def parse_text(text: str, limits: Limits = DEFAULT_LIMITS) -> Exposition:
    """Parse an exposition in one go; raise ``ExpositionError`` (with line number) on anything malformed."""
    return run_now(parse_steps(text, limits))


def _comment(line: str, lineno: int, families: dict[str, Family]) -> None:
    parts = line.split(None, 3)
    if len(parts) < 2 or parts[1] not in ("HELP", "TYPE"):
        return  # plain comment, or OpenMetrics "# EOF"
    if len(parts) < 3:
        raise ExpositionError(lineno, f"{parts[1]} without a metric name: {_shown(line)}")
    name = parts[2]
    if not _NAME.match(name):
        raise ExpositionError(lineno, f"invalid metric name {_shown(name)} in {parts[1]} line")
    if name.endswith("_created"):
        return
    fam = families.get(name)
    if parts[1] == "HELP":
        if fam is None:
            families[name] = Family(name)
        return
    kind = parts[3].strip().lower() if len(parts) > 3 else ""
    if kind not in TYPES:
        raise ExpositionError(
            lineno,
            f"unknown metric type {_shown(kind)} for {name} (expected one of {', '.join(sorted(TYPES))})",
        )
    if fam is None:
        families[name] = Family(name, kind)
    else:
        fam.type = kind
