"""Cumulative request stats: per (replica, model, band, source) histograms and outcome counts.

Fed once per finished request by every request source (proxy, OTLP, SGLang files, vLLM plugin);
read as copies by the exporters, the derived signals and the status page. A replica that goes away
is forgotten: its rows leave, summed into ``forgotten()`` per (model, band, source).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import MutableMapping
from typing import Self, TypeVar, cast

from kvwatch import buckets
from kvwatch.buckets import Histogram
from kvwatch.model import LengthBands, Outcome, RequestRecord
from kvwatch.native_histogram import NativeHistogram, merged

HISTOGRAM_FAMILIES = {
    "kvwatch_request_ttft_seconds": buckets.TTFT_SECONDS,
    "kvwatch_request_tpot_seconds": buckets.TPOT_SECONDS,
    "kvwatch_request_inter_chunk_seconds": buckets.INTER_CHUNK_SECONDS,
    "kvwatch_request_duration_seconds": buckets.DURATION_SECONDS,
    "kvwatch_request_queue_seconds": buckets.QUEUE_SECONDS,
    "kvwatch_request_prefill_seconds": buckets.TTFT_SECONDS,
    "kvwatch_request_decode_seconds": buckets.DURATION_SECONDS,
    "kvwatch_request_preemptions": buckets.PREEMPTIONS,
    "kvwatch_request_output_limit_ratio": buckets.RATIO,
    "kvwatch_request_prefix_reuse_ratio": buckets.RATIO,
}
#: (family, RequestRecord attribute) observed as the record gives it, when it gives it (queue, prefill,
#: decode and preemptions only an engine-side source gives)
_OBSERVED_AS_IS = (
    ("kvwatch_request_ttft_seconds", "ttft_seconds"),
    ("kvwatch_request_tpot_seconds", "tpot_seconds"),
    ("kvwatch_request_duration_seconds", "e2e_seconds"),
    ("kvwatch_request_output_tokens", "output_tokens"),
    ("kvwatch_request_queue_seconds", "queue_seconds"),
    ("kvwatch_request_prefill_seconds", "prefill_seconds"),
    ("kvwatch_request_decode_seconds", "decode_seconds"),
    ("kvwatch_request_preemptions", "preemptions"),
)
#: families fed pre-binned (a request's inter-chunk gaps arrive as classic bins): no native form
PREBINNED_FAMILIES = frozenset({"kvwatch_request_inter_chunk_seconds"})
#: the replica of ``RequestStats.forgotten()``'s rows: the forgotten replicas, summed
FORGOTTEN = ""

_Key = TypeVar("_Key", bound=tuple[str, ...])
_Value = TypeVar("_Value")


class DualHistogram(Histogram):
    """Classic buckets and a native histogram of the same observations: the protobuf exposition
    sends both in one message, the text exposition the classic ones."""

    __slots__ = ("native",)

    def __init__(self, bounds: tuple[float, ...]) -> None:
        super().__init__(bounds)
        self.native = NativeHistogram()

    def observe(self, value: float, weight: int = 1) -> None:
        super().observe(value, weight)
        self.native.observe(value, weight)

    def copy(self) -> Self:
        out = super().copy()
        out.native = self.native.copy()
        return out


class RequestStats:
    """Cumulative per-(replica, model, band, source) request histograms and outcome counts.

    ``observe`` is called once per finished request (never per chunk). Thread-safe.
    """

    def __init__(self, bands: LengthBands) -> None:
        self.bands = bands
        self.bounds = dict(HISTOGRAM_FAMILIES)
        self.bounds["kvwatch_request_output_tokens"] = buckets.output_token_bounds(bands.edges)
        self._lock = threading.Lock()
        # (replica, model, band, source) -> family -> Histogram
        self.histograms: dict[tuple[str, str, str, str], dict[str, Histogram]] = {}
        self.outcomes: Counter[tuple[str, str, str, str, str]] = Counter()
        self.estimated: Counter[tuple[str, str, str, str]] = Counter()
        #: (replica, model, band, source) -> requests whose longest gap was a preemption stall; a key
        #: is present (at 0) once a request with a measured longest gap was seen
        self.stalls: Counter[tuple[str, str, str, str]] = Counter()
        #: (replica, model, band, source) -> max_tokens - output tokens of requests that stopped early
        self.unused_limit_tokens: Counter[tuple[str, str, str, str]] = Counter()
        self.observed = 0
        #: what ``forget`` took from replicas that went away (made at the first one)
        self._forgotten: RequestStats | None = None

    def _hists(self, key: tuple[str, str, str, str]) -> dict[str, Histogram]:
        hists = self.histograms.get(key)
        if hists is None:
            hists = self.histograms[key] = {
                name: Histogram(b) if name in PREBINNED_FAMILIES else DualHistogram(b)
                for name, b in self.bounds.items()
            }
        return hists

    def observe(self, record: RequestRecord, stalled: bool | None = None) -> str:
        """Fold one finished request in; returns the length band it was counted in.

        ``stalled``: whether its longest gap overlapped a preemption (None: not measured).
        """
        band = self.bands.band_for(record.output_tokens)
        key = (record.replica, record.model_name, band, record.source)
        with self._lock:
            hists = self._hists(key)
            for family, attribute in _OBSERVED_AS_IS:
                value = getattr(record, attribute)
                if value is not None:
                    hists[family].observe(value)
            if record.gap_counts:
                hists["kvwatch_request_inter_chunk_seconds"].merge_bins(
                    record.gap_bounds, record.gap_counts, record.gap_sum
                )
            self._observe_ratios(hists, key, record)
            self.outcomes[(*key, record.outcome.value)] += 1
            if record.output_tokens_estimated:
                self.estimated[key] += 1
            if stalled is not None:
                self.stalls[key] += int(stalled)
            self.observed += 1
        return band

    def _observe_ratios(
        self, hists: dict[str, Histogram], key: tuple[str, str, str, str], record: RequestRecord
    ) -> None:
        """Output / max_tokens (and the unused limit of a request that stopped early) and the prefix
        cache's share of the prompt, where the source knew both sides."""
        if record.output_tokens is not None and record.max_tokens:
            hists["kvwatch_request_output_limit_ratio"].observe(record.output_tokens / record.max_tokens)
            if record.outcome is Outcome.COMPLETED and not record.output_tokens_estimated:
                self.unused_limit_tokens[key] += max(0, record.max_tokens - record.output_tokens)
        if record.cached_prompt_tokens is not None and record.prompt_tokens:
            hists["kvwatch_request_prefix_reuse_ratio"].observe(
                min(1.0, record.cached_prompt_tokens / record.prompt_tokens)
            )

    def snapshot(
        self,
    ) -> tuple[
        dict[tuple[str, str, str, str], dict[str, Histogram]],
        dict[tuple[str, str, str, str, str], int],
        dict[tuple[str, str, str, str], int],
    ]:
        """Copies for exporters (scrape must not hold the lock while rendering)."""
        with self._lock:
            hists = {
                key: {name: h.copy() for name, h in fams.items()} for key, fams in self.histograms.items()
            }
            return hists, dict(self.outcomes), dict(self.estimated)

    def unused_limit_counts(self) -> dict[tuple[str, str, str, str], int]:
        """A copy of the unused max_tokens per key, for exporters."""
        with self._lock:
            return dict(self.unused_limit_tokens)

    def stall_counts(self) -> dict[tuple[str, str, str, str], int]:
        """A copy of the preemption-stall counts, for exporters."""
        with self._lock:
            return dict(self.stalls)

    def forget(self, replica: str) -> None:
        """Drop a replica that went away, so its series leave the exposition. What it counted moves
        into ``forgotten()``: a sum over the node (lean's per-node series) that adds those rows does
        not go down when a replica leaves, which Prometheus would read as a counter reset."""
        with self._lock:
            if self._forgotten is None:
                self._forgotten = RequestStats(self.bands)
            into = self._forgotten
            with into._lock:
                for key, hists in _pop_rows(self.histograms, replica):
                    into._add_histograms(_forgotten_key(key), hists)
                _add_counts(_pop_rows(self.outcomes, replica), into.outcomes)
                _add_counts(_pop_rows(self.estimated, replica), into.estimated)
                _add_counts(_pop_rows(self.stalls, replica), into.stalls)
                _add_counts(_pop_rows(self.unused_limit_tokens, replica), into.unused_limit_tokens)

    def forgotten(self) -> RequestStats:
        """The forgotten replicas' rows summed per (model, band, source), under replica ``FORGOTTEN``
        (read with ``snapshot()`` and the count methods, as the live ones)."""
        with self._lock:
            return RequestStats(self.bands) if self._forgotten is None else self._forgotten

    def _add_histograms(self, key: tuple[str, str, str, str], hists: dict[str, Histogram]) -> None:
        """Sum a forgotten row's histograms into this one's ``key`` (the caller holds ``_lock``)."""
        mine = self._hists(key)
        for name, h in hists.items():
            into = mine[name]
            into.merge_bins(h.bounds, h.bins, h.sum)
            if isinstance(into, DualHistogram) and isinstance(h, DualHistogram):
                into.native = merged((into.native, h.native))


def _pop_rows(rows: MutableMapping[_Key, _Value], replica: str) -> list[tuple[_Key, _Value]]:
    """Remove and return the rows whose key starts with ``replica``."""
    return [(key, rows.pop(key)) for key in [k for k in rows if k[0] == replica]]


def _forgotten_key(key: _Key) -> _Key:
    """``key`` with its replica replaced by ``FORGOTTEN``."""
    return cast(_Key, (FORGOTTEN, *key[1:]))


def _add_counts(rows: list[tuple[_Key, int]], into: Counter[_Key]) -> None:
    """Sum forgotten rows into ``into``'s ``FORGOTTEN`` keys (a row at 0 stays: a present key)."""
    for key, n in rows:
        into[_forgotten_key(key)] += n
