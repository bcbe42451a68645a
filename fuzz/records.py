"""Fuzz target for the readers of request records and engine facts from outside, as bytes arrive.

The first byte picks the reader, the rest is its input:

- ``0`` a vLLM plugin datagram (``requests/vllm_plugin.decode``): a ``Decoded`` or ``DatagramError``;
- ``1`` an SGLang request-file line (``requests/sglang_files.line_record`` of the parsed line): a
  record or a ``ValueError``;
- ``2`` / ``3`` an OTLP export, JSON / protobuf (``requests/otlp/decode.decode_body``): records and
  counts, or a ``ValueError``;
- ``4`` llama.cpp's ``/slots`` (``engines/llamacpp.parse_slots`` and ``apply_slots``): samples whose
  KV numbers are unknown or >= 0, or a ``SlotsError``;
- ``5`` a chat request body through the proxy's accounting (``inspect_request``,
  ``body_requesting_usage``): never raises; a body it changes is still the client's JSON object with
  ``stream_options.include_usage`` true;
- ``6`` a usage chunk and a non-streaming response (``requests/sse``): only ``TooDeepError`` escapes
  the chunk's reader (the relay counts it), nothing the body's.

Every record a reader returns must also reach the ledger (``ledger_line``, strict JSON) and the
request counters (``RequestStats.observe``): a value a reader lets through must not fail later.

Run by hand, with coverage guidance::

    .venv/bin/pip install atheris
    .venv/bin/python fuzz/records.py -timeout=2 -max_total_time=600 fuzz/corpus/records

The normal test suite runs the same ``one_input`` under hypothesis (``tests/requests/test_records_fuzz.py``).
"""

from __future__ import annotations

import contextlib
import json

from kvwatch.config import ReplicaConfig
from kvwatch.engines.llamacpp import SlotsError, apply_slots, parse_slots
from kvwatch.jsonsafe import TooDeepError, loads
from kvwatch.model import DEFAULT_BANDS, LengthBands, ReplicaSample, RequestRecord
from kvwatch.requests.accounting import ModelLabels, body_requesting_usage, inspect_request
from kvwatch.requests.ledger import ledger_line
from kvwatch.requests.otlp import ReplicaResolver
from kvwatch.requests.otlp.decode import DecodeJob, decode_body
from kvwatch.requests.sglang_files import line_record
from kvwatch.requests.sse import read_usage_event, usage_from_body
from kvwatch.requests.vllm_plugin import DatagramError, decode
from kvwatch.state import RequestStats

REPLICA = ReplicaConfig("r0", "http://127.0.0.1:1/metrics", model_name="tiny")
LABELS = {"r0": ModelLabels(frozenset(), "tiny")}
JOBS = {
    content_type: DecodeJob("identity", content_type, 1 << 20, ReplicaResolver(["r0"], "r0"), LABELS)
    for content_type in ("application/json", "application/x-protobuf")
}
SLOTLESS = ReplicaSample(replica="r0", backend="llamacpp", scraped_at=1.7e9)


def _stored(records: list[RequestRecord] | tuple[RequestRecord, ...]) -> None:
    stats = RequestStats(LengthBands())
    for record in records:
        json.dumps(ledger_line(record, DEFAULT_BANDS), allow_nan=False)
        stats.observe(record)


def _plugin(data: bytes) -> None:
    try:
        decoded = decode(data, "r0", "tiny")
    except DatagramError:
        return
    _stored(decoded.records)


def _sglang(data: bytes) -> None:
    try:
        record = line_record(loads(data), "r0", "tiny", now=1.7e9)
    except ValueError:
        return
    _stored([record])


def _otlp(data: bytes, content_type: str) -> None:
    try:
        records, _ = decode_body(data, JOBS[content_type])
    except ValueError:
        return
    _stored(records)


def _slots(data: bytes) -> None:
    try:
        slots = parse_slots(data)
    except SlotsError:
        return
    sample = apply_slots(SLOTLESS, slots)
    for value in (
        sample.kv_capacity_tokens,
        sample.kv_used_tokens,
        sample.live_tokens,
        sample.kv_usage_ratio,
    ):
        assert value is None or value >= 0, sample


def _request_body(data: bytes) -> None:
    info = inspect_request(data, "chat")
    changed = body_requesting_usage(data, info)
    if changed is None:
        return
    sent, original = loads(changed), loads(data)
    assert sent["stream_options"]["include_usage"] is True
    assert {k: v for k, v in sent.items() if k != "stream_options"} == {
        k: v for k, v in original.items() if k != "stream_options"
    }


def _usage(data: bytes) -> None:
    with contextlib.suppress(TooDeepError):
        read_usage_event(b"data: " + data)
    usage_from_body(data)


READERS = (
    _plugin,
    _sglang,
    lambda data: _otlp(data, "application/json"),
    lambda data: _otlp(data, "application/x-protobuf"),
    _slots,
    _request_body,
    _usage,
)


def one_input(data: bytes) -> None:
    if data:
        READERS[data[0] % len(READERS)](data[1:])


if __name__ == "__main__":
    from atheris_main import fuzz  # fuzz/ is the script's folder, so it is on sys.path

    fuzz(one_input)
