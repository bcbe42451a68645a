"""The OTLP/HTTP receiver: real vLLM 0.32 exports (captured from the CPU vLLM) and hostile input.

``fixtures/vllm-0.32-otlp-*.bin`` are ExportTraceServiceRequest bodies exactly as vLLM POSTed them
(``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``): one with start-up spans, one with three
``llm_request`` spans (two chat requests with max_tokens 20, one completion with max_tokens 5).
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import io
import json
import logging
import resource
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import ClientSession
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from kvwatch.agent.heap import freeze_start_up_heap
from kvwatch.config import Config, HostPort, OtlpConfig
from kvwatch.model import Outcome, RequestRecord
from kvwatch.requests.accounting import ModelLabels
from kvwatch.requests.ledger import ledger_line
from kvwatch.requests.otlp import (
    REFUSED,
    SPANS,
    DecodeJob,
    InflatedTooLargeError,
    OtlpReceiver,
    ReplicaResolver,
    decode_body,
    decode_export,
    decode_in_worker,
    inflate,
    records_from_export,
)
from kvwatch.workers import WorkerProcess

from .otlp_spans import REPLICAS, TOKENS, model_labels, one_replica, span_export

FIXTURES = Path(__file__).parent / "fixtures"
STARTUP = (FIXTURES / "vllm-0.32-otlp-startup-spans.bin").read_bytes()
REQUESTS = (FIXTURES / "vllm-0.32-otlp-llm-request-spans.bin").read_bytes()


def test_vllm_llm_request_spans_become_records() -> None:
    export = decode_export(REQUESTS, "application/x-protobuf")
    records, results = records_from_export(export, one_replica(), model_labels())
    assert results == Counter(request=3)
    assert [(r.output_tokens, r.prompt_tokens, r.max_tokens) for r in records] == [
        (20, 18, 20),
        (20, 18, 20),
        (5, 2, 5),
    ]
    first = records[0]
    assert (first.source, first.replica, first.model_name, first.outcome) == (
        "otlp",
        "r0",
        "tiny",
        Outcome.COMPLETED,
    )
    assert first.ttft_seconds == pytest.approx(0.05707120895385742)
    assert first.e2e_seconds == pytest.approx(0.1574094295501709)
    assert first.queue_seconds == pytest.approx(3.5724000099435216e-05)
    assert first.tpot_seconds == pytest.approx(0.10102578600003653 / 19)  # decode span / (n - 1)
    assert first.started_at > 1.7e9


def test_vllm_start_up_spans_are_ignored() -> None:
    records, results = records_from_export(
        decode_export(STARTUP, "application/x-protobuf"), one_replica(), model_labels()
    )
    assert records == [] and results == Counter(ignored=7)


@pytest.mark.parametrize(
    ("resource", "configured", "replica"),
    [
        ({"kvwatch.replica": "r1", "service.name": "r0"}, None, "r1"),
        ({"service.name": "r1"}, "r0", "r1"),
        ({"service.name": "unknown_service:python3"}, "r1", "r1"),
        ({"kvwatch.replica": "not-configured"}, "r0", "r0"),
    ],
)
def test_replica_resolution(resource: dict, configured: str | None, replica: str) -> None:
    resolver = ReplicaResolver(["r0", "r1"], configured)
    [record], _ = records_from_export(span_export(resource, **{TOKENS: 3}), resolver, model_labels())
    assert record.replica == replica
    assert record.model_name == {"r0": "tiny", "r1": "big"}[replica]


def test_spans_that_map_to_no_replica_are_dropped_and_counted() -> None:
    records, results = records_from_export(
        span_export({"service.name": "x"}, **{TOKENS: 3}), ReplicaResolver(["r0", "r1"], None), model_labels()
    )
    assert records == [] and results == Counter(unmapped=1)


@pytest.mark.parametrize(
    ("attrs", "outcome", "finish"),
    [
        ({"gen_ai.response.finish_reasons": '["length"]'}, Outcome.TRUNCATED, "length"),
        ({"gen_ai.response.finish_reasons": ["stop"]}, Outcome.COMPLETED, "stop"),
        ({"gen_ai.response.finish_reasons": "abort"}, Outcome.ABORTED, "abort"),
        ({}, Outcome.COMPLETED, None),
    ],
)
def test_finish_reasons(attrs: dict, outcome: Outcome, finish: str | None) -> None:
    [record], _ = records_from_export(span_export({}, **{TOKENS: 3}, **attrs), one_replica(), model_labels())
    assert (record.outcome, record.finish_reason) == (outcome, finish)


def test_a_span_the_reader_fails_on_costs_that_span_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvwatch.requests.otlp import spans

    def fails_on_seven(span, attrs, *args):
        if attrs.get(TOKENS) == 7:
            raise ArithmeticError("a reader bug")
        return real(span, attrs, *args)

    real = spans._span_record
    monkeypatch.setattr(spans, "_span_record", fails_on_seven)
    export = span_export({}, **{TOKENS: 3})
    scope = export.resource_spans[0].scope_spans[0]
    for tokens in (7, 9):
        scope.spans.append(span_export({}, **{TOKENS: tokens}).resource_spans[0].scope_spans[0].spans[0])
    records, results = records_from_export(export, one_replica(), model_labels())
    assert [r.output_tokens for r in records] == [3, 9]
    assert results == Counter(request=2, malformed=1)


def test_error_status_is_an_error() -> None:
    export = span_export({}, **{TOKENS: 3})
    export.resource_spans[0].scope_spans[0].spans[0].status.code = Status.STATUS_CODE_ERROR
    [record], _ = records_from_export(export, one_replica(), model_labels())
    assert record.outcome is Outcome.ERROR


@pytest.mark.parametrize(
    "attrs",
    [
        {TOKENS: "12"},
        {TOKENS: -4},
        {"gen_ai.latency.e2e": "slow"},
        {"gen_ai.latency.e2e": float("inf")},
        {TOKENS: 1, "gen_ai.latency.e2e": -1.0},
    ],
)
def test_request_spans_with_wrong_types_are_malformed(attrs: dict) -> None:
    records, results = records_from_export(span_export({}, **attrs), one_replica(), model_labels())
    assert records == [] and results == Counter(malformed=1)


def test_client_model_attribute_folds_into_bounded_labels() -> None:
    labels = {"r0": ModelLabels({"tiny"}, None)}
    records, _ = records_from_export(
        span_export({}, **{TOKENS: 1, "gen_ai.request.model": "gpt-x"}), one_replica(), labels
    )
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
    config = Config(
        replicas=tuple(REPLICAS),
        otlp=OtlpConfig(
            listen=HostPort("127.0.0.1", 0),
            replica="r0",
            max_body_bytes=64 * 1024,
            max_decompressed_bytes=1024 * 1024,
        ),
    )
    harness.receiver = OtlpReceiver(
        config, harness.records.append, harness.count, lambda *args: harness.reports.append(args)
    )
    await harness.receiver.start()
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


def _rpc_status(body: bytes) -> tuple[int, str]:
    """(code, message) of a ``google.rpc.Status`` (google/rpc/status.proto: ``int32 code = 1``,
    ``string message = 2``), read by protobuf's own runtime from a descriptor built here."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    file = descriptor_pb2.FileDescriptorProto(name="test_rpc_status.proto", package="test.rpc")
    status = file.message_type.add(name="Status")
    status.field.add(name="code", number=1, type=5, label=1)  # TYPE_INT32, optional
    status.field.add(name="message", number=2, type=9, label=1)  # TYPE_STRING
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    message = message_factory.GetMessageClass(pool.FindMessageTypeByName("test.rpc.Status"))()
    message.ParseFromString(body)
    return message.code, message.message


