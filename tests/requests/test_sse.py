"""The content-bearing definition and the other byte-level reads of OpenAI event streams."""

from __future__ import annotations

import json

import pytest

from kvwatch.requests import sse


def event(doc: dict, spaces: bool = False) -> bytes:
    text = json.dumps(doc) if spaces else json.dumps(doc, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


def chat(delta: dict, finish: str | None = None) -> dict:
    return {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


CONTENT_BEARING = {
    "chat content": chat({"content": "Hi"}),
    "chat content that is one quote": chat({"content": '"'}),
    "chat content that is a backslash": chat({"content": "\\"}),
    "reasoning (vLLM >= 0.11)": chat({"reasoning": "hmm"}),
    "reasoning_content (older vLLM, SGLang)": chat({"reasoning_content": "hmm"}),
    "tool call delta": chat({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ""}}]}),
    "completions text": {
        "object": "text_completion",
        "choices": [{"index": 0, "text": " a", "finish_reason": None}],
    },
    "second choice carries the text": {
        "choices": [{"index": 0, "delta": {"content": ""}}, {"index": 1, "delta": {"content": "b"}}]
    },
}

NOT_CONTENT = {
    "role chunk with empty content": chat({"role": "assistant", "content": ""}),
    "null content": chat({"content": None}),
    "empty delta finish chunk": chat({}, "stop"),
    "empty content finish chunk": chat({"content": ""}, "length"),
    "completions finish with empty text": {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
    "usage chunk": {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}},
    "empty tool call list": chat({"tool_calls": []}),
    "text that mentions a content key": chat({"role": "assistant", "content": ""})
    | {"note": 'she wrote "content":"x" here'},
    "logprobs content list without delta text": {
        "choices": [{"delta": {"content": ""}, "logprobs": {"content": [{"token": "a"}]}}]
    },
}


@pytest.mark.parametrize("doc", CONTENT_BEARING.values(), ids=CONTENT_BEARING.keys())
@pytest.mark.parametrize("spaces", [False, True], ids=["compact", "json.dumps spacing"])
def test_content_bearing(doc: dict, spaces: bool) -> None:
    assert sse.is_content_bearing(event(doc, spaces))


@pytest.mark.parametrize("doc", NOT_CONTENT.values(), ids=NOT_CONTENT.keys())
@pytest.mark.parametrize("spaces", [False, True], ids=["compact", "json.dumps spacing"])
def test_not_content_bearing(doc: dict, spaces: bool) -> None:
    assert not sse.is_content_bearing(event(doc, spaces))


def test_the_compact_search_decides_as_the_regex_does() -> None:
    """``is_content_bearing`` tries a bytes search for ``"content":"`` before the regex: on every
    event, including ones built around that marker (at the end, before a quote, twice), both agree."""
    import random

    rng = random.Random(23)
    pieces = [
        b'"content":"',
        b'"content":""',
        b'"',
        b"x",
        b"\\",
        b"\n",
        b'"text":"a"',
        b":",
        b" ",
        b'"tool_calls":[{',
        b"}",
        b"\n\n",
    ]
    cases = [
        event(doc, spaces)
        for doc in (*CONTENT_BEARING.values(), *NOT_CONTENT.values())
        for spaces in (False, True)
    ]
    cases += [
        b'"content":"',
        b'"content":""',
        b'"content":"""',
        b'"content":""x"content":"y',
        b'"content":"" "text":"b"',
        b'x"content":"\n',
    ]
    cases += [b"".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12))) for _ in range(5000)]
    for case in cases:
        assert sse.is_content_bearing(case) is (sse.CONTENT.search(case) is not None), case


def test_done_and_comments_are_not_content() -> None:
    assert not sse.is_content_bearing(b"data: [DONE]\n\n")
    assert not sse.is_content_bearing(b": keep-alive\n\n")


def test_counting_content_events_in_one_read() -> None:
    events = (
        event(chat({"role": "assistant", "content": ""}))
        + event(chat({"content": "a"}))
        + event(chat({"content": "b"}))
        + event(chat({}, "stop"))
    )
    assert sse.count_content_events(events, b"\n\n") == 2
    crlf = events.replace(b"\n\n", b"\r\n\r\n")
    assert sse.count_content_events(crlf, b"\r\n\r\n") == 2


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        (event(chat({"content": "a"})), None),
        (event(chat({}, "stop")), "stop"),
        (event(chat({}, "tool_calls"), spaces=True), "tool_calls"),
        (event({"choices": [{"finish_reason": "length"}, {"finish_reason": "stop"}]}), "length"),
        (event({"choices": [{"finish_reason": "stop"}, {"finish_reason": "abort"}]}), "abort"),
    ],
)
def test_finish_reason(events: bytes, expected: str | None) -> None:
    assert sse.finish_reason(events) == expected


def test_usage_is_found_in_a_usage_only_chunk() -> None:
    content = event(chat({"content": "a"}))
    usage = event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}})
    assert sse.find_usage(content + usage + b"data: [DONE]\n\n", b"\n\n") == sse.Usage(7, 3)
    assert sse.is_usage_only(usage.removesuffix(b"\n\n"))


def test_usage_riding_on_a_content_chunk_is_found_but_is_not_usage_only() -> None:
    both = event(
        {"choices": [{"delta": {"content": "x"}}], "usage": {"prompt_tokens": 1, "completion_tokens": 5}}
    )
    assert sse.find_usage(both, b"\n\n") == sse.Usage(1, 5)
    assert not sse.is_usage_only(both)


def test_null_usage_is_not_usage() -> None:
    chunk = event(chat({"content": "x"}) | {"usage": None})
    assert sse.find_usage(chunk, b"\n\n") is None


def test_malformed_usage_json_is_ignored() -> None:
    assert sse.find_usage(b'data: {"choices":[],"usage":{"completion_tokens":\n\n', b"\n\n") is None


def test_usage_from_a_whole_response() -> None:
    body = json.dumps(
        {
            "choices": [{"message": {"content": "x"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4},
        }
    ).encode()
    assert sse.usage_from_body(body) == (sse.Usage(3, 4), "length")
    assert sse.usage_from_body(b"[1, 2]") == (None, None)
    assert sse.usage_from_body(b"{not json") == (None, None)


def test_fields_vllm_moves_to_the_usage_chunk_go_back_on_the_final_chunk() -> None:
    usage = event({"choices": [], "usage": {"completion_tokens": 3}, "system_fingerprint": "fp-1"})
    final = event(chat({"content": "x"}, "stop")).removesuffix(b"\n\n")
    moved = sse.moved_fields(usage)
    assert moved == [(b"system_fingerprint", b'"fp-1"')]
    assert sse.with_fields(final, moved) == final[:-1] + b',"system_fingerprint":"fp-1"}'
    already = final[:-1] + b',"system_fingerprint":null}'
    assert sse.with_fields(already, moved) == already  # never a duplicate key
