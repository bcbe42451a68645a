"""``kvwatch plan calibrate --load``: what a decode phase's streams say the step was
(``kvwatch/plan/sources.py``), and the fit it makes of a whole load against an engine whose step
cost is known: kvwatch's simulated vLLM, which, like vLLM when its frontend falls behind, folds the
tokens of several steps into one chunk.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics

import pytest

from kvwatch.plan import sources
from kvwatch.plan.fit import fit_step_cost
from kvwatch.plan.sources import NOT_READ, StreamRead, calibration_load, decode_observations
from kvwatch.sim.engine import EngineConfig
from kvwatch.sim.models import model_preset
from kvwatch.sim.node import NodeConfig, SimNode, serving_in_thread
from kvwatch.sim.steptime import StepCost

STEP_S = 0.005


def _stream(start: float, tokens: int, step_s: float = STEP_S, prompt: int = 100, **reads) -> StreamRead:
    """A stream as ``_stream`` reads it: one chunk a step from ``start``, the engine's count of
    tokens at each. ``stall=(first, last)``: the client read tokens first..last all at once, when
    the last arrived. ``fold=n``: the engine sent n tokens a chunk."""
    fold = reads.get("fold", 1)
    made = [(start + (n - 1) * step_s, n) for n in range(1, tokens + 1) if n % fold == 0 or n == 1]
    if "stall" in reads:
        first, last = reads["stall"]
        until = start + (last - 1) * step_s
        made = [(until if first <= n <= last else t, n) for t, n in made]
    return StreamRead(
        sent=start - 0.01,
        chunks=tuple(t for t, _ in made),
        generated=tuple(n for _, n in made),
        usage={"prompt_tokens": prompt, "completion_tokens": tokens},
    )


def test_a_stalled_client_reads_a_burst_but_the_step_holds():
    # the client was descheduled for 40 steps and read them microseconds apart: most chunk gaps
    # are ~0, so their median says nothing of the step; the span over the tokens does
    heavier = [_stream(0.0, 96, stall=(10, 80)) for _ in range(2)]
    gaps = [b - a for s in heavier for a, b in itertools.pairwise(s.chunks)]
    assert statistics.median(gaps) == 0  # ... but at 70 of 95 the median gap is 0
    (obs,) = decode_observations(heavier)
    assert obs.seconds == pytest.approx(STEP_S)
    assert obs.decode_seqs == 2 and obs.weight == pytest.approx(95)


def test_tokens_folded_into_chunks_count_as_the_steps_they_took():
    (obs,) = decode_observations([_stream(0.0, 96, fold=4) for _ in range(3)])
    assert obs.seconds == pytest.approx(STEP_S)
    assert obs.decode_seqs == 3
    # without the engine's counts each chunk is one token: four steps a chunk
    bare = [dataclasses.replace(_stream(0.0, 96, fold=4), generated=()) for _ in range(3)]
    (guess,) = decode_observations(bare)
    assert guess.seconds == pytest.approx(4 * STEP_S, rel=0.05)


def test_only_the_window_where_every_stream_decodes_counts():
    # one stream starts 30 steps late: before it joined, the batch held one sequence
    early, late = _stream(0.0, 96, step_s=0.004), _stream(30 * 0.004, 96, step_s=0.004)
    (obs,) = decode_observations([early, late])
    assert obs.decode_seqs == 2 and obs.seconds == pytest.approx(0.004)
    assert obs.weight == pytest.approx(95 - 30)  # the steps the two shared
    assert obs.kv_tokens == pytest.approx(2 * 100 + (31 + 96) / 2 + (1 + 66) / 2)


def test_streams_that_never_decode_together_say_nothing():
    assert decode_observations([_stream(0.0, 20), _stream(1.0, 20)]) == []
    assert decode_observations([_stream(0.0, 96), NOT_READ]) == []  # a request that failed
    # seven shared steps are too few
    assert decode_observations([_stream(0.0, 20), _stream(12 * STEP_S, 20)]) == []


def test_a_window_that_is_mostly_a_burst_is_dropped():
    # both streams' chunks from 0.35 s to 0.445 s were read at 0.445 s: the late one's first chunk
    # among them, so the window opens in the burst and holds 91 tokens read over 60 ms
    stalled = _stream(0.0, 96, stall=(30, 90))
    late = _stream(0.445 - 19 * STEP_S, 40, stall=(1, 20))
    assert decode_observations([stalled, late]) == []
    # a starved frontend sent a lone stream's 96 tokens within a millisecond, at the end
    lone = _stream(0.0, 96, stall=(1, 96))
    assert lone.chunks[-1] - lone.chunks[0] < 1e-3
    assert decode_observations([lone]) == []


#: the simulated engine's step, in simulated seconds; the node runs at SPEED and ticks every TICK_S
TRUE = StepCost(overhead_s=0.020, per_prefill_token_s=0.0004, per_decode_seq_s=0.004, per_kv_token_s=0.0)
SPEED, TICK_S = 4.0, 0.02


def _known_engine() -> SimNode:
    """One simulated vLLM replica stepping at ``TRUE``, served as ``tiny``."""
    engine = EngineConfig(
        model=model_preset("llama-3.1-8b"), max_model_len=4000, max_num_seqs=16, step_cost=TRUE
    )
    return SimNode(
        NodeConfig(engine=engine, replicas=1, speed=SPEED, tick_s=TICK_S, served_model_name="tiny")
    )


def test_the_load_fit_recovers_a_known_step_cost_through_folded_chunks():
    """The simulated vLLM sends what one 20 ms tick made as one chunk, two to four 6-11 ms decode
    steps, as vLLM folds tokens when its frontend falls behind: a median chunk gap measured the
    tick. The fit must keep the per-step overhead, the cost per sequence and per prefill token (a
    lone prefill's first token reaches the client at the first tick after its step ends, up to a
    tick late, as a frontend's latency would)."""
    with serving_in_thread(_known_engine()) as urls:
        obs = calibration_load(
            urls[0],
            "tiny",
            prompt_sizes=(16, 512, 1536),
            concurrencies=(1, 3, 6),
            long_context=((1, 800), (2, 800)),
            decode_tokens=48,
        )
    prefill = [o for o in obs if not o.decode_seqs]
    decode = [o for o in obs if o.decode_seqs]
    assert len(prefill) == 6 and all(o.weight == 1 for o in prefill)
    for o in prefill:  # never before the step's end, at most a tick after it
        true = TRUE.seconds(int(o.prefill_tokens), 0, 0)
        assert true <= o.seconds * SPEED <= true + TICK_S * SPEED * 1.5
    assert [o.decode_seqs for o in decode] == [1, 3, 6, 1, 2]
    for o in decode:
        assert o.seconds * SPEED == pytest.approx(TRUE.seconds(0, int(o.decode_seqs), 0), rel=0.15)
        assert o.weight > 20
    fit = fit_step_cost(obs)
    assert fit.cost.overhead_s * SPEED == pytest.approx(TRUE.overhead_s, rel=0.25)
    assert fit.cost.per_decode_seq_s * SPEED == pytest.approx(TRUE.per_decode_seq_s, rel=0.25)
    assert fit.cost.per_prefill_token_s * SPEED == pytest.approx(TRUE.per_prefill_token_s, rel=0.25)
    assert fit.cost.per_kv_token_s * SPEED < 1e-6


def test_a_phase_that_gives_nothing_runs_again(monkeypatch: pytest.MonkeyPatch):
    """A frontend starved for a moment spoils one run of a phase (a burst); the load runs it again,
    up to three times, rather than fit the cost per sequence from fewer phases."""
    runs: list[int] = []
    real_phase = sources.decode_phase

    def starved_at_first(*args, **kwargs):
        c = args[2]
        runs.append(c)
        if c == 3 and runs.count(3) < 3:  # the 3-stream phase is spoilt twice, then runs clean
            return [_stream(0.0, 48, stall=(1, 48)) for _ in range(3)]
        if c == 6:  # the 6-stream phase never runs clean
            return [_stream(0.0, 48, stall=(1, 48)) for _ in range(6)]
        return real_phase(*args, **kwargs)

    monkeypatch.setattr(sources, "decode_phase", starved_at_first)
    with serving_in_thread(_known_engine()) as urls:
        obs = calibration_load(
            urls[0], "tiny", prompt_sizes=(), concurrencies=(1, 3, 6), long_context=(), decode_tokens=48
        )
    assert runs == [1, 3, 3, 3, 6, 6, 6]
    assert [o.decode_seqs for o in obs] == [1, 3]
