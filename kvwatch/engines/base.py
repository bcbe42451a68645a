"""The engine-adapter contract, and the small toolkit every adapter reads an exposition with.

An adapter is a module with (``registry.EngineAdapter`` is this contract as a type)::

    BACKEND: str                                                   # one of model.BACKENDS
    def detect(expo: Exposition) -> bool                           # does this page belong to me?
    def parse(expo: Exposition, replica: str, scraped_at: float) -> list[ReplicaSample]
    EXTRA_PAGE: ExtraPage                                          # optional: a page besides /metrics

Version differences are data: each adapter lists, per ``ReplicaSample`` field, the exposed names
that carried it over the engine's history, newest first (``Field``), and ``VersionHint`` rows that
name the version range a page comes from. ``read_fields`` takes the first name that has a series for
the replica. A field whose names are all absent stays ``None`` (not measured), never 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from itertools import product
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvwatch.engines.exposition_parser import Exposition, Labels
from kvwatch.model import HistogramSnapshot, ReplicaSample, TierTraffic


@dataclass(frozen=True, slots=True)
class ExtraPage:
    """A page an adapter reads besides ``/metrics`` (llama.cpp's ``/slots``).

    The scrape job fetches it after a good ``/metrics`` and hands the body to ``apply``; when it
    fails (``apply`` raises ``ValueError`` or the fetch fails) only what it adds is lost: the target
    stays up with the ``/metrics`` samples, and ``lost`` says what is missing and how to fix it.
    """

    path: str  # replaces a trailing /metrics of the metrics URL when the config names no URL
    accept: str
    apply: Callable[[bytes, tuple[ReplicaSample, ...]], tuple[ReplicaSample, ...]]
    lost: str

    def url(self, metrics_url: str, configured: str | None = None) -> str:
        """``configured``, else ``metrics_url`` with ``/metrics`` replaced by ``path``."""
        if configured:
            return configured
        parts = urlsplit(metrics_url)
        path = parts.path.rstrip("/")
        base = path[: -len("/metrics")] if path.endswith("/metrics") else ""
        return urlunsplit((parts.scheme, parts.netloc, f"{base}{self.path}", "", ""))


@dataclass(frozen=True, slots=True)
class Field:
    """One ``ReplicaSample`` field and the exposed names that carry it, newest first.

    ``shared`` series may lack the rank labels and still belong to every rank (configuration such
    as vLLM's ``cache_config_info`` before 0.9). Non-shared series without rank labels are only
    used when the page has a single rank, so a server-wide counter is never counted once per rank.
    """

    attr: str
    names: tuple[str, ...]
    shared: bool = False


@dataclass(frozen=True, slots=True)
class VersionHint:
    """A page that has every name in ``present`` and none in ``absent`` comes from ``hint``."""

    present: tuple[str, ...]
    absent: tuple[str, ...]
    hint: str


def version_hint(
    expo: Exposition, table: Sequence[VersionHint], default: str, facts: frozenset[str] = frozenset()
) -> str:
    """The first row of ``table`` the page satisfies (rows are ordered most specific first).

    ``facts`` are pseudo-names an adapter asserts about the page (``"label:engine"``).
    """

    def has(name: str) -> bool:
        return name in facts or expo.has(name)

    for row in table:
        if all(has(n) for n in row.present) and not any(has(n) for n in row.absent):
            return row.hint
    return default


def _clean(value: float) -> float | None:
    return None if math.isnan(value) else value


#: Labels that identify a rank: a series missing one on a page that has ranks is server-wide.
RANK_LABELS = frozenset({"engine", "dp_rank"})


class RankView:
    """The series of one replica (model, data-parallel rank) inside an exposition.

    ``key`` holds the identity labels (``{"model_name": "m", "engine": "0"}``; a ``None`` value means
    the page has no such label). ``lowest`` names copy labels: SGLang reports the same logical count
    under every TP rank, so for each name the view keeps only the series of the lowest ``tp_rank``
    (read one rank, never sum them).
    """

    __slots__ = ("_combos", "_names", "expo", "key", "lowest", "ranked")

    def __init__(
        self,
        expo: Exposition,
        key: Mapping[str, str | None],
        lowest: tuple[str, ...] = (),
        ranked: bool = False,
    ) -> None:
        self.expo = expo
        self.key = dict(key)
        self.lowest = lowest
        self.ranked = ranked  # several ranks on this page: rank-less series are not ours alone
        self._names = tuple(self.key)
        # the index groups a series may sit in: each key label equal to ours, or absent
        choices = [(want,) if want is None else (want, None) for want in self.key.values()]
        self._combos = tuple(product(*choices))

    def matches(self, labels: Labels, shared: bool = False) -> bool:
        """A series is this replica's when its identity labels agree with the key.

        A series that lacks a key label still matches (LMCache/HiCache series carry no
        ``model_name``; ``cache_config_info`` had no ``engine`` before vLLM 0.9), except a missing
        rank label on a page with several ranks: that series is server-wide, not this rank's.
        """
        for name, want in self.key.items():
            have = labels.get(name)
            if have is None:
                if want is not None and self.ranked and not shared and name in RANK_LABELS:
                    return False
            elif have != want:
                return False
        return True

    def _candidates(self, name: str) -> list[tuple[Labels, float]]:
        """The series of ``name`` that may be ours, in page order, from the index (never a page scan)."""
        groups = self.expo.grouped(name, self._names)
        positions: list[int] = []
        for combo in self._combos:
            positions.extend(groups.get(combo, ()))
        if len(self._combos) > 1:
            positions.sort()
        every = self.expo.series(name)
        return [every[pos] for pos in positions]

    def series(self, name: str, shared: bool = False, **where: str) -> list[tuple[Labels, float]]:
        """This replica's series of one exposed name, optionally filtered by more labels."""
        out = []
        for labels, value in self._candidates(name):
            if not self.matches(labels, shared):
                continue
            if where and any(labels.get(k) != v for k, v in where.items()):
                continue
            out.append((labels, value))
        for label in self.lowest:
            present = [lab[label] for lab, _ in out if label in lab]
            if len(set(present)) > 1:
                first = min(present, key=rank_sort_key)
                out = [(lab, v) for lab, v in out if lab.get(label, first) == first]
        return out

    def value(self, *names: str, shared: bool = False, **where: str) -> float | None:
        """Sum of this replica's series under the first name that has any; None when none has.

        Summing covers label splits of one total (SGLang ``pid`` on multiprocess gauges, ``priority``
        children, ``is_streaming``); NaN samples count as absent.
        """
        for name in names:
            found = self.series(name, shared, **where)
            if found:
                values = [v for _, v in found if not math.isnan(v)]
                return math.fsum(values) if values else None
        return None

    def labels_of(self, *names: str, shared: bool = True) -> Labels | None:
        """Labels of the first series under the first present name (info-style families)."""
        for name in names:
            found = self.series(name, shared)
            if found:
                return found[0][0]
        return None

    def by_label(self, name: str, label: str) -> tuple[tuple[str, float], ...]:
        """(label value, summed value) pairs, e.g. finished requests by ``finished_reason``."""
        totals: dict[str, float] = {}
        for labels, value in self.series(name):
            if label in labels and not math.isnan(value):
                totals[labels[label]] = totals.get(labels[label], 0.0) + value
        return tuple(sorted(totals.items()))

    def histogram(self, *names: str, shared: bool = False) -> HistogramSnapshot | None:
        """The first present histogram (family name without suffix), label splits merged."""
        for name in names:
            snap = _histogram(self, name, shared)
            if snap is not None:
                return snap
        return None


def _histogram(view: RankView, name: str, shared: bool) -> HistogramSnapshot | None:
    buckets: dict[float, float] = {}
    for labels, value in view.series(f"{name}_bucket", shared):
        le = labels.get("le")
        if le is None:
            continue
        try:
            bound = float(le)
        except ValueError:
            continue
        buckets[bound] = buckets.get(bound, 0.0) + value
    if math.inf not in buckets:
        return None  # no buckets (multiprocess family never observed) or a histogram without +Inf
    bounds = tuple(sorted(buckets))
    total = view.value(f"{name}_sum", shared=shared)
    count = view.value(f"{name}_count", shared=shared)
    return HistogramSnapshot(
        bounds=bounds,
        cumulative_counts=tuple(buckets[b] for b in bounds),
        sum=total if total is not None else math.nan,
        count=count if count is not None else buckets[math.inf],
    )


def read_fields(view: RankView, table: Iterable[Field]) -> dict[str, float | None]:
    """``{attr: value}`` for each field of ``table`` (first present name wins)."""
    return {f.attr: view.value(*f.names, shared=f.shared) for f in table}


def read_histograms(
    view: RankView, table: Mapping[str, tuple[str, ...]], shared: bool = False
) -> tuple[tuple[str, HistogramSnapshot], ...]:
    out = []
    for key, names in table.items():
        snap = view.histogram(*names, shared=shared)
        if snap is not None:
            out.append((key, snap))
    return tuple(out)


def traffic(family: str, src: str, dst: str, **amounts: float | None) -> TierTraffic | None:
    """A TierTraffic when at least one amount was measured, else None."""
    if all(v is None for v in amounts.values()):
        return None
    return TierTraffic(family, src, dst, **amounts)


def rank_keys(
    expo: Exposition, anchors: Iterable[str], rank_label: str, model_label: str = "model_name"
) -> list[tuple[str | None, str | None]]:
    """(model, rank) pairs of the anchor families' series, ordered by model then numeric rank."""
    found = {
        (labels.get(model_label), labels.get(rank_label))
        for name in anchors
        for labels, _ in expo.series(name)
    }
    return sorted(found, key=lambda k: (k[0] or "", rank_sort_key(k[1])))


def rank_views(
    expo: Exposition,
    keys: Sequence[tuple[str | None, str | None]],
    rank_label: str,
    model_label: str = "model_name",
    lowest: tuple[str, ...] = (),
) -> Iterator[tuple[str | None, str | None, RankView]]:
    """(model, rank, its view) for each of ``keys``; with more than one rank on the page every view
    is ``ranked``: series without a rank label belong to no single rank."""
    ranked = len({rank for _, rank in keys}) > 1
    for model, rank in keys:
        yield model, rank, RankView(expo, {model_label: model, rank_label: rank}, lowest, ranked)


def rank_sort_key(value: str | None) -> tuple[int, int, str]:
    """Sort ranks numerically ("2" before "10"), None first, anything else as text after numbers.

    Only short ASCII digit strings are numbers: ``"²"`` is a digit to ``str.isdigit`` but not to
    ``int``, and ``int`` refuses 5,000 digits; an engine's odd label must not fail the scrape.
    """
    if value is None:
        return (0, 0, "")
    if value.isascii() and value.isdigit() and len(value) <= 18:
        return (1, int(value), "")
    return (2, 0, value)


def as_int(value: str | float | None) -> int | None:
    """An integer from a label value (``"5943"``) or a gauge; None for absent, ``"None"``, junk, NaN."""
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) else None


#: ReplicaSample fields an engine may or may not measure (what ``inspect`` lists as missing).
MEASURED_FIELDS: tuple[str, ...] = tuple(
    f.name
    for f in fields(ReplicaSample)
    if f.name
    not in (
        "replica",
        "backend",
        "scraped_at",
        "model_name",
        "dp_rank",
        "version_hint",
        "token_counters_at_finish",
        "finished_requests_total",
        "tier_traffic",
        "histograms",
    )
)


def with_capacity(sample: ReplicaSample, tokens: int) -> ReplicaSample:
    """``sample`` with a configured KV pool of ``tokens`` (``replicas[].kv_capacity_tokens``): the usage
    ratio follows where the engine counts the tokens used (llama.cpp's slots, SGLang), else it stays
    the engine's own (vLLM's is of its blocks)."""
    used = sample.kv_used_tokens
    usage = used / tokens if used is not None else sample.kv_usage_ratio
    return replace(sample, kv_capacity_tokens=float(tokens), kv_usage_ratio=usage)


def missing_fields(sample: ReplicaSample) -> list[str]:
    """Names of measurable fields the engine did not expose (None) for this sample."""
    return [name for name in MEASURED_FIELDS if getattr(sample, name) is None]


@dataclass(frozen=True, slots=True)
class Scrape:
    """One page of one target, as every sample an adapter builds from it is stamped."""

    replica: str
    backend: str
    scraped_at: float
    version_hint: str | None = None

    def sample(self, **values: Any) -> ReplicaSample:
        """A ReplicaSample of this page (``version_hint`` may be overridden); NaN becomes None."""
        stamped: dict[str, Any] = {"version_hint": self.version_hint, **values}
        clean: dict[str, Any] = {k: (_clean(v) if isinstance(v, float) else v) for k, v in stamped.items()}
        return ReplicaSample(replica=self.replica, backend=self.backend, scraped_at=self.scraped_at, **clean)
