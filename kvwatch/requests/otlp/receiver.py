"""The OTLP/HTTP endpoint: ``POST /v1/traces``, its limits, refusals, counts and the sink.

The body is read compressed (``otlp.max_body_bytes``) and decoded off the loop (``decode.py``).
Refused exports are counted ``kvwatch_otlp_exports_refused``. With the request ledger on, an export
is accepted only once the ledger has made room for all its records (``RequestLedger.admit``); else
it is answered 503 with ``Retry-After`` before anything of it is counted, and the sender retries
it: a 2xx answer means every record reached the histograms and the ledger's queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from aiohttp import web
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from kvwatch.config import Config
from kvwatch.logthrottle import LogThrottle
from kvwatch.model import RequestRecord
from kvwatch.requests.accounting import ModelLabels
from kvwatch.requests.ledger import RequestLedger
from kvwatch.requests.otlp.decode import (
    ENCODINGS,
    SINK_BATCH,
    DecodeJob,
    InflatedTooLargeError,
    decode_off_loop,
)
from kvwatch.requests.otlp.spans import ReplicaResolver
from kvwatch.selfmetrics import Count, Report
from kvwatch.workers import WorkerFailedError, WorkerProcess

#: the source's one logger, whichever of its modules logs (operators filter on this name)
log = logging.getLogger("kvwatch.requests.otlp")

SPANS = "kvwatch_otlp_spans"
RESULTS = ("request", "ignored", "malformed", "unmapped")
REFUSED = "kvwatch_otlp_exports_refused"
REFUSALS = ("body_too_large", "inflated_too_large", "undecodable", "ledger_busy")
#: seconds a sender refused for ``ledger_busy`` is asked to wait (the ledger writes ~55,000 lines a
#: second on a shared 2-core machine: a 10,000-line backlog is gone in well under one)
RETRY_AFTER_S = 1
MAX_CONCURRENT_DECODES = 2  # each may hold max_body_bytes + max_decompressed_bytes

Sink = Callable[[RequestRecord], None]
COLLECTOR = "otlp"


class OtlpReceiver:
    """The HTTP endpoint on ``config.otlp.listen``: ``await start()``, then ``await stop()``.

    ``count`` is ``NodeState.count``; every result series starts at zero so ``rate()`` sees the
    first. ``report`` (``NodeState.report``) is told of each export received, as collector ``otlp``.
    ``ledger``: the request ledger ``sink`` writes to, if any; ``sink`` must then write each record
    as admitted (``RequestLedger.write(record, admitted=True)``), the room having been made for it.
    """

    def __init__(
        self,
        config: Config,
        sink: Sink,
        count: Count,
        report: Report | None = None,
        worker: WorkerProcess | None = None,
        ledger: RequestLedger | None = None,
    ) -> None:
        if config.otlp.listen is None:
            raise ValueError("otlp.listen is not set")
        self.listen = config.otlp.listen
        self.config = config.otlp
        self.worker = worker
        #: the ledger ``sink`` writes to: it must write each record as admitted (``write(r, True)``)
        self.ledger = ledger
        known = frozenset(config.known_models)
        self.resolver = ReplicaResolver([r.name for r in config.replicas], config.otlp.replica)
        self.labels = {r.name: ModelLabels(known, r.model_name) for r in config.replicas}
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

    async def start(self) -> None:
        for result in RESULTS:
            self._count(result, 0)
        for reason in REFUSALS:
            self._count_family(REFUSED, reason, 0)
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/traces", self.handle)
        # auto_decompress off: aiohttp would inflate before client_max_size is checked; inflate() caps it
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, auto_decompress=False)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.listen.host, self.listen.port)
        await self._site.start()
        log.info("OTLP/HTTP trace receiver listening on %s:%d/v1/traces", self.listen.host, self.port)

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
            self._throttle.log(
                log,
                logging.WARNING,
                "body_too_large",
                "otlp: export over otlp.max_body_bytes (%d) refused",
                self.config.max_body_bytes,
            )
            raise
        if self.ledger is not None and self.ledger.busy():  # refused before paying for the decode
            return self._ledger_busy(request.remote, content_type)
        try:
            async with self._decoding:
                job = DecodeJob(
                    encoding, content_type, self.config.max_decompressed_bytes, self.resolver, self.labels
                )
                records, results = await decode_off_loop(self.worker, body, job)
        except InflatedTooLargeError as exc:
            self._refuse("inflated_too_large")
            self._report(False, started, str(exc))
            self._throttle.log(
                log, logging.WARNING, "inflated_too_large", "otlp: %s from %s", exc, request.remote
            )
            return _failure(413, RESOURCE_EXHAUSTED, str(exc), content_type)
        except WorkerFailedError as exc:  # the worker was killed and is replaced at the next export
            self._report(False, started, str(exc))
            self._throttle.log(
                log,
                logging.WARNING,
                "worker_failed",
                "otlp: %s; export from %s refused with 503",
                exc,
                request.remote,
            )
            return _failure(503, UNAVAILABLE, "try again", content_type)
        except ValueError as exc:
            self._refuse("undecodable")
            self._report(False, started, str(exc))
            self._throttle.log(log, logging.WARNING, "undecodable", "otlp: %s from %s", exc, request.remote)
            return _failure(400, INVALID_ARGUMENT, str(exc), content_type)
        if self.ledger is not None and not self.ledger.admit(len(records)):
            return self._ledger_busy(request.remote, content_type)
        for result, n in results.items():
            self._count(result, n)
        await self._sink_all(records)
        self._report(True, started)
        return _success(results.get("malformed", 0) + results.get("unmapped", 0), content_type)

    def _ledger_busy(self, remote: str | None, content_type: str) -> web.Response:
        """503 + Retry-After: the ledger cannot take this export now; nothing of it was counted.
        Backpressure, not a failure: the source's collector status stays as it was."""
        self._count_family(REFUSED, "ledger_busy", 1)
        self._throttle.log(
            log,
            logging.WARNING,
            "ledger_busy",
            "otlp: export from %s refused with 503, the request ledger is busy; the sender "
            'retries it (kvwatch_otlp_exports_refused_total{reason="ledger_busy"})',
            remote,
        )
        response = _failure(503, UNAVAILABLE, "request ledger busy, retry", content_type)
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    async def _sink_all(self, records: list[RequestRecord]) -> None:
        """The sink (histograms, ledger) runs on the loop: yield between batches of a big export."""
        sunk = 0
        try:
            for start in range(0, len(records), SINK_BATCH):
                if start:
                    await asyncio.sleep(0)
                for record in records[start : start + SINK_BATCH]:
                    sunk += 1
                    try:
                        self.sink(record)
                    except Exception:
                        self._throttle.log(
                            log, logging.ERROR, "sink", "otlp: request sink failed", exc_info=True
                        )
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


#: google.rpc.Code values of the failures kvwatch answers (OTLP/HTTP puts them in the Status body)
INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE = 3, 8, 14


def _failure(status: int, code: int, message: str, content_type: str) -> web.Response:
    """OTLP/HTTP's failure: a ``google.rpc.Status`` body in the request's own encoding (opentelemetry-
    proto ``docs/specification.md``, "Failures"). Its two fields are encoded here: the message type
    lives in googleapis-common-protos, a dependency for 2 fields."""
    if content_type == "application/json":
        body = json.dumps({"code": code, "message": message}).encode()
    else:
        text = message.encode()
        body = b"\x08" + _varint(code) + b"\x12" + _varint(len(text)) + text
    return web.Response(status=status, body=body, content_type=content_type)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _success(rejected: int, content_type: str) -> web.Response:
    """Accepted; spans kvwatch could not use (malformed, or of no replica it knows) are rejected in
    ``partial_success``, as the spec asks of a server that drops part of an export."""
    response = ExportTraceServiceResponse()
    if rejected:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = "spans malformed or of no replica kvwatch knows"
    if content_type == "application/json":
        body = json_format.MessageToJson(response, indent=None).encode()
    else:
        body = response.SerializeToString()
    return web.Response(body=body, content_type=content_type)
