"""What the proxy reads from a request body, the outcome rules, the label folding and the meter."""

from __future__ import annotations

import json

import pytest

from kvwatch import buckets
from kvwatch.model import Outcome
from kvwatch.requests import sse
from kvwatch.requests.accounting import (
    End,
    ModelLabels,
    RequestMeter,
    body_requesting_usage,
    decide_outcome,
    estimate_prompt_tokens,
    inspect_request,
)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"model":"m","stream":true,"max_tokens":100}', ("m", True, 100, False)),
        (b'{"model":"m","stream":true,"max_completion_tokens":50,"max_tokens":9}', ("m", True, 50, False)),
        (b'{"stream":"yes","max_tokens":true}', (None, False, None, False)),
        (b'{"model":7,"max_tokens":-3,"stream_options":{"include_usage":true}}', (None, False, None, True)),
        (b'{"model":"m","max_tokens":0}', ("m", False, None, False)),
        # a null max_completion_tokens is unset: vLLM takes max_tokens (`is not None`)
        (b'{"model":"m","max_completion_tokens":null,"max_tokens":7000}', ("m", False, 7000, False)),
    ],
)
def test_inspect_request(body: bytes, expected: tuple) -> None:
    info = inspect_request(body, "chat")
    assert (info.model, info.streaming, info.max_tokens, info.wants_usage) == expected


@pytest.mark.parametrize("body", [b"not json", b"[1,2]", b"\xff\xfe", b""])
def test_non_object_bodies_are_not_parsed(body: bytes) -> None:
    info = inspect_request(body, "completions")
    assert not info.parsed and body_requesting_usage(body, info) is None


def test_usage_is_requested_by_inserting_text_when_absent() -> None:
    body = b'  {"stream": true, "prompt": "\xc3\xa9"}'
    new = body_requesting_usage(body, inspect_request(body, "completions"))
    assert new == b'  {"stream_options":{"include_usage":true},"stream": true, "prompt": "\xc3\xa9"}'
    assert json.loads(new)["prompt"] == "é"


