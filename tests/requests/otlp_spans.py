"""OTLP exports built span by span, and the replicas they resolve to: the receiver's tests and the
tests of absurd counts (from every request source, OTLP among them) build them the same way."""

from __future__ import annotations

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue

from kvwatch.config import ReplicaConfig
from kvwatch.requests.accounting import ModelLabels
from kvwatch.requests.otlp import ReplicaResolver

REPLICAS = [
    ReplicaConfig("r0", "http://127.0.0.1:1/metrics", model_name="tiny"),
    ReplicaConfig("r1", "http://127.0.0.1:2/metrics", model_name="big"),
]


def model_labels() -> dict[str, ModelLabels]:
    return {r.name: ModelLabels(set(), r.model_name) for r in REPLICAS}


def one_replica() -> ReplicaResolver:
    return ReplicaResolver(["r0"], None)


def span_export(resource: dict[str, str], **attrs: object) -> ExportTraceServiceRequest:
    export = ExportTraceServiceRequest()
    rs = export.resource_spans.add()
    for key, value in resource.items():
        rs.resource.attributes.add(key=key, value=AnyValue(string_value=value))
    span = rs.scope_spans.add().spans.add(name="llm_request", start_time_unix_nano=1_700_000_000_000_000_000)
    for key, value in attrs.items():
        span.attributes.append(KeyValue(key=key, value=any_value(value)))
    return export


def any_value(value: object) -> AnyValue:
    """An attribute value as an OTLP exporter writes it: bool, int64, double, array, else a string."""
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, list):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    return AnyValue(string_value=str(value))


TOKENS = "gen_ai.usage.completion_tokens"
