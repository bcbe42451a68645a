"""Fit the simulator's step-time model (``sim.steptime.StepCost``) to observed steps. Pure: no I/O.

Each observation is one engine step, or the mean of many (a Prometheus window, a load phase; then
``weight`` is how many steps it stands for)::

    seconds = overhead + prefill_tokens x a + decode_seqs x b + kv_tokens x c

Weighted least squares (numpy ``lstsq``) with every coefficient >= 0: a term whose coefficient
comes out negative is dropped and the rest refitted (an active-set non-negative fit, enough for
four terms). A term no observation varies (``kv_tokens`` unknown, no prefill seen), or that varies
only as the terms before it do (KV tokens equal to prefill tokens when no decode step was seen), is
not fitted and reported as such, so the calibration says which parts of the model the data supported.

Quality: R² (weighted, of the step seconds), and the residuals as relative errors per
observation (median and p90 of ``|predicted - observed| / observed``), over the fitting set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvwatch.sim.steptime import StepCost

TERMS = ("overhead_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s")


@dataclass(frozen=True, slots=True)
class StepObservation:
    """One step (or the mean of ``weight`` steps) as a source saw it."""

    prefill_tokens: float
    decode_seqs: float
    seconds: float
    kv_tokens: float | None = None  # KV tokens the batch holds, where the source knows it
    weight: float = 1.0
    tp: int | None = None  # tensor-parallel degree of the engine that ran the step, where known


@dataclass(frozen=True, slots=True)
class FitQuality:
    observations: int
    steps: float  # sum of weights: how many engine steps the observations stand for
    r2: float | None  # None with fewer observations than fitted terms + 1
    residual_p50: float  # median |predicted - observed| / observed
    residual_p90: float
    rmse_s: float
    fitted_terms: tuple[str, ...]  # terms the data determined
    unfitted_terms: tuple[str, ...]  # terms set to 0: nothing varied them, or they came out negative


@dataclass(frozen=True, slots=True)
class StepFit:
    cost: StepCost
    quality: FitQuality


class FitError(ValueError):
    """Not enough usable observations to fit anything (the message says what is missing)."""


def _design(obs: Sequence[StepObservation]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    kv_known = all(o.kv_tokens is not None for o in obs)
    x = np.array(
        [[1.0, o.prefill_tokens, o.decode_seqs, (o.kv_tokens or 0.0) if kv_known else 0.0] for o in obs],
        dtype=float,
    )
    y = np.array([o.seconds for o in obs], dtype=float)
    w = np.array([o.weight for o in obs], dtype=float)
    return x, y, w


def fit_step_cost(observations: Sequence[StepObservation]) -> StepFit:
    """The non-negative weighted least-squares fit (module doc)."""
    obs = [
        o
        for o in observations
        if o.seconds > 0
        and o.weight > 0
        and math.isfinite(o.seconds)
        and math.isfinite(o.prefill_tokens)
        and math.isfinite(o.decode_seqs)
    ]
    if len(obs) < 2:
        raise FitError(f"{len(obs)} usable step observation(s) (need at least 2 with seconds > 0)")
    x, y, w = _design(obs)
    # a term that never varies is indistinguishable from the overhead, and one that varies only
    # in step with the terms before it (KV tokens = prefill tokens where no decode step was
    # seen) from those: least squares would split one cost between them at random
    active = [0]
    for j in (1, 2, 3):
        if np.ptp(x[:, j]) > 0 and np.linalg.matrix_rank(x[:, [*active, j]]) > len(active):
            active.append(j)
    sw = np.sqrt(w)
    coef = np.zeros(4)
    while True:
        sol, *_ = np.linalg.lstsq(x[:, active] * sw[:, None], y * sw, rcond=None)
        negative = [j for j, c in zip(active, sol, strict=True) if c < 0]
        if not negative:
            coef[active] = sol
            break
        worst = min(negative, key=lambda j: sol[active.index(j)])
        active.remove(worst)
        if not active:
            break
    pred = x @ coef
    rel = np.abs(pred - y) / y
    mean = float(np.average(y, weights=w))
    ss_tot = float(np.sum(w * (y - mean) ** 2))
    ss_res = float(np.sum(w * (y - pred) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 and len(obs) > len(active) else None
    quality = FitQuality(
        observations=len(obs),
        steps=float(w.sum()),
        r2=r2,
        residual_p50=float(np.median(rel)),
        residual_p90=float(np.quantile(rel, 0.9)),
        rmse_s=math.sqrt(float(np.average((y - pred) ** 2, weights=w))),
        fitted_terms=tuple(TERMS[j] for j in active),
        unfitted_terms=tuple(TERMS[j] for j in range(4) if j not in active),
    )
    return StepFit(StepCost(*(float(c) for c in coef)), quality)


def fits_by_tp(observations: Sequence[StepObservation]) -> dict[int | None, StepFit]:
    """One fit per tensor-parallel degree the observations carry (``None``: the degree is unknown).

    A TP=2 step is not a TP=1 step with other coefficients on the same line: it adds all-reduces and
    halves the weight reads, so one fit over both would describe neither. A degree whose observations
    cannot be fitted (fewer than 2) raises FitError naming it.
    """
    groups: dict[int | None, list[StepObservation]] = {}
    for o in observations:
        groups.setdefault(o.tp, []).append(o)
    out: dict[int | None, StepFit] = {}
    for tp in sorted(groups, key=lambda t: -1 if t is None else t):
        try:
            out[tp] = fit_step_cost(groups[tp])
        except FitError as exc:
            if len(groups) == 1:
                raise
            raise FitError(f"TP={'unknown' if tp is None else tp}: {exc}") from None
    return out
