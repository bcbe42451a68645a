"""The request ledger under one large OTLP export, then another: nothing the receiver accepted is lost.

Its queue holds 10,000 lines one at a time. Before, a 40,000-span export followed by a 55,000-span
one dropped ~12,000 ledger lines (each with a WARNING of its own) while the receiver answered 200 to
both. Now an export is accepted only once the ledger has room for all of it; otherwise it is
answered 503 with Retry-After, which OTLP exporters honour, and sent again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from kvwatch.agent import Agent
from kvwatch.config import Config, HostPort, LedgerConfig, NvmlConfig, OtlpConfig, ReplicaConfig
from kvwatch.model import DEFAULT_BANDS, Outcome, RequestRecord
from kvwatch.requests.ledger import RequestLedger
from tests.local import until

LISTEN = HostPort("127.0.0.1", 0)
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _export(spans: int, first_id: int) -> bytes:
    """``spans`` request spans of one resource, each with its own output-token count (to find it)."""
    export = ExportTraceServiceRequest()
    scope = export.resource_spans.add().scope_spans.add()
    for i in range(first_id, first_id + spans):
        span = scope.spans.add(name="llm_request", start_time_unix_nano=1_700_000_000_000_000_000)
        span.attributes.extend(
            [
                KeyValue(key="gen_ai.usage.completion_tokens", value=AnyValue(int_value=i)),
                KeyValue(key="gen_ai.latency.e2e", value=AnyValue(double_value=1.5)),
                KeyValue(key="gen_ai.latency.time_to_first_token", value=AnyValue(double_value=0.25)),
            ]
        )
    return export.SerializeToString()


async def _send_as_an_exporter_does(client: httpx.AsyncClient, url: str, body: bytes) -> list[int]:
    """POST until a 2xx, waiting Retry-After on 429/503 (the OTLP/HTTP exporters' retry rule)."""
    statuses = []
    for _ in range(60):
        response = await client.post(url, content=body, headers=PROTOBUF, timeout=60)
        statuses.append(response.status_code)
        if response.status_code not in (429, 503):
            return statuses
        await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
    return statuses


async def test_a_large_export_then_another_loses_no_ledger_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ledger.jsonl"
    config = Config(
        replicas=(ReplicaConfig(name="r0", metrics_url="http://127.0.0.1:9/metrics", model_name="m"),),
        listen=LISTEN,
        nvml=NvmlConfig(fake_gpus=0),
        otlp=OtlpConfig(listen=LISTEN, max_body_bytes=64 << 20, max_decompressed_bytes=64 << 20),
        ledger=LedgerConfig(path=str(path)),
    )
    first, second = _export(40_000, 0), _export(55_000, 40_000)
    agent = Agent(config)
    caplog.set_level(logging.WARNING, logger="kvwatch.requests.ledger")
    await agent.start()
    try:
        url = f"http://127.0.0.1:{agent.otlp_port}/v1/traces"
        async with httpx.AsyncClient() as client:
            answers = [await _send_as_an_exporter_does(client, url, body) for body in (first, second)]
        assert [a[-1] for a in answers] == [200, 200], answers
    finally:
        await agent.stop()  # the ledger's writer drains its queue before it stops
    lines = path.read_text().splitlines()
    assert len(lines) == 95_000, f"{95_000 - len(lines)} accepted requests missing from the ledger"
    found = sorted(int(line.split('"output_tokens":')[1].split(",")[0]) for line in lines)
    assert found == list(range(95_000))  # each request once
    assert agent.state.counters_for("kvwatch_ledger_write_errors") == [((), 0)]
    refused = dict(agent.state.counters_for("kvwatch_otlp_exports_refused"))
    assert refused[("ledger_busy",)] == sum(a.count(503) for a in answers)
    spans = dict(agent.state.counters_for("kvwatch_otlp_spans"))
    assert spans[("request",)] == 95_000  # a refused export was not counted, its retry once
    assert len([r for r in caplog.records if r.name == "kvwatch.requests.ledger"]) <= 1


def _record(i: int = 0) -> RequestRecord:
    return RequestRecord(
        replica="r0",
        model_name="m",
        source="proxy",
        outcome=Outcome.COMPLETED,
        started_at=1.7e9,
        output_tokens=i,
    )


def test_admission_makes_room_for_a_whole_export_or_refuses_it(tmp_path: Path) -> None:
    ledger = RequestLedger(str(tmp_path / "l.jsonl"), DEFAULT_BANDS, queue_size=10)
    assert ledger.admit(25)  # larger than the queue, but nothing else admitted waits: let in alone
    assert ledger.busy()
    assert not ledger.admit(1)  # refused while it waits (the receiver answers 503)
    for i in range(25):
        ledger.write(_record(i), admitted=True)  # never dropped for room
    for i in range(10):
        ledger.write(_record(i))  # one-at-a-time sources keep their own 10 lines of room
    ledger.start()
    ledger.stop()
    assert len((tmp_path / "l.jsonl").read_text().splitlines()) == 35
    assert not ledger.busy() and ledger.admit(10)
    ledger.release(10)
    assert ledger.admit(10) and not ledger.admit(1)


def test_a_burst_of_drops_is_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    counts: list[float] = []
    ledger = RequestLedger(
        str(tmp_path / "l.jsonl"),
        DEFAULT_BANDS,
        queue_size=2,
        counter=lambda family, *labels, amount=1: counts.append(amount),
    )
    with caplog.at_level(logging.WARNING, logger="kvwatch.requests.ledger"):
        for i in range(500):  # the writer is not started: nothing drains the queue
            ledger.write(_record(i))
    assert sum(counts) == 498
    assert len(caplog.records) == 1


VLLM_PYTHON = Path.home() / ".cache" / "kvwatch-vllm" / "venv" / "bin" / "python"
#: the OTLP/HTTP exporter vLLM exports its spans with (opentelemetry-exporter-otlp-proto-http, in the
#: CPU vLLM's venv); it retries 429/502/503/504 and waits the Retry-After it is given
#: (opentelemetry/exporter/otlp/common/http.py, 1.45.2)
EXPORTER = """
import sys
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

kept = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(kept))
for i in range(5):
    with provider.get_tracer("t").start_as_current_span("llm_request") as span:
        span.set_attribute("gen_ai.usage.completion_tokens", 1_000_000 + i)
        span.set_attribute("gen_ai.latency.e2e", 1.0)
print("ready", flush=True)
sys.stdin.readline()
print(OTLPSpanExporter(endpoint=sys.argv[1]).export(kept.get_finished_spans()).name, flush=True)
"""


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no CPU vLLM venv (scripts/setup-test-env.sh)")
async def test_the_otlp_exporter_vllm_uses_retries_a_ledger_busy_refusal(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    config = Config(
        replicas=(ReplicaConfig(name="r0", metrics_url="http://127.0.0.1:9/metrics", model_name="m"),),
        listen=LISTEN,
        nvml=NvmlConfig(fake_gpus=0),
        otlp=OtlpConfig(listen=LISTEN, max_body_bytes=64 << 20),
        ledger=LedgerConfig(path=str(path)),
    )
    agent = Agent(config)
    await agent.start()
    disk = threading.Event()  # the ledger's disk stalls until the exporter has been refused once
    ledger = agent._ledger
    assert ledger is not None
    write = ledger._write
    ledger._write = lambda lines: (disk.wait(30), write(lines))  # type: ignore[method-assign]
    try:
        url = f"http://127.0.0.1:{agent.otlp_port}/v1/traces"
        exporter = await asyncio.create_subprocess_exec(
            str(VLLM_PYTHON),
            "-c",
            EXPORTER,
            url,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert exporter.stdin is not None and exporter.stdout is not None
        assert await asyncio.wait_for(exporter.stdout.readline(), 60) == b"ready\n"
        async with httpx.AsyncClient() as client:  # fills the ledger's queue four times over
            response = await client.post(url, content=_export(40_000, 0), headers=PROTOBUF, timeout=60)
            assert response.status_code == 200
        exporter.stdin.write(b"go\n")
        await exporter.stdin.drain()
        await until(
            lambda: dict(agent.state.counters_for("kvwatch_otlp_exports_refused"))[("ledger_busy",)],
            15,
            "an export refused while the ledger is busy",
            interval_s=0.05,
        )
        disk.set()
        assert await asyncio.wait_for(exporter.stdout.readline(), 60) == b"SUCCESS\n"
        await exporter.wait()
        refused = dict(agent.state.counters_for("kvwatch_otlp_exports_refused"))
    finally:
        await agent.stop()
    assert refused[("ledger_busy",)] >= 1  # it was refused, waited Retry-After and sent again
    tokens = [int(line.split('"output_tokens":')[1].split(",")[0]) for line in path.read_text().splitlines()]
    assert len(tokens) == 40_005 and sorted(tokens)[-5:] == [1_000_000 + i for i in range(5)]