def test_usage_is_added_to_existing_stream_options() -> None:
    body = b'{"stream": true, "stream_options": {"continuous_usage_stats": false}}'
    new = body_requesting_usage(body, inspect_request(body, "chat"))
    assert json.loads(new)["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    body = b'{"stream": true, "stream_options": null}'
    assert json.loads(body_requesting_usage(body, inspect_request(body, "chat")))["stream_options"] == {
        "include_usage": True
    }


@pytest.mark.parametrize(
    "body",
    [
        b'{"stream": false}',
        b'{"stream": true, "stream_options": {"include_usage": true}}',
        b'{"stream": true, "stream_options": "weird"}',
        b'{"stream": true, "n": 2}',
        # alone it does nothing on a direct connection; with include_usage added the engine would put
        # usage on every chunk the client reads
        b'{"stream": true, "stream_options": {"continuous_usage_stats": true}}',
    ],
)
def test_usage_is_not_requested(body: bytes) -> None:
    assert body_requesting_usage(body, inspect_request(body, "chat")) is None


@pytest.mark.parametrize(
    ("body", "choices"),
    [
        (b'{"stream": true, "prompt": "one"}', 1),
        (b'{"stream": true, "prompt": [1, 2, 3]}', 1),  # one prompt of token ids
        (b'{"stream": true, "prompt": ["a", "b"]}', 2),
        (b'{"stream": true, "prompt": [[1, 2], [3]], "n": 3}', 6),
    ],
)
def test_a_completions_batch_runs_a_sequence_per_prompt_and_choice(body: bytes, choices: int) -> None:
    """vLLM merges a prompt list's outputs into one stream (choice index = prompt x n + i); usage was
    asked for such a stream, and the relay held the first prompt's finish chunk and every later
    event behind it (a 1.3 s stall the client saw, and the meter recorded as a gap)."""
    info = inspect_request(body, "completions")
    assert info.choices == choices
    assert (body_requesting_usage(body, info) is None) == (choices > 1)
    assert inspect_request(body, "chat").choices == (3 if b'"n": 3' in body else 1)  # chat has no prompt list


def test_prompt_estimate_is_a_quarter_of_the_body() -> None:
    assert estimate_prompt_tokens(4000) == 1000


@pytest.mark.parametrize(
    ("status", "end", "finish", "outcome"),
    [
        (200, End.COMPLETE, "stop", Outcome.COMPLETED),
        (200, End.COMPLETE, None, Outcome.COMPLETED),
        (200, End.COMPLETE, "tool_calls", Outcome.COMPLETED),
        (200, End.COMPLETE, "length", Outcome.TRUNCATED),
        (200, End.COMPLETE, "abort", Outcome.ERROR),
        (200, End.CLIENT_GONE, None, Outcome.ABORTED),
        (503, End.CLIENT_GONE, None, Outcome.ABORTED),
        (200, End.UPSTREAM_FAILED, "length", Outcome.ERROR),
        (None, End.UPSTREAM_FAILED, None, Outcome.ERROR),
        (502, End.UPSTREAM_FAILED, None, Outcome.ERROR),
        (500, End.COMPLETE, None, Outcome.ERROR),
        (400, End.COMPLETE, None, Outcome.REJECTED),
        (413, End.COMPLETE, None, Outcome.REJECTED),
        (429, End.COMPLETE, None, Outcome.REJECTED),
    ],
)
def test_outcome_rules(status: int | None, end: End, finish: str | None, outcome: Outcome) -> None:
    assert decide_outcome(status, end, finish) is outcome


def test_model_labels_are_bounded() -> None:
    labels = ModelLabels({"a"}, "b")
    assert [labels.label(m) for m in ("a", "b", "c", None)] == ["a", "b", "other", "b"]
    labels.learn([f"served-{i}" for i in range(100)])
    assert len(labels.known) == 2 + 16 and labels.label("served-99") == "other"


def test_a_single_served_model_becomes_the_default() -> None:
    labels = ModelLabels(set(), None)
    assert labels.label(None) == "other"
    labels.learn(["tiny"])
    assert labels.label(None) == "tiny"


def _meter(streaming: bool = True) -> RequestMeter:
    body = json.dumps({"stream": streaming, "max_tokens": 10}).encode()
    return RequestMeter("r", "m", inspect_request(body, "chat"), 1000.0, 100.0)


def test_meter_bins_gaps_once_per_read_and_zero_gaps_within_a_read() -> None:
    m = _meter()
    content = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    m.on_events(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n', b"\n\n", 100.1)
    m.on_events(content, b"\n\n", 100.5)
    m.on_events(content * 3, b"\n\n", 100.55)
    m.on_events(content, b"\n\n", 101.55)
    finish = b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    m.on_events(finish, b"\n\n", 101.6)
    m.on_end(101.6)
    record = m.record(200, End.COMPLETE)
    bounds = buckets.INTER_CHUNK_SECONDS
    expected = [0] * (len(bounds) + 1)
    expected[0] += 2  # the two extra events in one read
    expected[bounds.index(0.05)] += 1  # 0.05 s lands in le=0.05 (le is inclusive)
    expected[bounds.index(1.0)] += 1
    assert record.gap_counts == tuple(expected)
    assert record.gap_sum == pytest.approx(1.05)
    assert record.ttft_seconds == pytest.approx(0.5)
    assert record.e2e_seconds == pytest.approx(1.6)
    assert (record.chunks, record.output_tokens, record.output_tokens_estimated) == (5, 5, True)
    assert record.finish_reason == "stop" and record.outcome is Outcome.COMPLETED
    assert record.tpot_seconds == pytest.approx(1.1 / 4)


def test_meter_prefers_usage_over_counted_chunks() -> None:
    m = _meter()
    m.on_events(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', b"\n\n", 100.2)
    m.on_usage(sse.Usage(12, 40))
    record = m.record(200, End.COMPLETE)
    assert (record.prompt_tokens, record.output_tokens, record.output_tokens_estimated) == (12, 40, False)
    assert record.gap_counts == ()  # a single chunk has no gap


def test_meter_of_a_failed_request_without_chunks_has_no_token_count() -> None:
    record = _meter().record(502, End.UPSTREAM_FAILED)
    assert (record.outcome, record.output_tokens, record.ttft_seconds) == (Outcome.ERROR, None, None)


CONTENT = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'


def test_meter_keeps_the_longest_gap_and_when_it_ended_in_the_wall_time_base() -> None:
    m = _meter()  # received at t0 = 100.0 (the duration clock) = 1000.0 (wall clock)
    for now in (100.5, 100.6, 103.6, 103.7, 104.7):  # gaps 0.1, 3.0, 0.1, 1.0
        m.on_events(CONTENT, b"\n\n", now)
    m.on_end(104.8)
    record = m.record(200, End.COMPLETE)
    assert record.max_gap_seconds == pytest.approx(3.0)
    assert record.max_gap_ended_at == pytest.approx(1003.6)  # started_at + (103.6 - t0)


def test_meter_with_all_chunks_in_one_write_has_a_zero_longest_gap() -> None:
    m = _meter()
    m.on_events(CONTENT * 3, b"\n\n", 100.5)
    m.on_end(100.6)
    record = m.record(200, End.COMPLETE)
    assert (record.max_gap_seconds, record.max_gap_ended_at) == (0.0, pytest.approx(1000.5))


@pytest.mark.parametrize("reads", [[], [CONTENT]])
def test_meter_without_a_gap_measures_no_longest_gap(reads: list[bytes]) -> None:
    m = _meter()
    for data in reads:
        m.on_events(data, b"\n\n", 100.5)
    m.on_end(100.6)
    record = m.record(200, End.COMPLETE)
    assert (record.max_gap_seconds, record.max_gap_ended_at) == (None, None)


def test_non_streaming_request_measures_no_longest_gap() -> None:
    m = _meter(streaming=False)
    m.on_json_body(b'{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}]}')
    m.on_end(100.3)
    record = m.record(200, End.COMPLETE)
    assert (record.max_gap_seconds, record.max_gap_ended_at) == (None, None)
