"""Headroom: seconds until the KV pool is full at the current net growth."""

import math

import pytest

from kvwatch.derive.headroom import finished_total, headroom, kv_growth, mean_finished_tokens

from .factories import sglang, token_histogram, vllm


def at(
    t: float,
    gen: float,
    running: float,
    usage: float = 0.5,
    prompt: float = 0.0,
    finished: float = 0.0,
    **fields,
):
    """vLLM rank at time t: 1000 usable blocks of 16 tokens; usage 0.5 leaves 8000 free token slots."""
    return vllm(
        scraped_at=t,
        generation_tokens_total=gen,
        requests_running=running,
        kv_usage_ratio=usage,
        prompt_tokens_total=prompt,
        finished_requests_total=(("stop", finished), ("length", 0.0)),
        **fields,
    )


def test_growing_batch_fills_the_free_slots_at_running_times_per_sequence_rate():
    # 10 sequences x 10 tokens/s = 100 tokens/s into 8000 free slots -> 80 s
    result = headroom(at(10.0, 1000.0, 10), at(0.0, 0.0, 10))
    assert result.seconds == pytest.approx(80.0)
    assert result.growth.per_sequence_decode == pytest.approx(10.0)
    assert result.note == ""


def test_decode_growth_counts_the_batch_at_its_current_size_and_keeps_growing_it():
    # 1000 tokens over 10 s from a batch that grew 10 -> 30 (mean 20): 5 tokens/s per sequence, 30 now;
    # the batch gains 2 sequences/s, each adding 5 tokens/s: 150 T + (2 x 5) T^2 / 2 = 8000
    result = headroom(at(10.0, 1000.0, 30), at(0.0, 0.0, 10))
    assert result.growth.decode == pytest.approx(150.0)
    assert result.growth.acceleration == pytest.approx(10.0)
    assert result.seconds == pytest.approx((-150 + math.sqrt(150**2 + 4 * 5 * 8000)) / (2 * 5))
    assert 150 * result.seconds + 5 * result.seconds**2 == pytest.approx(8000)


def test_shrinking_batch_does_not_extend_headroom_beyond_the_linear_estimate():
    # 1000 tokens over 10 s from 30 -> 10 sequences (mean 20): 5 tokens/s each, 10 now = 50 tokens/s
    result = headroom(at(10.0, 1000.0, 10), at(0.0, 0.0, 30))
    assert result.growth.batch_growth == 0.0
    assert result.seconds == pytest.approx(8000 / 50)


def test_preemption_since_the_baseline_means_no_headroom():
    result = headroom(at(10.0, 1000.0, 10, preemptions_total=3.0), at(0.0, 0.0, 10, preemptions_total=1.0))
    assert (result.seconds, result.note) == (0.0, "preempting")


def test_admitted_prompts_add_to_growth_unless_switched_off():
    now, before = at(10.0, 1000.0, 10, prompt=400.0), at(0.0, 0.0, 10)
    assert headroom(now, before).seconds == pytest.approx(8000 / 140)
    assert headroom(now, before, include_admissions=False).seconds == pytest.approx(80.0)


def test_completions_free_their_prompt_and_output_tokens():
    hist = {"prompt_tokens": token_histogram(2, 2000.0), "generation_tokens": token_histogram(2, 3000.0)}
    empty = {"prompt_tokens": token_histogram(0, 0.0), "generation_tokens": token_histogram(0, 0.0)}
    now = at(10.0, 1000.0, 10, finished=1.0, histograms=tuple(hist.items()))
    before = at(0.0, 0.0, 11, histograms=tuple(empty.items()))
    assert mean_finished_tokens(now, before) == 2500.0
    result = headroom(now, before)
    # freed: 1 request x 2500 tokens / 10 s = 250 tokens/s
    assert result.growth.freed == pytest.approx(250.0)
    assert result.seconds == math.inf
    assert result.note == "not growing"


