"""compare's layout grid (PP, TP x PP, EP) and its ranking when no candidate meets every SLO."""

from __future__ import annotations

from kvwatch.plan.candidate import Candidate
from kvwatch.plan.compare import BandAttainment, Evaluated, closest, gap_advice, hardware_grid


def test_grid_has_pipeline_and_expert_parallel_layouts():
    dense = hardware_grid(8, "llama-3.1-405b", ("auto",))
    shapes = {(c.tp, c.pp, c.dp) for c in dense}
    assert {(1, 8, 1), (2, 4, 1), (4, 2, 1), (8, 1, 1)} <= shapes
    assert not any(c.expert_parallel for c in dense)
    moe = hardware_grid(8, "deepseek-r1", ("auto",))
    assert any(c.expert_parallel and c.tp == 8 for c in moe)


def _ev(name: str, gpus: int, margin: float) -> Evaluated:
    a = BandAttainment("e2e", "all", 100, 0.9 + margin, 0.9)
    return Evaluated(Candidate(name=name, tp=1, dp=gpus), None, (a,), 1.0, 5)


def test_closest_ranks_by_worst_margin_not_cost():
    cheap_far, dear_near = _ev("cheap", 1, -0.895), _ev("dear", 8, -0.007)
    order = closest([cheap_far, dear_near], {})
    assert [e.candidate.name for e in order] == ["dear", "cheap"]
    advice = "\n".join(gap_advice([cheap_far, dear_near], 8, {}))
    assert "dear misses e2e" in advice and "larger --gpus" in advice and "lower rate" in advice