async def test_a_failure_answers_a_status_in_the_exports_own_encoding(
    otlp: Harness, http: ClientSession
) -> None:
    # OTLP/HTTP: a 4xx/5xx body is a google.rpc.Status, in the request's content type (it was text)
    async with http.post(otlp.url, data=b"\xff\xff\xff not protobuf", headers=PROTOBUF) as response:
        assert (response.status, response.content_type) == (400, "application/x-protobuf")
        code, message = _rpc_status(await response.read())
    assert code == 3 and message  # INVALID_ARGUMENT, and why
    async with http.post(otlp.url, data=b"{nope", headers={"Content-Type": "application/json"}) as response:
        assert (response.status, response.content_type) == (400, "application/json")
        doc = json.loads(await response.text())
    assert doc["code"] == 3 and doc["message"]


async def test_spans_kvwatch_cannot_use_are_rejected_in_partial_success(
    otlp: Harness, http: ClientSession
) -> None:
    export = span_export({}, **{TOKENS: -4})  # malformed: no request has -4 tokens
    export.MergeFrom(decode_export(REQUESTS, "application/x-protobuf"))
    async with http.post(otlp.url, data=export.SerializeToString(), headers=PROTOBUF) as response:
        assert response.status == 200
        answer = ExportTraceServiceResponse.FromString(await response.read())
    assert answer.partial_success.rejected_spans == 1 and answer.partial_success.error_message
    assert len(otlp.records) == 3  # the rest was taken
    async with http.post(otlp.url, data=REQUESTS, headers=PROTOBUF) as response:
        assert not ExportTraceServiceResponse.FromString(await response.read()).HasField("partial_success")


