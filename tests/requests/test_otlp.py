"""The OTLP/HTTP receiver: real vLLM 0.32 exports (captured from the CPU vLLM) and hostile input.

``fixtures/vllm-0.32-otlp-*.bin`` are ExportTraceServiceRequest bodies exactly as vLLM POSTed them
(``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``): one with start-up spans, one with three
``llm_request`` spans (two chat requests with max_tokens 20, one completion with max_tokens 5).
"""

from __future__ import annotations

import gzip
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import ClientSession
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from kvwatch.config import Config, HostPort, OtlpConfig, ReplicaConfig
from kvwatch.model import Outcome, RequestRecord
from kvwatch.requests.accounting import ModelLabels
from kvwatch.requests.otlp import (
    SPANS,
    OtlpReceiver,
    ReplicaResolver,
    decode_export,
    records_from_export,
    start_otlp_receiver,
)

FIXTURES = Path(__file__).parent / "fixtures"
STARTUP = (FIXTURES / "vllm-0.32-otlp-startup-spans.bin").read_bytes()
REQUESTS = (FIXTURES / "vllm-0.32-otlp-llm-request-spans.bin").read_bytes()
REPLICAS = [ReplicaConfig("r0", "http://127.0.0.1:1/metrics", model_name="tiny"),
            ReplicaConfig("r1", "http://127.0.0.1:2/metrics", model_name="big")]


def _labels() -> dict[str, ModelLabels]:
    return {r.name: ModelLabels(set(), r.model_name) for r in REPLICAS}


def _one_replica() -> ReplicaResolver:
    return ReplicaResolver(["r0"], None)


def test_vllm_llm_request_spans_become_records() -> None:
    export = decode_export(REQUESTS, "application/x-protobuf")
    records, results = records_from_export(export, _one_replica(), _labels())
    assert results == Counter(request=3)
    assert [(r.output_tokens, r.prompt_tokens, r.max_tokens) for r in records] == [
        (20, 18, 20), (20, 18, 20), (5, 2, 5)]
    first = records[0]
    assert (first.source, first.replica, first.model_name, first.outcome) == (
        "otlp", "r0", "tiny", Outcome.COMPLETED)
    assert first.ttft_seconds == pytest.approx(0.05707120895385742)
    assert first.e2e_seconds == pytest.approx(0.1574094295501709)
    assert first.queue_seconds == pytest.approx(3.5724000099435216e-05)
    assert first.tpot_seconds == pytest.approx(0.10102578600003653 / 19)  # decode span / (n - 1)
    assert first.started_at > 1.7e9


def test_vllm_start_up_spans_are_ignored() -> None:
    records, results = records_from_export(decode_export(STARTUP, "application/x-protobuf"),
                                           _one_replica(), _labels())
    assert records == [] and results == Counter(ignored=7)


def _export(resource: dict[str, str], **attrs: object) -> ExportTraceServiceRequest:
    export = ExportTraceServiceRequest()
    rs = export.resource_spans.add()
    for key, value in resource.items():
        rs.resource.attributes.add(key=key, value=AnyValue(string_value=value))
    span = rs.scope_spans.add().spans.add(name="llm_request", start_time_unix_nano=1_700_000_000_000_000_000)
    for key, value in attrs.items():
        if isinstance(value, bool):
            any_value = AnyValue(bool_value=value)
        elif isinstance(value, int):
            any_value = AnyValue(int_value=value)
        elif isinstance(value, float):
            any_value = AnyValue(double_value=value)
        elif isinstance(value, list):
            any_value = AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=v) for v in value]))
        else:
            any_value = AnyValue(string_value=str(value))
        span.attributes.append(KeyValue(key=key, value=any_value))
    return export


TOKENS = "gen_ai.usage.completion_tokens"


@pytest.mark.parametrize(("resource", "configured", "replica"), [
    ({"kvwatch.replica": "r1", "service.name": "r0"}, None, "r1"),
    ({"service.name": "r1"}, "r0", "r1"),
    ({"service.name": "unknown_service:python3"}, "r1", "r1"),
    ({"kvwatch.replica": "not-configured"}, "r0", "r0"),
])
def test_replica_resolution(resource: dict, configured: str | None, replica: str) -> None:
    resolver = ReplicaResolver(["r0", "r1"], configured)
    [record], _ = records_from_export(_export(resource, **{TOKENS: 3}), resolver, _labels())
    assert record.replica == replica
    assert record.model_name == {"r0": "tiny", "r1": "big"}[replica]


def test_spans_that_map_to_no_replica_are_dropped_and_counted() -> None:
    records, results = records_from_export(_export({"service.name": "x"}, **{TOKENS: 3}),
                                           ReplicaResolver(["r0", "r1"], None), _labels())
    assert records == [] and results == Counter(unmapped=1)


@pytest.mark.parametrize(("attrs", "outcome", "finish"), [
    ({"gen_ai.response.finish_reasons": '["length"]'}, Outcome.TRUNCATED, "length"),
    ({"gen_ai.response.finish_reasons": ["stop"]}, Outcome.COMPLETED, "stop"),
    ({"gen_ai.response.finish_reasons": "abort"}, Outcome.ABORTED, "abort"),
    ({}, Outcome.COMPLETED, None),
])
def test_finish_reasons(attrs: dict, outcome: Outcome, finish: str | None) -> None:
    [record], _ = records_from_export(_export({}, **{TOKENS: 3}, **attrs), _one_replica(), _labels())
    assert (record.outcome, record.finish_reason) == (outcome, finish)


