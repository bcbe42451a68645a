"""Workload generation and trace replay (kvwatch/sim/workload.py)."""

from __future__ import annotations

import itertools
import statistics

import pytest

from kvwatch.sim.workload import (
    REASONING,
    Burst,
    LengthDist,
    Patience,
    TraceError,
    WorkloadSpec,
    generate,
    load_trace,
)


def test_reasoning_outputs_exceed_5000_tokens_45_percent_of_the_time():
    # sd of the estimate on 100k samples is ~0.0016, so +-0.02 is >10 sigma: a wrong mean fails
    draw = REASONING.output.sampler(__import__("random").Random(7))
    samples = [draw() for _ in range(100_000)]
    share = sum(s > 5000 for s in samples) / len(samples)
    assert share == pytest.approx(0.45, abs=0.02)
    assert max(samples) == 32_000 and min(samples) >= 1


def test_reasoning_prompts_are_clipped_lognormal_around_1000_tokens():
    draw = REASONING.prompt.sampler(__import__("random").Random(3))
    samples = [draw() for _ in range(50_000)]
    assert min(samples) >= 100 and max(samples) <= 5000
    assert statistics.fmean(samples) == pytest.approx(1000, rel=0.05)
    assert statistics.median(samples) < statistics.fmean(samples)  # right-skewed


def test_lognormal_from_quantiles_reproduces_the_median_and_p90():
    dist = LengthDist.lognormal_from_quantiles(129, 424)  # Azure 2023 conversation outputs
    draw = dist.sampler(__import__("random").Random(1))
    samples = sorted(draw() for _ in range(40_000))
    assert samples[len(samples) // 2] == pytest.approx(129, rel=0.05)
    assert samples[int(0.9 * len(samples))] == pytest.approx(424, rel=0.05)


def test_poisson_arrivals_have_the_configured_rate():
    reqs = list(generate(WorkloadSpec(rate=5.0, seed=2), duration=2000))
    assert len(reqs) / 2000 == pytest.approx(5.0, rel=0.03)
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(reqs)]
    # exponential gaps: the coefficient of variation is 1
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)


def test_burst_windows_multiply_the_rate():
    spec = WorkloadSpec(rate=2.0, bursts=(Burst(1000, 2000, 4.0),), seed=5)
    reqs = list(generate(spec, duration=3000))
    inside = sum(1 for r in reqs if 1000 <= r.arrival < 2000)
    outside = len(reqs) - inside
    assert inside / 1000 == pytest.approx(8.0, rel=0.06)
    assert outside / 2000 == pytest.approx(2.0, rel=0.06)


def test_same_seed_same_workload_and_another_seed_another():
    a = list(generate(WorkloadSpec(seed=11), count=200))
    b = list(generate(WorkloadSpec(seed=11), count=200))
    c = list(generate(WorkloadSpec(seed=12), count=200))
    assert a == b and a != c


def test_requests_carry_class_budget_prefix_and_patience():
    spec = WorkloadSpec.profile("mixed", patience=Patience(first_token_s=30, total_s=600), seed=4)
    reqs = list(generate(spec, count=2000))
    classes = {r.klass for r in reqs}
    assert classes == {"chat", "reasoning"}
    assert all(r.max_tokens == (2048 if r.klass == "chat" else 16384) for r in reqs)
    assert all(
        r.prefix_id == f"system-{r.klass}" and r.prefix_tokens == 250 for r in reqs if r.prompt_tokens >= 250
    )
    assert all(r.first_token_patience == 30 and r.total_patience == 600 for r in reqs)
    share = sum(r.klass == "chat" for r in reqs) / len(reqs)
    assert share == pytest.approx(0.6, abs=0.04)


def test_exponential_patience_varies_per_client():
    reqs = list(generate(WorkloadSpec(patience=Patience(60, distribution="exponential"), seed=1), count=5000))
    values = [r.first_token_patience for r in reqs]
    assert statistics.fmean(values) == pytest.approx(60, rel=0.06) and len(set(values)) > 4000


