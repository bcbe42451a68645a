"""Records from outside, one field at a time made hostile: whatever value replaces whatever field, each
reader returns or raises its own error, and what it returns can be stored: the ledger line encodes,
the request is counted and /metrics renders it. What must hold is the records fuzz target's
(``fuzz/records.py``, ``read``); this feeds it structured inputs where atheris feeds it bytes.

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
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwatch.discovery.pods import judge_pod
from tests.discovery.fake_apiserver import make_pod, pod_conditions, vllm_container
from tests.engines.helpers import page
from tests.hostile import hostile
from tests.local import fuzz_target
from tests.records import CHAT_REQUEST, CHAT_RESPONSE, PLUGIN_DATAGRAM, SGLANG_LINE, USAGE_CHUNK
from tests.requests.otlp_spans import TOKENS, span_export

records = fuzz_target("records")  # the readers and what must hold of them (fuzz/records.py)
SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(hostile(SGLANG_LINE))
def test_sglang_file_line(doc: Any) -> None:
    records.read(records.SGLANG, json.dumps(doc).encode())


@SETTINGS
@given(hostile(PLUGIN_DATAGRAM))
def test_vllm_plugin_datagram(doc: Any) -> None:
    records.read(records.PLUGIN, json.dumps(doc).encode())


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
    export = span_export({"service.name": "r0"}, **attrs)
    records.read(records.OTLP_PROTOBUF, export.SerializeToString())
    records.read(records.OTLP_JSON, json_format.MessageToJson(export).encode())  # OTLP/HTTP's JSON


SLOTS = json.loads(page("llamacpp_slots_2026_two_slots.json"))


@SETTINGS
@given(hostile(SLOTS, changes=4))
def test_llamacpp_slots(doc: Any) -> None:
    records.read(records.SLOTS, json.dumps(doc).encode())


@SETTINGS
@given(hostile(CHAT_REQUEST))
def test_proxy_request_body(doc: Any) -> None:
    records.read(records.REQUEST_BODY, json.dumps(doc).encode())


@SETTINGS
@given(hostile(USAGE_CHUNK), hostile(CHAT_RESPONSE))
def test_usage_chunk_and_response_body(chunk: Any, response: Any) -> None:
    records.read(records.USAGE, json.dumps(chunk, separators=(",", ":")).encode())
    records.read(records.USAGE, json.dumps(response).encode())


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