def test_error_status_is_an_error() -> None:
    export = _export({}, **{TOKENS: 3})
    export.resource_spans[0].scope_spans[0].spans[0].status.code = Status.STATUS_CODE_ERROR
    [record], _ = records_from_export(export, _one_replica(), _labels())
    assert record.outcome is Outcome.ERROR


@pytest.mark.parametrize("attrs", [
    {TOKENS: "12"}, {TOKENS: -4}, {"gen_ai.latency.e2e": "slow"}, {"gen_ai.latency.e2e": float("inf")},
    {TOKENS: 1, "gen_ai.latency.e2e": -1.0}])
def test_request_spans_with_wrong_types_are_malformed(attrs: dict) -> None:
    records, results = records_from_export(_export({}, **attrs), _one_replica(), _labels())
    assert records == [] and results == Counter(malformed=1)


def test_client_model_attribute_folds_into_bounded_labels() -> None:
    labels = {"r0": ModelLabels({"tiny"}, None)}
    records, _ = records_from_export(_export({}, **{TOKENS: 1, "gen_ai.request.model": "gpt-x"}),
                                     _one_replica(), labels)
    assert records[0].model_name == "other"


# -- over HTTP --------------------------------------------------------------------------------------


class Harness:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self.counts: Counter = Counter()
        self.reports: list[tuple] = []
        self.receiver: OtlpReceiver | None = None

    def count(self, family: str, *labels: str, amount: float = 1) -> None:
        self.counts[(family, *labels)] += amount

    @property
    def url(self) -> str:
        assert self.receiver is not None
        return f"http://127.0.0.1:{self.receiver.port}/v1/traces"


@pytest.fixture
async def otlp() -> AsyncIterator[Harness]:
    harness = Harness()
    config = Config(replicas=tuple(REPLICAS), otlp=OtlpConfig(listen=HostPort("127.0.0.1", 0), replica="r0",
                                                               max_body_bytes=64 * 1024))
    harness.receiver = await start_otlp_receiver(config, harness.records.append, harness.count,
                                                 lambda *args: harness.reports.append(args))
    yield harness
    await harness.receiver.stop()


PROTOBUF = {"Content-Type": "application/x-protobuf"}


async def test_protobuf_export_over_http(otlp: Harness, http: ClientSession) -> None:
    for body in (STARTUP, REQUESTS):
        async with http.post(otlp.url, data=body, headers=PROTOBUF) as response:
            assert response.status == 200
            assert response.content_type == "application/x-protobuf"
    assert len(otlp.records) == 3
    assert (otlp.counts[(SPANS, "request")], otlp.counts[(SPANS, "ignored")]) == (3, 7)
    assert (SPANS, "unmapped") in otlp.counts  # zero series exist from the start
    assert [(name, ok) for name, ok, *_ in otlp.reports] == [("otlp", True), ("otlp", True)]


async def test_gzip_and_deflate_bodies(otlp: Harness, http: ClientSession) -> None:
    for encoding, body in (("gzip", gzip.compress(REQUESTS)), ("deflate", zlib.compress(REQUESTS))):
        async with http.post(otlp.url, data=body, headers={**PROTOBUF, "Content-Encoding": encoding}) as r:
            assert r.status == 200
    assert len(otlp.records) == 6


async def test_json_export(otlp: Harness, http: ClientSession) -> None:
    text = json_format.MessageToJson(decode_export(REQUESTS, "application/x-protobuf"))
    async with http.post(otlp.url, data=text, headers={"Content-Type": "application/json"}) as response:
        assert (response.status, await response.text()) == (200, "{}")
    assert [r.output_tokens for r in otlp.records] == [20, 20, 5]


async def test_malformed_protobuf_is_400_and_counted(otlp: Harness, http: ClientSession) -> None:
    async with http.post(otlp.url, data=b"\xff\xff\xff not protobuf", headers=PROTOBUF) as response:
        assert response.status == 400
    async with http.post(otlp.url, data=b"{nope", headers={"Content-Type": "application/json"}) as response:
        assert response.status == 400
    assert otlp.counts[(SPANS, "malformed")] == 2 and otlp.records == []
    assert [(name, ok) for name, ok, *_ in otlp.reports] == [("otlp", False), ("otlp", False)]
    async with http.post(otlp.url, data=REQUESTS, headers=PROTOBUF) as response:  # still serving
        assert response.status == 200


async def test_body_over_the_cap_is_413(otlp: Harness, http: ClientSession) -> None:
    async with http.post(otlp.url, data=REQUESTS * 100, headers=PROTOBUF) as response:
        assert response.status == 413
    bomb = gzip.compress(b"\x00" * (10 * 1024 * 1024))  # small on the wire, 10 MiB inflated
    async with http.post(otlp.url, data=bomb, headers={**PROTOBUF, "Content-Encoding": "gzip"}) as response:
        assert response.status == 413
    assert otlp.counts[(SPANS, "malformed")] == 2


async def test_other_content_types_are_415(otlp: Harness, http: ClientSession) -> None:
    async with http.post(otlp.url, data=REQUESTS, headers={"Content-Type": "text/plain"}) as response:
        assert response.status == 415
