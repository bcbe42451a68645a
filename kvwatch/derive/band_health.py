"""Service health per output-length band: how requests in each band ended.

Ratios over all finished requests of the band (every outcome: completed, truncated, aborted, error,
rejected): ``completed``, ``truncated`` (a token budget cut the output), ``aborted`` (the client went
away: abandonment). Pass lifetime counts (``RequestStats.snapshot()`` outcomes) for lifetime ratios,
or ``outcome_increase(now, earlier)`` for a window. Prometheus computes the same from
``kvwatch_requests_total`` with recording rules; the status page and ``kvwatch report`` use this.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvwatch.derive import counters
from kvwatch.model import Outcome

#: key of RequestStats outcome counts
OUTCOME_KEY_LABELS = ("replica", "model_name", "length_band", "source", "outcome")
OutcomeKey = tuple[str, str, str, str, str]
PROXY_SOURCE = "proxy"


@dataclass(frozen=True, slots=True)
class BandHealth:
    finished: float
    completed_ratio: float | None  # None when nothing finished
    truncated_ratio: float | None
    aborted_ratio: float | None


def band_health(
    outcome_counts: Mapping[OutcomeKey, float], group_by: Sequence[str] = ("model_name", "length_band")
) -> dict[tuple[str, ...], BandHealth]:
    """Outcome ratios per group (default: per model and length band, over replicas and sources)."""
    groupable = OUTCOME_KEY_LABELS[:-1]
    unknown = [label for label in group_by if label not in groupable]
    if unknown:
        raise ValueError(f"band_health cannot group by {unknown}; use some of {list(groupable)}")
    positions = [OUTCOME_KEY_LABELS.index(label) for label in group_by]
    totals: dict[tuple[str, ...], dict[str, float]] = {}
    for key, count in outcome_counts.items():
        group = tuple(key[i] for i in positions)
        by_outcome = totals.setdefault(group, {})
        by_outcome[key[-1]] = by_outcome.get(key[-1], 0.0) + count
    return {group: _health(by_outcome) for group, by_outcome in totals.items()}


def _health(by_outcome: Mapping[str, float]) -> BandHealth:
    finished = float(sum(by_outcome.values()))
    if finished <= 0:
        return BandHealth(finished, None, None, None)
    return BandHealth(
        finished,
        by_outcome.get(Outcome.COMPLETED.value, 0.0) / finished,
        by_outcome.get(Outcome.TRUNCATED.value, 0.0) / finished,
        by_outcome.get(Outcome.ABORTED.value, 0.0) / finished,
    )


def outcome_increase(
    current: Mapping[OutcomeKey, float], earlier: Mapping[OutcomeKey, float]
) -> dict[OutcomeKey, float]:
    """Counts added since ``earlier`` (a key that went down was reset: its current count)."""
    return {key: counters.increase(earlier.get(key, 0.0), count) or 0.0 for key, count in current.items()}


def chosen_sources(keys: Iterable[Sequence[str]]) -> dict[str, set[str]]:
    """Per replica, the sources that describe it: the proxy's view where a proxy saw it (client-side
    latency), else every engine-side source. ``keys`` are (replica, model, band, source, ...)."""
    seen: dict[str, set[str]] = {}
    for key in keys:
        seen.setdefault(key[0], set()).add(key[3])
    return {
        replica: ({PROXY_SOURCE} if PROXY_SOURCE in sources else sources) for replica, sources in seen.items()
    }


@dataclass(frozen=True, slots=True)
class BandOutcomes:
    """Finished requests of one length band, one replica or all of them, by outcome, and the ratios."""

    counts: Mapping[str, float]
    health: BandHealth


def band_outcomes(outcome_counts: Mapping[OutcomeKey, float]) -> dict[tuple[str | None, str], BandOutcomes]:
    """(replica, band) and (None: every replica, band) -> outcomes, over each replica's chosen sources."""
    chosen = chosen_sources(outcome_counts)
    groups: dict[tuple[str | None, str], dict[str, float]] = {}
    for key, count in outcome_counts.items():
        replica, _model, band, source, outcome = key
        if source not in chosen.get(replica, ()):
            continue
        for group in ((replica, band), (None, band)):
            by_outcome = groups.setdefault(group, {})
            by_outcome[outcome] = by_outcome.get(outcome, 0.0) + count
    return {group: BandOutcomes(by_outcome, _health(by_outcome)) for group, by_outcome in groups.items()}
