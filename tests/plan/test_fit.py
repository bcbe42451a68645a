import random

import pytest

from kvwatch.plan.fit import FitError, StepObservation, fit_step_cost
from kvwatch.sim.steptime import StepCost

from .helpers import TRUE_COST


def _observations(cost: StepCost, n: int, noise: float, seed: int = 0, kv: bool = True):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prefill = rng.choice([0, 0, 0, rng.randint(1, 2048)])
        seqs = rng.randint(0 if prefill else 1, 8)
        kv_tokens = seqs * rng.randint(50, 900) + prefill
        seconds = cost.seconds(prefill, seqs, kv_tokens if kv else 0) * (1 + rng.gauss(0, noise))
        out.append(StepObservation(prefill, seqs, seconds, kv_tokens if kv else None))
    return out


def test_fit_recovers_known_coefficients_from_noisy_steps():
    fit = fit_step_cost(_observations(TRUE_COST, 2000, 0.03))
    c = fit.cost
    assert c.overhead_s == pytest.approx(TRUE_COST.overhead_s, rel=0.1)
    assert c.per_prefill_token_s == pytest.approx(TRUE_COST.per_prefill_token_s, rel=0.05)
    assert c.per_decode_seq_s == pytest.approx(TRUE_COST.per_decode_seq_s, rel=0.1)
    assert c.per_kv_token_s == pytest.approx(TRUE_COST.per_kv_token_s, rel=0.1)
    assert fit.quality.r2 > 0.95
    assert 0.01 < fit.quality.residual_p50 < 0.04  # the 3 % noise shows in the residuals
    assert fit.quality.observations == 2000 and fit.quality.unfitted_terms == ()


def test_without_kv_tokens_that_term_is_reported_unfitted():
    fit = fit_step_cost(_observations(StepCost(0.004, 20e-6, 0.0015), 300, 0.0, kv=False))
    assert fit.quality.unfitted_terms == ("per_kv_token_s",)
    assert fit.cost.per_kv_token_s == 0
    assert fit.cost.per_decode_seq_s == pytest.approx(0.0015, rel=1e-6)
    assert fit.quality.r2 == pytest.approx(1.0)


def test_a_coefficient_that_would_be_negative_is_dropped_not_exported():
    # seconds fall with prefill tokens in this (nonsense) data: a negative cost must not reach the twin
    obs = [StepObservation(p, 4, 0.02 - p * 1e-6) for p in range(0, 2000, 100)]
    fit = fit_step_cost(obs)
    assert fit.cost.per_prefill_token_s == 0 and "per_prefill_token_s" in fit.quality.unfitted_terms
    assert min(fit.cost.overhead_s, fit.cost.per_decode_seq_s) >= 0


def test_too_few_observations_is_an_error_that_says_so():
    with pytest.raises(FitError, match="1 usable step observation"):
        fit_step_cost([StepObservation(0, 1, 0.01), StepObservation(0, 1, 0.0)])


def test_kv_tokens_that_only_repeat_the_prefill_tokens_are_not_fitted():
    # a calibration load whose decode phases all failed: each prefill's KV tokens are its prompt,
    # and least squares split the prefill cost between the two terms (0.089 ms each, from 0.18 ms)
    cost = StepCost(0.004, 180e-6, 0.0)
    obs = [StepObservation(p, 0, cost.seconds(p, 0, p), kv_tokens=p) for p in (11, 257, 778, 1556)]
    fit = fit_step_cost(obs)
    assert fit.quality.unfitted_terms == ("per_decode_seq_s", "per_kv_token_s")
    assert fit.cost.per_prefill_token_s == pytest.approx(180e-6, rel=1e-6)
    assert fit.cost.overhead_s == pytest.approx(0.004, rel=1e-6)
