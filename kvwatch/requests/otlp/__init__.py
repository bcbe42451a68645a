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

The package by concern: ``decode.py`` (body -> records: inflate, protobuf/JSON, the off-loop run in
the worker process or a thread), ``spans.py`` (span -> RequestRecord, which replica, pure) and
``receiver.py`` (the HTTP endpoint: limits, refusals, counts, the ledger's backpressure, the sink).
"""

from kvwatch.requests.otlp.decode import (
    DecodeJob,
    InflatedTooLargeError,
    decode_body,
    decode_export,
    decode_in_worker,
    inflate,
)
from kvwatch.requests.otlp.receiver import REFUSED, SPANS, OtlpReceiver
from kvwatch.requests.otlp.spans import ReplicaResolver, records_from_export

__all__ = [
    "REFUSED",
    "SPANS",
    "DecodeJob",
    "InflatedTooLargeError",
    "OtlpReceiver",
    "ReplicaResolver",
    "decode_body",
    "decode_export",
    "decode_in_worker",
    "inflate",
    "records_from_export",
]
