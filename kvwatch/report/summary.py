"""Per length band and replica: outcomes, latency percentiles, output lengths and KV held.

Percentiles are pandas' ``quantile`` (linear interpolation between the two nearest ranks, numpy's
``linear`` method, Hyndman & Fan type 7) over the requests where the value is known, all outcomes
together, the same population the live ``kvwatch_request_*`` histograms count.

**KV token-seconds** of one request (``kv_token_seconds``), the memory it held over time:
``prompt_tokens x e2e + output_tokens x (e2e - TTFT) / 2``. Assumes the prompt's KV is held from
arrival to the last byte (the proxy cannot see queueing, so this over-counts queued time) and that
output KV grows linearly from 0 at the first token to ``output_tokens`` at the end (one token per
decode step). Missing TTFT counts as 0 (growth over the whole request); a request without prompt
tokens or e2e is left out and counted. Preemption and recompute are not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from kvwatch.model import DEFAULT_BANDS, OUTCOMES, UNKNOWN_BAND, LengthBands
from kvwatch.report.inputs import ReportError
from kvwatch.report.load import FileStats, Loaded

if TYPE_CHECKING:
    import pandas as pd

ALL = "(all)"  # parentheses never occur in replica names or band names
QUANTILES = (0.5, 0.9, 0.99)
PERCENTILE_METHOD = (
    "pandas quantile, linear interpolation between the nearest ranks (numpy 'linear', Hyndman & Fan type 7)"
)
KV_FORMULA = "kv_token_seconds = prompt_tokens x e2e + output_tokens x (e2e - TTFT) / 2"
KV_ASSUMPTION = (
    "prompt KV held from arrival to the last byte (queue time included); output KV grows "
    "linearly from the first token to the last; missing TTFT counts as 0"
)
_LATENCIES = ("ttft", "tpot", "e2e")
_TOKENS = ("output_tokens", "prompt_tokens")


def _quantile_column(name: str, quantile: float) -> str:
    """``ttft`` at 0.99 is ``ttft_p99_seconds``; token counts have no unit suffix."""
    return f"{name}_p{round(quantile * 100)}{'_seconds' if name in _LATENCIES else ''}"


#: the percentile columns of a ``BandRow``, one per value and quantile
_QUANTILE_COLUMNS = {
    (name, q): _quantile_column(name, q) for name in (*_LATENCIES, *_TOKENS) for q in QUANTILES
}


@dataclass(frozen=True, slots=True)
class BandRow:
    """One length band of one replica (``(all)`` aggregates); one CSV row. None = not known."""

    replica: str
    length_band: str
    requests: int
    request_share: float | None  # of this replica's requests
    completed_ratio: float | None
    truncated_ratio: float | None
    aborted_ratio: float | None
    error_ratio: float | None
    rejected_ratio: float | None
    ttft_p50_seconds: float | None
    ttft_p90_seconds: float | None
    ttft_p99_seconds: float | None
    tpot_p50_seconds: float | None
    tpot_p90_seconds: float | None
    tpot_p99_seconds: float | None
    e2e_p50_seconds: float | None
    e2e_p90_seconds: float | None
    e2e_p99_seconds: float | None
    output_tokens_p50: float | None
    output_tokens_p90: float | None
    output_tokens_p99: float | None
    output_tokens_mean: float | None
    prompt_tokens_p50: float | None
    prompt_tokens_p90: float | None
    prompt_tokens_p99: float | None
    kv_token_seconds: float | None
    kv_share: float | None  # of this replica's KV token-seconds
    kv_mean_tokens: float | None  # kv_token_seconds / report window: mean KV tokens held


ROW_COLUMNS = tuple(f.name for f in fields(BandRow))


@dataclass(frozen=True, slots=True)
class OutputHistogram:
    """Output-token counts of all reported requests in log-spaced bins (``edges`` has one more entry)."""

    edges: tuple[float, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Report:
    kind: str  # ledger | azure | burstgpt | mooncake
    bands: LengthBands
    bands_origin: str
    rows: tuple[BandRow, ...]
    files: tuple[FileStats, ...]
    requests: int
    malformed: int
    malformed_reasons: tuple[tuple[str, int], ...]
    malformed_examples: tuple[str, ...]
    window_start: float | None
    window_end: float | None
    output_histogram: OutputHistogram
    has_ttft: bool
    has_e2e: bool
    has_outcomes: bool
    estimated_output_requests: int
    kv_excluded_requests: int
    kv_estimated_prompt_requests: int  # KV token-seconds with the prompt estimated from the request size
    replicas: tuple[str, ...]  # replica groups in row order, (all) first
    notes: tuple[str, ...]

    @property
    def window_seconds(self) -> float | None:
        if self.window_start is None or self.window_end is None:
            return None
        return self.window_end - self.window_start

    def rows_for(self, replica: str) -> list[BandRow]:
        return [r for r in self.rows if r.replica == replica]


# --------------------------------------------------------------------------------------------
# bands
# --------------------------------------------------------------------------------------------


def parse_band_edges(text: str) -> LengthBands:
    """``--bands 1000,5000,10000,20000`` (``k`` suffix allowed: ``1k,5k``)."""
    try:
        edges = tuple(_tokens(part) for part in text.split(",") if part.strip())
        return LengthBands(edges)
    except ValueError as exc:
        raise ReportError(
            f"--bands {text!r}: {exc} (expected ascending token counts, e.g. 1000,5000,10000,20000)"
        ) from None


def _tokens(text: str) -> int:
    text = text.strip().lower()
    scale = 1000 if text.endswith("k") else 1
    number = float(text.removesuffix("k")) * scale
    if not math.isfinite(number) or number != int(number):  # int(inf) raises OverflowError
        raise ValueError(f"{text!r} is not a whole token count")
    return int(number)


def choose_bands(loaded: Loaded, bands: LengthBands | None) -> tuple[LengthBands, str]:
    """The bands a report uses, and why: ``bands`` if given, else a ledger's recorded ones, else the
    defaults."""
    if bands is not None:
        return bands, "from --bands"
    if loaded.kind != "ledger":
        return DEFAULT_BANDS, "defaults"
    recorded = bands_from_names(loaded.recorded_bands)
    if recorded is not None:
        return recorded, "from the band names recorded in the ledger"
    if any(name != UNKNOWN_BAND for name in loaded.recorded_bands):
        return DEFAULT_BANDS, (
            "defaults: the ledger's band names come from more than one set of edges; pass --bands to choose"
        )
    return DEFAULT_BANDS, "defaults"


def bands_from_names(names: Sequence[str]) -> LengthBands | None:
    """The band edges a ledger was written with, from the band names it recorded.

    A ledger names bands, not edges, and only the bands requests fell in (plus the admission bands
    of ``max_tokens``). Names that all belong to the default bands mean the defaults; otherwise the
    edges are read off the names (``1k-5k`` gives 1000 and 5000, ``20k+`` gives 20000), which can
    miss an edge no request came near. None when the names cannot come from one set of edges (the
    config changed between files).
    """
    known = [n for n in names if n != UNKNOWN_BAND]
    if not known:
        return None
    if all(n in DEFAULT_BANDS.names for n in known):
        return DEFAULT_BANDS
    edges: set[int] = set()
    for name in known:
        try:
            if name.endswith("+"):
                edges.add(_tokens(name[:-1]))
            else:
                lo, hi = name.split("-")
                edges.update(e for e in (_tokens(lo), _tokens(hi)) if e)
        except ValueError:
            return None
    try:
        bands = LengthBands(tuple(sorted(edges)))
    except ValueError:
        return None
    return bands if all(n in bands.names for n in known) else None


def band_codes(output_tokens: np.ndarray, bands: LengthBands) -> np.ndarray:
    """Index into ``bands.all_names`` per request: ``[lo, hi)`` like ``LengthBands.band_for``."""
    codes = np.searchsorted(np.asarray(bands.edges, dtype=float), output_tokens, side="right")
    codes[np.isnan(output_tokens)] = len(bands.names)  # unknown
    return codes


# --------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------


def kv_token_seconds(prompt: np.ndarray, output: np.ndarray, ttft: np.ndarray, e2e: np.ndarray) -> np.ndarray:
    """Per request KV token-seconds (module doc); NaN where prompt tokens or e2e are unknown."""
    decode = np.clip(e2e - np.nan_to_num(ttft, nan=0.0), 0.0, None)
    return prompt * e2e + np.nan_to_num(output, nan=0.0) * decode / 2.0


def _prompt_for_kv(df: pd.DataFrame) -> tuple[np.ndarray, int]:
    """Prompt tokens for KV token-seconds: the engine's count, else the proxy's estimate from the
    request's size (a ledger's ``prompt_tokens_estimate``) for a stream that got a first token before
    its client left: its prompt was prefilled, so it held that KV. One that never got a token may
    have waited in the queue all along, holding none: it stays out. Also: how many took the
    estimate."""
    prompt = df["prompt_tokens"].to_numpy(dtype=float)
    if "prompt_tokens_estimate" not in df:
        return prompt, 0
    estimate = df["prompt_tokens_estimate"].to_numpy(dtype=float)
    started = ~np.isnan(df["ttft_seconds"].to_numpy(dtype=float))
    use = np.isnan(prompt) & ~np.isnan(estimate) & started
    return np.where(use, estimate, prompt), int(use.sum())


def summarize(loaded: Loaded, bands: LengthBands, bands_origin: str, replicas: Sequence[str] = ()) -> Report:
    """Aggregate the request table into band rows (module doc)."""
    import pandas as pd

    df = loaded.frame
    if replicas:
        present = set(df["replica"].cat.categories)
        unknown = [r for r in replicas if r not in present]
        if unknown:
            raise ReportError(
                f"--replica {', '.join(unknown)}: not in the input "
                f"(replicas: {', '.join(sorted(present)) or 'none'})"
            )
        df = df[df["replica"].isin(replicas)]
    out = df["output_tokens"].to_numpy(dtype=float)
    codes = band_codes(out, bands)
    band = pd.Categorical.from_codes(codes, categories=bands.all_names)
    prompt, prompt_estimated = _prompt_for_kv(df)
    kv = kv_token_seconds(
        prompt,
        out,
        df["ttft_seconds"].to_numpy(dtype=float),
        df["e2e_seconds"].to_numpy(dtype=float),
    )
    work = pd.DataFrame(
        {
            "replica": df["replica"].cat.remove_unused_categories().array,
            "band": band,
            "outcome": pd.Categorical(df["outcome"], categories=OUTCOMES),
            "ttft": df["ttft_seconds"].to_numpy(dtype=float),
            "tpot": df["tpot_seconds"].to_numpy(dtype=float),
            "e2e": df["e2e_seconds"].to_numpy(dtype=float),
            "output_tokens": out,
            "prompt_tokens": df["prompt_tokens"].to_numpy(dtype=float),
            "kv": kv,
        }
    )
    start, end = _window(df)
    window = (end - start) if start is not None and end is not None and end > start else None
    replica_names = sorted(str(r) for r in pd.unique(work["replica"].dropna()))
    stats = _all_stats(pd, work)
    rows = _rows(stats, [ALL, *replica_names], bands, window, loaded.has_outcomes)
    estimated = int(np.nansum(df["output_tokens_estimated"].to_numpy(dtype=float)))
    kv_excluded = int(np.isnan(kv).sum()) if loaded.has_e2e else 0
    return Report(
        kind=loaded.kind,
        bands=bands,
        bands_origin=bands_origin,
        rows=tuple(rows),
        files=tuple(loaded.files),
        requests=len(work),
        malformed=loaded.problems.total,
        malformed_reasons=tuple(loaded.problems.reasons.most_common()),
        malformed_examples=tuple(loaded.problems.example_lines()),
        window_start=start,
        window_end=end,
        output_histogram=_histogram(out),
        has_ttft=loaded.has_ttft,
        has_e2e=loaded.has_e2e,
        has_outcomes=loaded.has_outcomes,
        estimated_output_requests=estimated,
        kv_excluded_requests=kv_excluded,
        kv_estimated_prompt_requests=prompt_estimated,
        replicas=(ALL, *replica_names),
        notes=tuple(_notes(loaded, bands_origin, estimated, kv_excluded, prompt_estimated)),
    )


def _window(df: pd.DataFrame) -> tuple[float | None, float | None]:
    started = df["started_at"].to_numpy(dtype=float)
    if not len(started) or np.isnan(started).all():
        return None, None
    ended = started + np.nan_to_num(df["e2e_seconds"].to_numpy(dtype=float), nan=0.0)
    return float(np.nanmin(started)), float(np.nanmax(ended))


def _all_stats(pd: Any, work: pd.DataFrame) -> dict[tuple[str, str], dict[str, float]]:
    """Statistics per (replica, band), with ALL standing for every replica / every band."""
    n = len(work)
    # keys are Series, not arrays: pandas reads a list of as many arrays as rows as column names
    everyone = pd.Series(
        pd.Categorical.from_codes(np.zeros(n, dtype=np.int8), categories=[ALL]), index=work.index
    )
    stats: dict[tuple[str, str], dict[str, float]] = {}
    for rkey in (work["replica"], everyone):
        for bkey in (work["band"], everyone):
            _group_stats(pd, work, rkey, bkey, stats)
    return stats


def _group_stats(
    pd: Any, work: pd.DataFrame, rkey: Any, bkey: Any, stats: dict[tuple[str, str], dict[str, float]]
) -> None:
    grouped = work.groupby([rkey, bkey], observed=True, sort=False)
    sizes = grouped.size()
    outcomes = work.groupby([rkey, bkey, work["outcome"]], observed=True).size()
    values = [*_LATENCIES, *_TOKENS]
    quantiles = grouped[values].quantile(list(QUANTILES))
    means = grouped["output_tokens"].mean()
    kv = grouped["kv"].sum(min_count=1)
    for key, count in sizes.items():
        entry = stats.setdefault((str(key[0]), str(key[1])), {})
        entry["requests"] = float(count)
        entry["output_tokens_mean"] = means.get(key, math.nan)
        entry["kv"] = kv.get(key, math.nan)
        for q in QUANTILES:
            qrow = quantiles.loc[(*key, q)]
            for name in values:
                entry[_QUANTILE_COLUMNS[name, q]] = qrow[name]
    for (r, b, outcome), count in outcomes.items():
        stats[(str(r), str(b))][f"outcome:{outcome}"] = float(count)


def _rows(
    stats: dict[tuple[str, str], dict[str, float]],
    replicas: list[str],
    bands: LengthBands,
    window: float | None,
    has_outcomes: bool,
) -> list[BandRow]:
    rows = []
    for replica in replicas:
        total = stats.get((replica, ALL), {})
        for band in (*bands.all_names, ALL):
            entry = stats.get((replica, band), {})
            if band == UNKNOWN_BAND and not entry:
                continue
            rows.append(_row(replica, band, entry, total, window, has_outcomes))
    return rows


def _row(
    replica: str,
    band: str,
    e: dict[str, float],
    total: dict[str, float],
    window: float | None,
    has_outcomes: bool,
) -> BandRow:
    count = int(e.get("requests", 0))

    def known(value: float | None) -> float | None:
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)

    def ratio(part: float | None, whole: float | None) -> float | None:
        part, whole = known(part), known(whole)
        return None if part is None or not whole else part / whole

    outcome = {o: (ratio(e.get(f"outcome:{o}", 0.0), count) if has_outcomes else None) for o in OUTCOMES}
    kv = known(e.get("kv"))
    return BandRow(
        replica=replica,
        length_band=band,
        requests=count,
        request_share=ratio(count, total.get("requests")),
        completed_ratio=outcome["completed"],
        truncated_ratio=outcome["truncated"],
        aborted_ratio=outcome["aborted"],
        error_ratio=outcome["error"],
        rejected_ratio=outcome["rejected"],
        output_tokens_mean=known(e.get("output_tokens_mean")),
        **{column: known(e.get(column)) for column in _QUANTILE_COLUMNS.values()},
        kv_token_seconds=kv,
        kv_share=ratio(kv, total.get("kv")),
        kv_mean_tokens=None if kv is None or not window else kv / window,
    )


def _histogram(output_tokens: np.ndarray) -> OutputHistogram:
    """Half-octave bins from 1 token up to the longest output; 0 tokens fall in the first bin."""
    known = output_tokens[~np.isnan(output_tokens)]
    if not len(known):
        return OutputHistogram((), ())
    top = max(float(known.max()), 2.0)
    steps = math.ceil(2 * math.log2(top)) + 1
    edges = np.concatenate(([0.0], np.power(2.0, np.arange(steps) / 2.0)))
    edges[-1] = max(edges[-1], top + 1)
    counts, _ = np.histogram(np.clip(known, 0, None), bins=edges)
    return OutputHistogram(tuple(float(x) for x in edges), tuple(int(c) for c in counts))


def _notes(
    loaded: Loaded, bands_origin: str, estimated: int, kv_excluded: int, prompt_estimated: int
) -> list[str]:
    notes = [f"length bands: {bands_origin}", f"percentiles: {PERCENTILE_METHOD}"]
    if loaded.has_e2e:
        notes.append(f"KV token-seconds: {KV_FORMULA}; assumes {KV_ASSUMPTION}")
    else:
        notes.append(
            f"{loaded.kind} traces carry no latency: TTFT, TPOT, e2e and KV token-seconds are not available"
        )
    if loaded.has_e2e and not loaded.has_ttft:
        notes.append(
            f"{loaded.kind} traces carry no TTFT (e2e only): KV token-seconds take TTFT as 0 (an upper bound)"
        )
    if not loaded.has_outcomes:
        notes.append(f"{loaded.kind} traces record no outcome: outcome ratios are not available")
    if loaded.kind == "burstgpt":
        notes.append(
            "BurstGPT rows with Response tokens = 0 are failures: outcome error, output length unknown"
        )
    if estimated:
        notes.append(f"{estimated:,} request(s) have output tokens counted from chunks (no usage)")
    if prompt_estimated:
        notes.append(
            f"{prompt_estimated:,} request(s) without usage count their prompt in KV token-seconds as the "
            "proxy estimated it from the request's size (prompt_tokens_estimate)"
        )
    if kv_excluded:
        notes.append(
            f"{kv_excluded:,} request(s) lack prompt tokens or e2e and are left out of KV token-seconds"
        )
    return notes