def test_generate_needs_a_stopping_rule_and_profiles_are_named():
    with pytest.raises(ValueError, match="count= or duration="):
        list(generate(WorkloadSpec()))
    with pytest.raises(ValueError, match="reasoning"):
        WorkloadSpec.profile("batch")


# ------------------------------------------------------------------------------------ traces


def test_azure_trace_replays_relative_arrivals_and_lengths(tmp_path):
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:51.0000000,879,0\n"
    )
    trace = load_trace(path)
    assert trace.format == "azure" and trace.skipped == 1
    first, second = trace.requests
    assert (first.arrival, first.prompt_tokens, first.output_tokens, first.max_tokens) == (0.0, 374, 44, 44)
    assert second.arrival == pytest.approx(4.314579, abs=1e-5)


def test_burstgpt_trace_skips_failed_requests(tmp_path):
    path = tmp_path / "BurstGPT_1.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "9,GPT-4,140,312,452,API log\n"
    )
    trace = load_trace(path, max_tokens=4096, time_scale=0.5)
    assert trace.format == "burstgpt" and trace.skipped == 1
    assert [(r.arrival, r.prompt_tokens, r.output_tokens, r.max_tokens) for r in trace.requests] == [
        (0.0, 472, 18, 4096),
        (2.0, 140, 312, 4096),
    ]


def test_mooncake_jsonl_trace_uses_millisecond_timestamps(tmp_path):
    path = tmp_path / "conversation_trace.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [0, 1]}\n'
        '{"timestamp": 1500, "input_length": 6472, "output_length": 26, "hash_ids": [0, 2]}\n'
    )
    trace = load_trace(path, patience=Patience(first_token_s=10))
    assert trace.format == "mooncake"
    assert [r.arrival for r in trace.requests] == [0.0, 1.5]
    assert trace.requests[1].prompt_tokens == 6472 and trace.requests[1].first_token_patience == 10


def test_unknown_csv_header_names_the_expected_columns(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("time,prompt,completion\n1,2,3\n")
    with pytest.raises(TraceError) as err:
        load_trace(path)
    message = str(err.value)
    assert "TIMESTAMP,ContextTokens,GeneratedTokens" in message
    assert "Request tokens" in message and "input_length" in message and "mine.csv" in message


def test_bad_row_names_the_file_line_and_column(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12,3\n2023-11-16 18:15:47,lots,3\n"
    )
    with pytest.raises(TraceError, match=r"azure.csv line 3: 'ContextTokens' is not a number: 'lots'"):
        load_trace(path)


def test_infinite_length_is_a_bad_row_not_a_crash(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 5}\n'
        '{"timestamp": 1, "input_length": 1e999, "output_length": 5}\n'
    )
    with pytest.raises(TraceError, match=r"t.jsonl line 2: 'input_length' is not a number: inf"):
        load_trace(path)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("b.csv", "Timestamp,Model,Request tokens,Response tokens\n5,x,9,9\nnan,x,9,9\n", "Timestamp 'nan'"),
        ("b.csv", "Timestamp,Model,Request tokens,Response tokens\n5,x,9,9\ninf,x,9,9\n", "Timestamp 'inf'"),
        ("m.jsonl", '{"timestamp": 1e999, "input_length": 5, "output_length": 5}\n', "timestamp inf"),
        ("m.jsonl", '{"timestamp": NaN, "input_length": 5, "output_length": 5}\n', "timestamp nan"),
        ("m.jsonl", '{"timestamp": true, "input_length": 5, "output_length": 5}\n', "timestamp True"),
    ],
)
def test_a_time_no_request_can_arrive_at_is_a_bad_row(tmp_path, name, text, message):
    # float() took nan and inf: a request arriving at NaN or infinity was replayed (never arriving)
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_bad_jsonl_line_is_reported(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 5}\n{"timestamp": 1, "input_len": 5}\n'
    )
    with pytest.raises(TraceError, match=r"line 2: missing \['input_length', 'output_length'\]"):
        load_trace(path)


def test_missing_or_empty_trace_is_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "nope.csv")
    (tmp_path / "empty.csv").write_text("\n")
    with pytest.raises(TraceError, match="is empty"):
        load_trace(tmp_path / "empty.csv")
