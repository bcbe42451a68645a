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

Every record a reader returns must also reach the ledger (``ledger_line``, strict JSON), the request
counters and their ``/metrics`` area; a datagram's steps reach ``PluginStats`` and the plugin area:
a value a reader lets through must not fail later.

Run by hand, with coverage guidance::

    .venv/bin/pip install atheris
    .venv/bin/python fuzz/records.py -timeout=2 -max_total_time=600 fuzz/corpus/records

The normal test suite runs the same ``one_input`` under hypothesis (``tests/requests/test_records_fuzz.py``),
and ``tests/test_outsider_records_property.py`` feeds each reader (``read``) valid records made
hostile one value at a time.
"""

from __future__ import annotations

import contextlib
import json

from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from kvwatch.config import Config
from kvwatch.engines.llamacpp import SlotsError, apply_slots, parse_slots
from kvwatch.export.plugin import PluginCollector
from kvwatch.export.requests import RequestCollector
from kvwatch.jsonsafe import TooDeepError, loads
from kvwatch.model import DEFAULT_BANDS, ReplicaSample, RequestRecord
from kvwatch.requests.accounting import ModelLabels, body_requesting_usage, inspect_request
from kvwatch.requests.ledger import ledger_line
from kvwatch.requests.otlp import ReplicaResolver
from kvwatch.requests.otlp.decode import DecodeJob, decode_body
from kvwatch.requests.sglang_files import line_record
from kvwatch.requests.sse import read_usage_event, usage_from_body
from kvwatch.requests.vllm_plugin import DatagramError, decode
from kvwatch.state import NodeState

CONFIG = Config()
LABELS = {"r0": ModelLabels(frozenset(), "tiny")}
JOBS = {
    content_type: DecodeJob("identity", content_type, 1 << 20, ReplicaResolver(["r0"], "r0"), LABELS)
    for content_type in ("application/json", "application/x-protobuf")
}
SLOTLESS = ReplicaSample(replica="r0", backend="llamacpp", scraped_at=1.7e9)


def _rendered(state: NodeState, area: type[PluginCollector | RequestCollector]) -> None:
    registry = CollectorRegistry()
    registry.register(area(state, CONFIG))
    generate_latest(registry)


def _stored(records: list[RequestRecord] | tuple[RequestRecord, ...]) -> None:
    """What every request source's record goes through: the ledger's line, the request counters and
    histograms, and their /metrics area."""
    state = NodeState("node", DEFAULT_BANDS)
    for record in records:
        json.dumps(ledger_line(record, DEFAULT_BANDS), allow_nan=False)
        state.requests.observe(record)
    _rendered(state, RequestCollector)


def _plugin(data: bytes) -> None:
    try:
        decoded = decode(data, "r0", "tiny")
    except DatagramError:
        return
    _stored(decoded.records)
    state = NodeState("node", DEFAULT_BANDS)  # what the receiver does with the steps, then /metrics
    for step in decoded.steps or (None,):
        state.plugin.observe(decoded.link, step)
    _rendered(state, PluginCollector)


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
    read = [usage_from_body(data)[0]]
    with contextlib.suppress(TooDeepError):
        read.append(read_usage_event(b"data: " + data)[0])
    for usage in read:
        if usage is not None:
            assert usage.prompt_tokens is None or usage.prompt_tokens >= 0, usage
            assert usage.completion_tokens is None or usage.completion_tokens >= 0, usage


READERS = (
    _plugin,
    _sglang,
    lambda data: _otlp(data, "application/json"),
    lambda data: _otlp(data, "application/x-protobuf"),
    _slots,
    _request_body,
    _usage,
)
#: the first byte that picks each reader (the property tests feed them structured inputs by name)
PLUGIN, SGLANG, OTLP_JSON, OTLP_PROTOBUF, SLOTS, REQUEST_BODY, USAGE = range(len(READERS))


def read(reader: int, data: bytes) -> None:
    """One input for one reader, checked as ``one_input`` checks it."""
    READERS[reader](data)


def one_input(data: bytes) -> None:
    if data:
        read(data[0] % len(READERS), data[1:])


if __name__ == "__main__":
    from atheris_main import fuzz  # fuzz/ is the script's folder, so it is on sys.path

    fuzz(one_input)
