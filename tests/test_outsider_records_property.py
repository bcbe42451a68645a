"""Records from outside, one field at a time made hostile: whatever value replaces whatever field, each
reader returns or raises its own error (a ValueError), and what it returns can be stored: the
ledger line encodes, and the request can be counted.

Each case starts from a record as the engine or client writes it, then hypothesis replaces values
anywhere in it (or drops keys) with JSON of any type: huge and negative integers, NaN and
Infinity (which ``json.loads`` accepts), nesting, strings where numbers go. The hand-written
hostile cases live beside each source (``tests/requests/test_absurd_counts.py``, ...); this finds
the ones nobody thought of.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from kvwatch.config import Config
from kvwatch.discovery.pods import judge_pod
from kvwatch.engines.llamacpp import SlotsError, apply_slots, parse_slots
from kvwatch.export.plugin import PluginCollector
from kvwatch.export.requests import RequestCollector
from kvwatch.model import DEFAULT_BANDS, RequestRecord
from kvwatch.requests.accounting import body_requesting_usage, inspect_request
from kvwatch.requests.ledger import ledger_line
from kvwatch.requests.otlp import records_from_export
from kvwatch.requests.sglang_files import line_record
from kvwatch.requests.sse import read_usage_event, usage_from_body
from kvwatch.requests.vllm_plugin import DatagramError, decode
from kvwatch.state import NodeState
from tests.discovery.fake_apiserver import make_pod, pod_conditions, vllm_container
from tests.engines.helpers import LLAMACPP_TINY, only, page
from tests.hostile import hostile
from tests.requests.otlp_spans import TOKENS, model_labels, one_replica, span_export

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _stored(record: RequestRecord) -> None:
    """What every request source's record goes through: the ledger's line, the request counters and
    histograms, and their /metrics area."""
    json.dumps(ledger_line(record, DEFAULT_BANDS), allow_nan=False)
    state = NodeState("node", DEFAULT_BANDS)
    state.requests.observe(record)
    registry = CollectorRegistry()
    registry.register(RequestCollector(state, Config()))
    generate_latest(registry)


SGLANG_LINE = {
    "rid": "a1",
    "meta_info": {
        "completion_tokens": 40,
        "prompt_tokens": 4,
        "e2e_latency": 1.5,
        "queue_time": 0.01,
        "decode_throughput": 30.0,
        "request_received_ts": 1.7e9,
        "finish_reason": {"type": "length", "length": 40},
    },
    "request_parameters": json.dumps({"sampling_params": {"max_new_tokens": 40}}),
}


@SETTINGS
@given(hostile(SGLANG_LINE))
def test_sglang_file_line(doc: Any) -> None:
    try:
        record = line_record(doc, "r0", "tiny", now=1.7e9)
    except ValueError:
        return
    _stored(record)


PLUGIN_DATAGRAM = {
    "v": 1,
    "e": 0,
    "t": 1.7e9,
    "p": 1,
    "n": 1,
    "d": 0,
    "s": [{"run": 2, "wait": 0, "kv": 0.5, "it": [1, 64, 1, 1, 2.0]}],
    "f": [
        {
            "reason": "stop",
            "prompt": 3,
            "output": 12,
            "preemptions": 0,
            "e2e": 1.0,
            "decode": 0.5,
            "ttft": 0.2,
        }
    ],
}


@SETTINGS
@given(hostile(PLUGIN_DATAGRAM))
def test_vllm_plugin_datagram(doc: Any) -> None:
    try:
        decoded = decode(json.dumps(doc).encode(), "r0", "tiny")
    except DatagramError:
        return
    for record in decoded.records:
        _stored(record)
    state = NodeState("node", DEFAULT_BANDS)  # what the receiver does with the steps, then /metrics
    for step in decoded.steps or (None,):
        state.plugin.observe(decoded.link, step)
    registry = CollectorRegistry()
    registry.register(PluginCollector(state, Config()))
    generate_latest(registry)


OTLP_ATTRIBUTES = {
    TOKENS: 12,
    "gen_ai.usage.prompt_tokens": 3,
    "gen_ai.request.max_tokens": 64,
    "gen_ai.latency.e2e": 1.0,
    "gen_ai.latency.time_to_first_token": 0.2,
    "gen_ai.latency.time_in_queue": 0.01,
    "gen_ai.response.finish_reasons": '["stop"]',
}
#: what an OTLP attribute can hold (AnyValue: string, bool, int64, double, array)
OTLP_VALUES = (
    st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["[" * 5000, '["stop","length"]', "[1]", "null"])
    | st.lists(st.text(max_size=6) | st.integers(-5, 5), max_size=3)
)


@SETTINGS
@given(st.dictionaries(st.sampled_from(sorted(OTLP_ATTRIBUTES)), OTLP_VALUES, max_size=4), st.data())
def test_otlp_span(changed: dict[str, Any], data: st.DataObject) -> None:
    attrs = {**OTLP_ATTRIBUTES, **changed}
    for key in data.draw(st.lists(st.sampled_from(sorted(attrs)), max_size=2)):
        attrs.pop(key, None)
    records, _ = records_from_export(span_export({}, **attrs), one_replica(), model_labels())
    for record in records:
        _stored(record)


SLOTS = json.loads(page("llamacpp_slots_2026_two_slots.json"))
TINY = only(LLAMACPP_TINY)


@SETTINGS
@given(hostile(SLOTS, changes=4))
def test_llamacpp_slots(doc: Any) -> None:
    try:
        slots = parse_slots(json.dumps(doc))
    except SlotsError:
        return
    sample = apply_slots(TINY, slots)
    for value in (
        sample.kv_capacity_tokens,
        sample.kv_used_tokens,
        sample.live_tokens,
        sample.kv_usage_ratio,
    ):
        assert value is None or value >= 0


CHAT_REQUEST = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 64,
    "stream_options": {"include_usage": False, "continuous_usage_stats": False},
    "n": 1,
}


@SETTINGS
@given(hostile(CHAT_REQUEST))
def test_proxy_request_body(doc: Any) -> None:
    body = json.dumps(doc).encode()
    info = inspect_request(body, "chat")
    changed = body_requesting_usage(body, info)
    if changed is not None:
        sent = json.loads(changed)
        assert sent["stream_options"]["include_usage"] is True
        assert {k: v for k, v in sent.items() if k != "stream_options"} == {
            k: v for k, v in doc.items() if k != "stream_options"
        }


USAGE_CHUNK = {
    "id": "c1",
    "object": "chat.completion.chunk",
    "choices": [],
    "usage": {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15},
    "system_fingerprint": "fp",
}
CHAT_RESPONSE = {
    "id": "c1",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15},
}


@SETTINGS
@given(hostile(USAGE_CHUNK), hostile(CHAT_RESPONSE))
def test_usage_chunk_and_response_body(chunk: Any, response: Any) -> None:
    usage, _ = read_usage_event(b"data: " + json.dumps(chunk, separators=(",", ":")).encode())
    for read in (usage, usage_from_body(json.dumps(response).encode())[0]):
        if read is not None:
            assert read.prompt_tokens is None or read.prompt_tokens >= 0
            assert read.completion_tokens is None or read.completion_tokens >= 0


POD = make_pod(
    "qwen-0",
    annotations={"kvwatch.io/port": "8100", "kvwatch.io/path": "/metrics", "kvwatch.io/model": "qwen"},
    containers=[vllm_container(8100)],
)
POD["status"].update(phase="Running", podIP="10.1.2.3", conditions=pod_conditions(True))


@SETTINGS
@given(hostile(POD, changes=4))
def test_pod_object(pod: Any) -> None:
    """judge_pod never raises; an engine it finds has a URL httpx takes, on a port a socket can have."""
    engine = judge_pod(pod).engine
    if engine is not None:
        url = httpx.URL(engine.metrics_url)
        assert url.scheme == "http" and url.port is not None and 0 < url.port < 65536