async def test_body_over_the_cap_is_413(otlp: Harness, http: ClientSession) -> None:
    async with http.post(otlp.url, data=REQUESTS * 100, headers=PROTOBUF) as response:
        assert response.status == 413
    bomb = gzip.compress(b"\x00" * (10 * 1024 * 1024))  # small on the wire, 10 MiB inflated
    async with http.post(otlp.url, data=bomb, headers={**PROTOBUF, "Content-Encoding": "gzip"}) as response:
        assert response.status == 413
    assert otlp.counts[(SPANS, "malformed")] == 2
    assert (otlp.counts[(REFUSED, "body_too_large")], otlp.counts[(REFUSED, "inflated_too_large")]) == (1, 1)


async def test_other_content_types_are_415(otlp: Harness, http: ClientSession) -> None:
    async with http.post(otlp.url, data=REQUESTS, headers={"Content-Type": "text/plain"}) as response:
        assert response.status == 415


async def test_unknown_content_encoding_is_415(otlp: Harness, http: ClientSession) -> None:
    async with http.post(otlp.url, data=REQUESTS, headers={**PROTOBUF, "Content-Encoding": "br"}) as response:
        assert response.status == 415
    assert otlp.records == []


async def test_corrupt_gzip_is_400(otlp: Harness, http: ClientSession) -> None:
    body = gzip.compress(REQUESTS)
    async with http.post(otlp.url, data=body[:-40], headers={**PROTOBUF, "Content-Encoding": "gzip"}) as r:
        assert r.status == 400
    assert otlp.counts[(REFUSED, "undecodable")] == 1 and otlp.records == []


def test_inflate_raw_deflate_and_gzip_members() -> None:
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert inflate(raw.compress(REQUESTS) + raw.flush(), "deflate", 1 << 20) == REQUESTS
    assert inflate(gzip.compress(REQUESTS) * 2, "gzip", 1 << 20) == REQUESTS * 2


# -- hostile senders at the default limits ------------------------------------------------------------


@pytest.fixture
async def default_otlp() -> AsyncIterator[Harness]:
    harness = Harness()
    config = Config(replicas=tuple(REPLICAS), otlp=OtlpConfig(listen=HostPort("127.0.0.1", 0), replica="r0"))
    worker = WorkerProcess()  # as the agent wires it: large and compressed exports are decoded there
    harness.receiver = OtlpReceiver(config, harness.records.append, harness.count, worker=worker)
    await harness.receiver.start()
    yield harness
    await harness.receiver.stop()
    await worker.close()


