"""OTLP spans -> RequestRecords: pure, no I/O.

vLLM (``--otlp-traces-endpoint``) sends one ``llm_request`` span per finished request; SGLang
(``--enable-trace``) puts the same ``gen_ai.*`` attributes on its root request span. Any span
carrying ``gen_ai.usage.completion_tokens`` or ``gen_ai.latency.e2e`` is a request; every other
span is ignored and counted. Free text from spans (``finish_reason``) is cut to a short safe token
or ``other``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from kvwatch.jsonsafe import loads
from kvwatch.model import Outcome, RequestRecord
from kvwatch.requests.accounting import ModelLabels
from kvwatch.requests.values import bounded_count, non_negative_int, non_negative_number, safe_token

#: the source's one logger, whichever of its modules logs (operators filter on this name)
log = logging.getLogger("kvwatch.requests.otlp")

REQUEST_MARKERS = ("gen_ai.usage.completion_tokens", "gen_ai.latency.e2e")
REPLICA_ATTRIBUTE = "kvwatch.replica"


class MalformedSpanError(ValueError):
    """A request span whose attributes do not have the types the gen_ai conventions give them."""


def attribute_values(attributes: Iterable[Any]) -> dict[str, Any]:
    """OTLP ``KeyValue`` list -> plain dict (arrays as lists; nested maps dropped)."""
    out: dict[str, Any] = {}
    for kv in attributes:
        out[kv.key] = _any_value(kv.value)
    return out


def _any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if kind in (None, "kvlist_value", "bytes_value"):
        return None
    return getattr(value, kind)


def _finish_reasons(value: Any) -> list[str]:
    """``gen_ai.response.finish_reasons``: a string array, or the JSON text of one (vLLM)."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = loads(value)
        except ValueError:
            return [value]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


def _finish_reason(reasons: list[str]) -> str | None:
    return safe_token(reasons[-1]) if reasons else None


def span_outcome(span: Span, reasons: list[str]) -> Outcome:
    """The engine's view: it cannot see admission refusals (those never become spans)."""
    if span.status.code == Status.STATUS_CODE_ERROR:
        return Outcome.ERROR
    if "length" in reasons:
        return Outcome.TRUNCATED
    if "abort" in reasons:
        return Outcome.ABORTED
    if "error" in reasons:
        return Outcome.ERROR
    return Outcome.COMPLETED


def is_request_span(attrs: dict[str, Any]) -> bool:
    return any(key in attrs for key in REQUEST_MARKERS)


def span_record(span: Span, attrs: dict[str, Any], replica: str, model_name: str) -> RequestRecord:
    """One request span -> RequestRecord (source ``otlp``); raises MalformedSpanError."""
    try:
        return _span_record(span, attrs, replica, model_name)
    except ValueError as exc:
        raise MalformedSpanError(str(exc)) from None
    except Exception as exc:  # whatever one span holds costs that span, never the export's others
        raise MalformedSpanError(f"unreadable span ({type(exc).__name__})") from None


def _span_record(span: Span, attrs: dict[str, Any], replica: str, model_name: str) -> RequestRecord:
    reasons = _finish_reasons(attrs.get("gen_ai.response.finish_reasons"))
    dropped: list[str] = []
    prompt, output, limit = (
        bounded_count(non_negative_int(attrs, key), field, dropped)
        for key, field in (
            ("gen_ai.usage.prompt_tokens", "prompt_tokens"),
            ("gen_ai.usage.completion_tokens", "output_tokens"),
            ("gen_ai.request.max_tokens", "max_tokens"),
        )
    )
    return RequestRecord(
        replica=replica,
        model_name=model_name,
        source="otlp",
        outcome=span_outcome(span, reasons),
        started_at=span.start_time_unix_nano / 1e9,
        finish_reason=_finish_reason(reasons),
        prompt_tokens=prompt,
        output_tokens=output,
        max_tokens=limit,
        ttft_seconds=non_negative_number(attrs, "gen_ai.latency.time_to_first_token"),
        e2e_seconds=non_negative_number(attrs, "gen_ai.latency.e2e"),
        queue_seconds=non_negative_number(attrs, "gen_ai.latency.time_in_queue"),
        decode_seconds=non_negative_number(attrs, "gen_ai.latency.time_in_model_decode"),
        dropped_values=tuple(dropped),
    )


class ReplicaResolver:
    """Maps a resource (an engine process) to a configured replica name, or None."""

    def __init__(self, replicas: Sequence[str], configured: str | None) -> None:
        self.names = frozenset(replicas)
        self.default = configured or (replicas[0] if len(replicas) == 1 else None)

    def resolve(self, resource: dict[str, Any]) -> str | None:
        for key in (REPLICA_ATTRIBUTE, "service.name"):
            value = resource.get(key)
            if isinstance(value, str) and value in self.names:
                return value
        return self.default


def records_from_export(
    export: ExportTraceServiceRequest, resolver: ReplicaResolver, labels: dict[str, ModelLabels]
) -> tuple[list[RequestRecord], Counter[str]]:
    """Pure: every request span of one export as a record, plus counts by result."""
    records: list[RequestRecord] = []
    results: Counter[str] = Counter()
    for resource_spans in export.resource_spans:
        resource = attribute_values(resource_spans.resource.attributes)
        replica = resolver.resolve(resource)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attrs = attribute_values(span.attributes)
                if not is_request_span(attrs):
                    results["ignored"] += 1
                    continue
                if replica is None:
                    results["unmapped"] += 1
                    continue
                model = attrs.get("gen_ai.response.model") or attrs.get("gen_ai.request.model")
                label = labels[replica].label(model if isinstance(model, str) else None)
                try:
                    records.append(span_record(span, attrs, replica, label))
                except MalformedSpanError as exc:
                    results["malformed"] += 1
                    log.debug("otlp: malformed request span from %s: %s", replica, exc)
                    continue
                results["request"] += 1
    return records, results
