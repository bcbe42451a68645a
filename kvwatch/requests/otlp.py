"""OTLP/HTTP trace receiver: per-request latency from the engine's own spans, no proxy needed.

``POST /v1/traces`` takes an ``ExportTraceServiceRequest`` as ``application/x-protobuf`` or
``application/json`` (gzip or deflate content-encoding allowed). vLLM (``--otlp-traces-endpoint``)
sends one ``llm_request`` span per finished request; SGLang (``--enable-trace``) puts the same
``gen_ai.*`` attributes on its root request span. Any span carrying
``gen_ai.usage.completion_tokens`` or ``gen_ai.latency.e2e`` is a request; every other span (vLLM's
start-up spans ``Load model``, ``Allocate KV cache``, ..., SGLang's stage slices) is ignored and
counted (``kvwatch_otlp_spans_total{result}``: request, ignored, malformed, unmapped).

Which replica a span belongs to, first match wins:
  1. resource attribute ``kvwatch.replica`` naming a configured replica
     (``OTEL_RESOURCE_ATTRIBUTES=kvwatch.replica=r0`` on the engine);
  2. resource ``service.name`` equal to a configured replica name (``OTEL_SERVICE_NAME=r0``);
  3. ``otlp.replica`` from the config;
  4. the only configured replica, when there is exactly one.
Otherwise the span is dropped and counted ``unmapped``: label values stay bounded.

The sender is an outsider: the body is read compressed (``otlp.max_body_bytes``), inflated in
steps with the output checked against ``otlp.max_decompressed_bytes`` as it grows (a 4 MB gzip of
zeros would be 4 GiB), and inflate + decode + span mapping run off the event loop: a compressed
export or one over WORKER_DECODE_BYTES in kvwatch's worker process (``kvwatch.workers``: a thread
would share the GIL and the heap, and a 55,000-span export is ~0.9 s of pure Python), whose
records come back in batches; a small one in a thread. Refused exports are counted
``kvwatch_otlp_exports_refused``. With the request ledger on, an export is accepted only once the
ledger has made room for all its records (``RequestLedger.admit``); else it is answered 503 with
``Retry-After`` before anything of it is counted, and the sender retries it: a 2xx answer means
every record reached the histograms and the ledger's queue. Free text from spans
(``finish_reason``) is cut to a short safe token or ``other``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from kvwatch.config import Config, OtlpConfig, ReplicaConfig
from kvwatch.logthrottle import LogThrottle
from kvwatch.model import Outcome, RequestRecord
from kvwatch.requests.accounting import ModelLabels
from kvwatch.requests.ledger import RequestLedger
from kvwatch.requests.values import bounded_count, non_negative_int, non_negative_number, safe_token
from kvwatch.selfmetrics import Count, Report
from kvwatch.workers import WorkerFailedError, WorkerProcess

log = logging.getLogger(__name__)

SPANS = "kvwatch_otlp_spans"
RESULTS = ("request", "ignored", "malformed", "unmapped")
REFUSED = "kvwatch_otlp_exports_refused"
REFUSALS = ("body_too_large", "inflated_too_large", "undecodable", "ledger_busy")
#: seconds a sender refused for ``ledger_busy`` is asked to wait (the ledger writes ~55,000 lines a
#: second on a shared 2-core machine: a 10,000-line backlog is gone in well under one)
RETRY_AFTER_S = 1
ENCODINGS = ("identity", "gzip", "deflate")
INFLATE_STEP = 1024 * 1024  # compressed bytes handed to zlib at a time
INFLATE_OUTPUT_STEP = 1024 * 1024  # inflated bytes taken from zlib at a time (it drops the GIL for each)
SINK_BATCH = 256  # records handed to the sink between yields to the event loop
#: exports of more bytes than this, and every compressed one, are decoded in kvwatch's worker process
#: (``kvwatch.workers``): in a thread, 55,000 spans are ~0.9 s of pure Python holding the GIL in 5 ms
#: turns against the loop, and their records lengthen the agent's garbage collections
WORKER_DECODE_BYTES = 256 * 1024
MAX_CONCURRENT_DECODES = 2  # each may hold max_body_bytes + max_decompressed_bytes
REQUEST_MARKERS = ("gen_ai.usage.completion_tokens", "gen_ai.latency.e2e")
REPLICA_ATTRIBUTE = "kvwatch.replica"

Sink = Callable[[RequestRecord], None]
COLLECTOR = "otlp"


class MalformedSpanError(ValueError):
    """A request span whose attributes do not have the types the gen_ai conventions give them."""


class InflatedTooLargeError(ValueError):
    """A compressed body that inflates past ``otlp.max_decompressed_bytes``."""


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """``Content-Encoding`` gzip/deflate -> bytes, never holding more than ``limit + 1`` inflated.

    Raises InflatedTooLargeError past ``limit``, ValueError for a corrupt or truncated stream.
    """
    if encoding == "identity":
        return body
    out = bytearray()
    data = memoryview(body)
    while data:  # one pass per gzip member
        inflater = zlib.decompressobj(_wbits(encoding, bytes(data[:2])))
        pending = b""
        while not inflater.eof:
            if not pending:
                if not data:
                    raise ValueError(f"truncated {encoding} body")
                pending, data = bytes(data[:INFLATE_STEP]), data[INFLATE_STEP:]
            try:
                out += inflater.decompress(pending, min(INFLATE_OUTPUT_STEP, limit + 1 - len(out)))
            except zlib.error:
                raise ValueError(f"corrupt {encoding} body") from None
            if len(out) > limit:
                raise InflatedTooLargeError(
                    f"{encoding} body inflates past otlp.max_decompressed_bytes ({limit})")
            pending = inflater.unconsumed_tail
        rest = inflater.unused_data + bytes(data)
        data = memoryview(rest if encoding == "gzip" and rest[:2] == b"\x1f\x8b" else b"")  # next member
    return bytes(out)


def _wbits(encoding: str, head: bytes) -> int:
    if encoding == "gzip":
        return 16 + zlib.MAX_WBITS
    zlib_header = len(head) == 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0
    return zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS  # some senders send raw deflate


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
            value = json.loads(value)
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


def _span_record(span: Span, attrs: dict[str, Any], replica: str, model_name: str) -> RequestRecord:
    reasons = _finish_reasons(attrs.get("gen_ai.response.finish_reasons"))
    dropped: list[str] = []
    prompt, output, limit = (bounded_count(non_negative_int(attrs, key), field, dropped) for key, field in (
        ("gen_ai.usage.prompt_tokens", "prompt_tokens"), ("gen_ai.usage.completion_tokens", "output_tokens"),
        ("gen_ai.request.max_tokens", "max_tokens")))
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


def records_from_export(export: ExportTraceServiceRequest, resolver: ReplicaResolver,
                        labels: dict[str, ModelLabels]) -> tuple[list[RequestRecord], Counter[str]]:
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


def decode_body(body: bytes, encoding: str, content_type: str, max_decompressed: int,
                resolver: ReplicaResolver, labels: dict[str, ModelLabels],
                ) -> tuple[list[RequestRecord], Counter[str]]:
    """Inflate, decode and map one export: the CPU-heavy part, run off the event loop."""
    export = decode_export(inflate(body, encoding, max_decompressed), content_type)
    return records_from_export(export, resolver, labels)


def answer_in_worker(args: tuple[Any, ...], body: bytes) -> Iterator[tuple[Any, ...]]:
    """The worker's handler (``kvwatch.workers``): the counts, then the records SINK_BATCH at a time,
    so the agent unpickles a big export in short steps; a refusal is one frame."""
    try:
        records, results = decode_body(body, *args)
    except InflatedTooLargeError as exc:
        yield ("inflated_too_large", str(exc))
        return
    except ValueError as exc:
        yield ("undecodable", str(exc))
        return
    yield ("results", results)
    for start in range(0, len(records), SINK_BATCH):
        yield ("records", records[start:start + SINK_BATCH])


async def decode_in_worker(worker: WorkerProcess, body: bytes, encoding: str, content_type: str,
                           max_decompressed: int, resolver: ReplicaResolver, labels: dict[str, ModelLabels],
                           ) -> tuple[list[RequestRecord], Counter[str]]:
    """``decode_body`` in the worker process: raises what it raises, or ``WorkerFailedError``."""
    frames = await worker.call(answer_in_worker,
                               (encoding, content_type, max_decompressed, resolver, labels), body)
    kind, value = frames[0]
    if kind == "inflated_too_large":
        raise InflatedTooLargeError(value)
    if kind in ("undecodable", "crashed"):
        raise ValueError(value)
    records: list[RequestRecord] = []
    for _, batch in frames[1:]:
        records += batch
    return records, value


def decode_export(body: bytes, content_type: str) -> ExportTraceServiceRequest:
    """Raises ValueError naming what was wrong (never the body's content)."""
    export = ExportTraceServiceRequest()
    if content_type == "application/json":
        try:
            json_format.Parse(body, export, ignore_unknown_fields=True)
        except (json_format.ParseError, UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(f"not an OTLP/JSON ExportTraceServiceRequest ({type(exc).__name__})") from None
        return export
    try:
        export.ParseFromString(body)
    except (DecodeError, RecursionError):
        raise ValueError("not an OTLP protobuf ExportTraceServiceRequest") from None
    return export


class OtlpReceiver:
    """The HTTP endpoint; ``await stop()`` closes it."""

    def __init__(self, config: OtlpConfig, replicas: Sequence[ReplicaConfig], known_models: Iterable[str],
                 sink: Sink, count: Count, report: Report | None = None,
                 worker: WorkerProcess | None = None, ledger: RequestLedger | None = None) -> None:
        self.config = config
        self.worker = worker
        #: the ledger ``sink`` writes to: it must write each record as admitted (``write(r, True)``)
        self.ledger = ledger
        known = frozenset(known_models)
        self.resolver = ReplicaResolver([r.name for r in replicas], config.replica)
        self.labels = {r.name: ModelLabels(known, r.model_name) for r in replicas}
        self.sink = sink
        self.count = count
        self.report = report
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._decoding = asyncio.Semaphore(MAX_CONCURRENT_DECODES)
        self._throttle = LogThrottle()  # every log line a sender can repeat at will goes through it

    @property
    def port(self) -> int:
        assert self._runner is not None, "start() first"
        return int(self._runner.addresses[0][1])  # (host, port) of the bound socket

    async def start(self, host: str, port: int) -> None:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/traces", self.handle)
        # auto_decompress off: aiohttp would inflate before client_max_size is checked; inflate() caps it
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, auto_decompress=False)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port)
        await self._site.start()
        log.info("OTLP/HTTP trace receiver listening on %s:%d/v1/traces", host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def handle(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        content_type = request.content_type
        if content_type not in ("application/x-protobuf", "application/json"):
            return web.Response(status=415, text="send application/x-protobuf or application/json\n")
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
        if encoding not in ENCODINGS:
            return web.Response(status=415, text="Content-Encoding must be gzip, deflate or identity\n")
        try:
            body = await request.read()  # compressed bytes; client_max_size caps them
        except web.HTTPRequestEntityTooLarge:
            self._refuse("body_too_large")
            self._throttle.log(log, logging.WARNING, "body_too_large",
                               "otlp: export over otlp.max_body_bytes (%d) refused",
                               self.config.max_body_bytes)
            raise
        if self.ledger is not None and self.ledger.busy():  # refused before paying for the decode
            return self._ledger_busy(request.remote)
        try:
            async with self._decoding:
                records, results = await self._decode(body, encoding, content_type)
        except InflatedTooLargeError as exc:
            self._refuse("inflated_too_large")
            self._report(False, started, str(exc))
            self._throttle.log(log, logging.WARNING, "inflated_too_large", "otlp: %s from %s", exc,
                               request.remote)
            return web.Response(status=413, text=f"{exc}\n")
        except WorkerFailedError as exc:  # the worker was killed and is replaced at the next export
            self._report(False, started, str(exc))
            self._throttle.log(log, logging.WARNING, "worker_failed",
                               "otlp: %s; export from %s refused with 503", exc, request.remote)
            return web.Response(status=503, text="try again\n")
        except ValueError as exc:
            self._refuse("undecodable")
            self._report(False, started, str(exc))
            self._throttle.log(log, logging.WARNING, "undecodable", "otlp: %s from %s", exc, request.remote)
            return web.Response(status=400, text=f"{exc}\n")
        if self.ledger is not None and not self.ledger.admit(len(records)):
            return self._ledger_busy(request.remote)
        for result, n in results.items():
            self._count(result, n)
        await self._sink_all(records)
        self._report(True, started)
        if content_type == "application/json":
            return web.Response(body=b"{}", content_type="application/json")
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def _decode(self, body: bytes, encoding: str, content_type: str,
                      ) -> tuple[list[RequestRecord], Counter[str]]:
        """The CPU-heavy part, off the loop: a large or compressed export in the worker process,
        a small one in a thread."""
        limit = self.config.max_decompressed_bytes
        if self.worker is not None and (len(body) > WORKER_DECODE_BYTES or encoding != "identity"):
            return await decode_in_worker(self.worker, body, encoding, content_type, limit, self.resolver,
                                          self.labels)
        return await asyncio.to_thread(decode_body, body, encoding, content_type, limit, self.resolver,
                                       self.labels)

    def _ledger_busy(self, remote: str | None) -> web.Response:
        """503 + Retry-After: the ledger cannot take this export now; nothing of it was counted.
        Backpressure, not a failure: the source's collector status stays as it was."""
        self._count_family(REFUSED, "ledger_busy", 1)
        self._throttle.log(log, logging.WARNING, "ledger_busy",
                           "otlp: export from %s refused with 503, the request ledger is busy; the sender "
                           "retries it (kvwatch_otlp_exports_refused_total{reason=\"ledger_busy\"})", remote)
        return web.Response(status=503, text="request ledger busy, retry\n",
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    async def _sink_all(self, records: list[RequestRecord]) -> None:
        """The sink (histograms, ledger) runs on the loop: yield between batches of a big export."""
        sunk = 0
        try:
            for start in range(0, len(records), SINK_BATCH):
                if start:
                    await asyncio.sleep(0)
                for record in records[start:start + SINK_BATCH]:
                    sunk += 1
                    try:
                        self.sink(record)
                    except Exception:
                        self._throttle.log(log, logging.ERROR, "sink", "otlp: request sink failed",
                                           exc_info=True)
        finally:
            if self.ledger is not None and sunk < len(records):  # cancelled (the agent stopping)
                self.ledger.release(len(records) - sunk)

    def _report(self, success: bool, started: float, error: str | None = None) -> None:
        """``kvwatch_source_last_success_timestamp_seconds{source="otlp"}`` shows spans stopped."""
        if self.report is not None:
            try:
                self.report(COLLECTOR, success, time.perf_counter() - started, error)
            except Exception:
                log.exception("otlp: reporting failed")

    def _refuse(self, reason: str) -> None:
        """A refused export is one ``malformed`` span result too (as before) and one refusal by reason."""
        self._count("malformed")
        self._count_family(REFUSED, reason, 1)

    def _count(self, result: str, n: int = 1) -> None:
        self._count_family(SPANS, result, n)

    def _count_family(self, family: str, label: str, n: int) -> None:
        try:
            self.count(family, label, amount=n)
        except Exception:
            log.exception("otlp: counting failed")


async def start_otlp_receiver(config: Config, sink: Sink, count: Count, report: Report | None = None,
                              worker: WorkerProcess | None = None,
                              ledger: RequestLedger | None = None) -> OtlpReceiver:
    """Start the receiver on ``config.otlp.listen`` (the agent's wiring entry point).

    ``count`` is ``NodeState.count``; every result series starts at zero so ``rate()`` sees the
    first. ``report`` (``NodeState.report``) is told of each export received, as collector ``otlp``.
    ``ledger``: the request ledger ``sink`` writes to, if any; ``sink`` must then write each record
    as admitted (``RequestLedger.write(record, admitted=True)``), the room having been made for it.
    """
    otlp = config.otlp
    if otlp.listen is None:
        raise ValueError("otlp.listen is not set")
    receiver = OtlpReceiver(otlp, config.replicas, config.known_models, sink, count, report, worker, ledger)
    for result in RESULTS:
        receiver._count(result, 0)
    for reason in REFUSALS:
        receiver._count_family(REFUSED, reason, 0)
    await receiver.start(otlp.listen.host, otlp.listen.port)
    return receiver