def _gzip_bomb(compressed_bytes: int) -> bytes:
    """A gzip of zeros, ~1000:1: each fully flushed 1 MiB block of zeros compresses to the same bytes,
    so the bomb is built without compressing gigabytes. The trailer's CRC is wrong; a reader that
    inflates it all would only find out after 4 GiB."""
    zeros = bytes(1 << 20)
    deflater = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    head = deflater.compress(zeros) + deflater.flush(zlib.Z_FULL_FLUSH)
    block = deflater.compress(zeros) + deflater.flush(zlib.Z_FULL_FLUSH)
    return head + block * (compressed_bytes // len(block)) + deflater.flush()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


async def test_gzip_bomb_is_refused_promptly_without_inflating_it(
    default_otlp: Harness, http: ClientSession
) -> None:
    bomb = _gzip_bomb(4_000_000)
    assert len(bomb) < 4_100_000
    rss_before = _peak_rss_bytes()
    started = time.perf_counter()
    async with http.post(
        default_otlp.url, data=io.BytesIO(bomb), headers={**PROTOBUF, "Content-Encoding": "gzip"}
    ) as response:
        assert response.status == 413
    assert time.perf_counter() - started < 5
    assert default_otlp.counts[(REFUSED, "inflated_too_large")] == 1
    assert default_otlp.records == []
    # 64 MiB cap (+ the 4 MB body, aiohttp's buffers); inflating it all would be 4 GiB
    assert _peak_rss_bytes() - rss_before < 256 * 1024 * 1024


async def _max_loop_lag(done: asyncio.Event, period: float = 0.005) -> tuple[float, float]:
    """The worst tick: (CPU seconds this process spent while it waited, wall seconds late).

    The CPU is what bounds a stall this process causes itself (the GIL serialises its threads);
    the wall-clock lateness on a shared 2-core machine is mostly the scheduler's.
    """
    worst_cpu = worst_late = 0.0
    while not done.is_set():
        before, cpu = time.perf_counter(), time.process_time()
        await asyncio.sleep(period)
        worst_cpu = max(worst_cpu, time.process_time() - cpu)
        worst_late = max(worst_late, time.perf_counter() - before - period)
    return worst_cpu, worst_late


@pytest.mark.parametrize("sink_cost_s", [0.0, 20e-6], ids=["fast_sink", "agent_like_sink"])
async def test_large_export_does_not_stall_the_event_loop(
    default_otlp: Harness, http: ClientSession, sink_cost_s: float
) -> None:
    """The agent's sink (histograms + ledger queue) costs ~tens of µs a record: 15,000 in one go
    would be a 300 ms stall, so the receiver yields between batches."""

    def costly_sink(record: RequestRecord) -> None:
        until = time.perf_counter() + sink_cost_s
        while time.perf_counter() < until:
            pass
        default_otlp.records.append(record)

    assert default_otlp.receiver is not None
    default_otlp.receiver.sink = costly_sink
    copies = 5_000  # repeated fields concatenate: 15,000 request spans, ~10 MiB
    body = REQUESTS * copies
    done = asyncio.Event()
    freeze_start_up_heap()  # as `kvwatch run` does: the test session's own heap is not the agent's
    try:
        probe = asyncio.create_task(_max_loop_lag(done))
        await asyncio.sleep(0.02)
        async with http.post(default_otlp.url, data=io.BytesIO(body), headers=PROTOBUF) as response:
            assert response.status == 200
        done.set()
        cpu, late = await probe
    finally:
        gc.unfreeze()
    assert len(default_otlp.records) == 3 * copies
    # decoded on the loop (as it once was) this stalled 602 ms with the fast sink; in a thread 45-69 ms of
    # CPU per tick (the thread's pure Python holds the GIL in 5 ms turns, and a full GC walks its
    # records); in the worker process 12-18 ms. The bound is on the CPU this process spends while
    # one tick waits: wall lateness on a shared 2-core machine is mostly the scheduler's
    assert cpu < 0.05, f"event loop stalled: {cpu * 1000:.0f} ms CPU in one tick ({late * 1000:.0f} ms late)"


async def test_the_worker_process_decodes_exactly_as_a_thread_would_refusals_included() -> None:
    """Large and compressed exports are decoded in kvwatch's worker process (a 55,000-span export is
    ~0.9 s of pure Python: in a thread it holds the GIL against the loop); same records, same counts."""
    worker = WorkerProcess()

    def job(encoding: str, max_decompressed: int) -> DecodeJob:
        return DecodeJob(encoding, "application/x-protobuf", max_decompressed, one_replica(), model_labels())

    try:
        for body, encoding in (
            (REQUESTS * 300, "identity"),
            (gzip.compress(REQUESTS * 300), "gzip"),
            (STARTUP + REQUESTS, "identity"),
        ):
            here = decode_body(body, job(encoding, 64 << 20))
            there = await decode_in_worker(worker, body, job(encoding, 64 << 20))
            assert there == here and len(there[0]) == here[1]["request"] > 0
        with pytest.raises(InflatedTooLargeError):
            await decode_in_worker(worker, gzip.compress(REQUESTS * 300), job("gzip", 1 << 16))
        with pytest.raises(ValueError, match="not an OTLP protobuf"):
            await decode_in_worker(worker, b"\xff" * 1000, job("identity", 1 << 20))
        assert (await decode_in_worker(worker, REQUESTS, job("identity", 1 << 20)))[1][
            "request"
        ] == 3  # serving
    finally:
        await worker.close()


def test_huge_finish_reason_never_reaches_the_ledger_or_the_log(caplog: pytest.LogCaptureFixture) -> None:
    huge = "x" * (1 << 20)
    [record], _ = records_from_export(
        span_export({}, **{TOKENS: 3, "gen_ai.response.finish_reasons": huge}), one_replica(), model_labels()
    )
    assert record.finish_reason == "other"
    assert len(json.dumps(ledger_line(record, Config().length_bands))) < 2048
    assert (
        records_from_export(
            span_export({}, **{TOKENS: 3, "gen_ai.response.finish_reasons": ["stop:eos/1"]}),
            one_replica(),
            model_labels(),
        )[0][0].finish_reason
        == "stop:eos/1"
    )
    with caplog.at_level(logging.DEBUG, logger="kvwatch.requests.otlp"):
        _, results = records_from_export(span_export({}, **{TOKENS: huge}), one_replica(), model_labels())
    assert results == Counter(malformed=1)
    assert caplog.records and max(len(r.getMessage()) for r in caplog.records) < 512