def test_completions_without_token_histograms_use_the_mean_allocation_per_running_request():
    now, before = at(10.0, 1000.0, 10, finished=1.0), at(0.0, 0.0, 10)
    # 8000 allocated slots / 10 running = 800 tokens per finished request -> 80 tokens/s freed
    result = headroom(now, before)
    assert result.growth.freed == pytest.approx(80.0)
    assert result.seconds == pytest.approx(8000 / 20)


def test_full_pool_has_no_headroom_whatever_the_rates():
    assert headroom(at(10.0, 0.0, 10, usage=1.0), None).seconds == 0.0
    assert headroom(at(10.0, 0.0, 10, usage=1.0), None).note == "full"


def test_idle_replica_is_not_growing():
    result = headroom(at(10.0, 500.0, 0), at(0.0, 0.0, 5))
    assert (result.seconds, result.note) == (math.inf, "idle")


def test_stalled_decode_is_not_growing():
    assert headroom(at(10.0, 100.0, 10), at(0.0, 100.0, 10)).seconds == math.inf


@pytest.mark.parametrize(
    "before",
    [
        at(0.0, 5000.0, 10),  # generation counter went backwards: engine restarted
        at(0.0, 0.0, 10, finished=50.0),  # finished counter went backwards
        at(0.0, 0.0, 10, prompt=9999.0),
    ],
)
def test_engine_restart_between_samples_gives_unknown_not_safe(before):
    result = headroom(at(10.0, 1000.0, 10, prompt=10.0), before)
    assert result.seconds is None
    assert result.note == "engine restarted between samples"


@pytest.mark.parametrize(
    ("now", "before", "note"),
    [
        (at(10.0, 1000.0, 10), None, "needs two samples"),
        (at(10.0, 1000.0, 10), at(10.0, 0.0, 10), "samples are not in time order"),
        (at(10.0, 1000.0, None), at(0.0, 0.0, 10), "running requests unknown"),
        (at(10.0, None, 10), at(0.0, 0.0, 10), "generation token counter missing"),
        (at(10.0, 1000.0, 10, prompt=None), at(0.0, 0.0, 10), "prompt token counter missing"),
        (vllm(num_gpu_blocks=None), None, "capacity or occupancy unknown"),
    ],
)
def test_missing_inputs_give_unknown_headroom_with_the_reason(now, before, note):
    result = headroom(now, before)
    assert (result.seconds, result.note) == (None, note)


def test_sglang_token_pool_headroom():
    # 100k slots, 60k used; 20 running at 25 tokens/s each = 500 tokens/s -> 80 s
    now = sglang(
        scraped_at=20.0,
        kv_used_tokens=60_000.0,
        requests_running=20.0,
        generation_tokens_total=6000.0,
        prompt_tokens_total=0.0,
    )
    before = sglang(
        scraped_at=10.0,
        kv_used_tokens=55_000.0,
        requests_running=20.0,
        generation_tokens_total=1000.0,
        prompt_tokens_total=0.0,
    )
    assert headroom(now, before).seconds == pytest.approx(80.0)


def test_token_counters_that_move_only_when_requests_finish_give_unknown_not_safe():
    """SGLang's tokenizer counters (before realtime_tokens_total) stand still while requests decode
    and none finishes: headroom read +Inf ("not growing") on a pool filling in 95 s."""
    common = {"requests_running": 8.0, "prompt_tokens_total": 0.0, "token_counters_at_finish": True}
    now = sglang(scraped_at=40.0, kv_used_tokens=84_800.0, generation_tokens_total=1000.0, **common)
    before = sglang(scraped_at=10.0, kv_used_tokens=80_000.0, generation_tokens_total=1000.0, **common)
    result = headroom(now, before)
    assert result.seconds is None and "when requests finish" in result.note


def test_growth_and_finished_helpers():
    assert finished_total(vllm()) is None
    assert finished_total(at(0.0, 0.0, 1, finished=3.0)) == 3.0
    growth, note = kv_growth(at(10.0, 1000.0, 10, prompt=100.0, finished=0.0), at(0.0, 0.0, 10))
    assert (growth.decode, growth.admitted, growth.freed, growth.net, note) == (100.0, 10.0, 0.0, 110.0, "")
