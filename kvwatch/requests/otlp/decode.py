"""An OTLP/HTTP export body -> request records, off the event loop.

The sender is an outsider: the body is inflated in steps with the output checked against
``otlp.max_decompressed_bytes`` as it grows (a 4 MB gzip of zeros would be 4 GiB), then decoded
(protobuf or JSON) and mapped (``spans.py``). A compressed export or one over WORKER_DECODE_BYTES
is decoded in kvwatch's worker process (``kvwatch.workers``: a thread would share the GIL and the
heap, and a 55,000-span export is ~0.9 s of pure Python), whose records come back in batches; a
small one in a thread.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvwatch.model import RequestRecord
from kvwatch.requests.accounting import ModelLabels
from kvwatch.requests.otlp.spans import ReplicaResolver, records_from_export
from kvwatch.workers import WorkerProcess

ENCODINGS = ("identity", "gzip", "deflate")
INFLATE_STEP = 1024 * 1024  # compressed bytes handed to zlib at a time
INFLATE_OUTPUT_STEP = 1024 * 1024  # inflated bytes taken from zlib at a time (it drops the GIL for each)
SINK_BATCH = 256  # records handed to the sink between yields to the event loop
#: exports of more bytes than this, and every compressed one, are decoded in kvwatch's worker process
#: (``kvwatch.workers``): in a thread, 55,000 spans are ~0.9 s of pure Python holding the GIL in 5 ms
#: turns against the loop, and their records lengthen the agent's garbage collections
WORKER_DECODE_BYTES = 256 * 1024


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
                    f"{encoding} body inflates past otlp.max_decompressed_bytes ({limit})"
                )
            pending = inflater.unconsumed_tail
        rest = inflater.unused_data + bytes(data)
        data = memoryview(rest if encoding == "gzip" and rest[:2] == b"\x1f\x8b" else b"")  # next member
    return bytes(out)


def _wbits(encoding: str, head: bytes) -> int:
    if encoding == "gzip":
        return 16 + zlib.MAX_WBITS
    zlib_header = len(head) == 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0
    return zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS  # some senders send raw deflate


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


@dataclass(frozen=True, slots=True)
class DecodeJob:
    """What decoding one export needs besides its body: the worker receives it as one pickled value."""

    encoding: str  # Content-Encoding, one of ENCODINGS
    content_type: str
    max_decompressed: int
    resolver: ReplicaResolver
    labels: dict[str, ModelLabels]


def decode_body(body: bytes, job: DecodeJob) -> tuple[list[RequestRecord], Counter[str]]:
    """Inflate, decode and map one export: the CPU-heavy part, run off the event loop."""
    export = decode_export(inflate(body, job.encoding, job.max_decompressed), job.content_type)
    return records_from_export(export, job.resolver, job.labels)


def answer_in_worker(job: DecodeJob, body: bytes) -> Iterator[tuple[Any, ...]]:
    """The worker's handler (``kvwatch.workers``): the counts, then the records SINK_BATCH at a time,
    so the agent unpickles a big export in short steps; a refusal is one frame."""
    try:
        records, results = decode_body(body, job)
    except InflatedTooLargeError as exc:
        yield ("inflated_too_large", str(exc))
        return
    except ValueError as exc:
        yield ("undecodable", str(exc))
        return
    yield ("results", results)
    for start in range(0, len(records), SINK_BATCH):
        yield ("records", records[start : start + SINK_BATCH])


async def decode_in_worker(
    worker: WorkerProcess, body: bytes, job: DecodeJob
) -> tuple[list[RequestRecord], Counter[str]]:
    """``decode_body`` in the worker process: raises what it raises, or ``WorkerFailedError``."""
    frames = await worker.call(answer_in_worker, job, body)
    kind, value = frames[0]
    if kind == "inflated_too_large":
        raise InflatedTooLargeError(value)
    if kind in ("undecodable", "crashed"):
        raise ValueError(value)
    records: list[RequestRecord] = []
    for _, batch in frames[1:]:
        records += batch
    return records, value


async def decode_off_loop(
    worker: WorkerProcess | None, body: bytes, job: DecodeJob
) -> tuple[list[RequestRecord], Counter[str]]:
    """``decode_body`` off the loop: a large or compressed export in the worker process (when there is
    one), a small one in a thread. Raises what ``decode_in_worker`` raises."""
    if worker is not None and (len(body) > WORKER_DECODE_BYTES or job.encoding != "identity"):
        return await decode_in_worker(worker, body, job)
    return await asyncio.to_thread(decode_body, body, job)
