"""Follower of SGLang's per-request metrics files (``--export-metrics-to-file``), no proxy needed.

SGLang (``FileRequestMetricsExporter``) appends one JSON object per finished request to
``DIR/sglang-request-metrics-YYYYMMDD_HH.log``, a new file every hour. A line holds
``request_parameters`` (the request as a JSON *string*, prompt included: kvwatch reads only
``sampling_params.max_new_tokens`` from it and never keeps, logs or exports anything else) and the
response's ``meta_info`` fields (spread at the top level by SGLang; a nested ``meta_info`` object is
read too): ``prompt_tokens``, ``completion_tokens``, ``finish_reason`` (an object such as
``{"type": "length", "length": 512}`` or a plain string), ``e2e_latency``, and with
``--enable-metrics`` ``request_received_ts``, ``response_sent_to_client_ts``, ``queue_time``,
``decode_throughput``.

Following: offsets are kept per file in memory. At start the follower begins at the end of files
that already exist (``from_start`` reads them whole); files that appear later are read from their
start. Only complete lines are read (a partial last line waits for its newline); a line that is
not a JSON object or whose fields have the wrong types is counted
(``kvwatch_request_file_lines_total{result="malformed"}``) and skipped. A file that shrinks was
rewritten and is read again from its start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvwatch.config import Config, SglangFilesConfig
from kvwatch.jsonsafe import finite, loads
from kvwatch.logthrottle import LogThrottle
from kvwatch.model import Outcome, RequestRecord
from kvwatch.requests.accounting import ModelLabels
from kvwatch.requests.values import bounded_count, non_negative_int, non_negative_number, safe_token
from kvwatch.selfmetrics import Count, Report
from kvwatch.tasks import cancel_and_wait

log = logging.getLogger(__name__)

FILE_PATTERN = re.compile(r"^sglang-request-metrics-\d{8}_\d{2}\.log$")
LINES = "kvwatch_request_file_lines"
#: per file per poll, so a backlog never stalls a poll; also the longest line read (request_parameters
#: carries the prompt, so lines can be large): a longer one is skipped and counted malformed
MAX_READ_BYTES = 16 * 1024 * 1024
ACTIVE_FILES = 2  # the current hour's file and the one before (a request finishing at :59:59)

Sink = Callable[[RequestRecord], None]


class MalformedLineError(ValueError):
    pass


def finish_of(value: Any) -> tuple[str | None, int | None]:
    """SGLang's finish reason: ``{"type": ..., "status_code": ...}`` or a plain string."""
    if isinstance(value, dict):
        kind = value.get("type")
        status = value.get("status_code")
        return (
            safe_token(kind) if isinstance(kind, str) else None,
            status
            if isinstance(status, int) and not isinstance(status, bool) and 100 <= status <= 599
            else None,
        )
    if isinstance(value, str):
        return safe_token(value), None
    return None, None


def outcome_of(kind: str | None, status: int | None) -> Outcome:
    if status is not None and 400 <= status < 500:
        return Outcome.REJECTED  # e.g. an abort for an over-long prompt
    if status is not None and status >= 500:
        return Outcome.ERROR
    if kind == "length":
        return Outcome.TRUNCATED
    if kind == "abort":
        return Outcome.ABORTED
    return Outcome.COMPLETED


def _request_parameters(parameters: Any) -> dict[str, Any]:
    """The request's parameters (a JSON string in the line); empty where they do not parse."""
    if not isinstance(parameters, str):
        return {}
    try:
        doc = loads(parameters)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _max_new_tokens(parameters: dict[str, Any], dropped: list[str]) -> int | None:
    """``sampling_params.max_new_tokens`` from the request parameters; nothing else is kept."""
    sampling = parameters.get("sampling_params")
    if isinstance(sampling, list):  # a batch request: one sampling dict per prompt
        sampling = sampling[0] if sampling else None
    value = sampling.get("max_new_tokens") if isinstance(sampling, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return None
    return bounded_count(value, "max_tokens", dropped)


def _queue_seconds(meta: dict[str, Any], dropped: list[str]) -> float | None:
    """SGLang's queue time. A retracted request's reads negative (its re-queue overwrote the queue
    entry time, its first forward's stayed: ``SchedulerReqTimeStats``): unknown, and the request
    is kept, not refused as malformed (those are the long requests preempted under KV pressure)."""
    value = meta.get("queue_time")
    number = finite(value) if value is not None else None
    if number is not None and number < 0:
        dropped.append("queue_seconds")
        return None
    return non_negative_number(meta, "queue_time")


def line_record(doc: Any, replica: str, model_name: str, now: float) -> RequestRecord:
    """One exporter line -> RequestRecord (source ``sglang_file``); raises MalformedLineError (a
    ValueError, as a bad number raises)."""
    if not isinstance(doc, dict):
        raise MalformedLineError("a line must be a JSON object")
    nested = doc.get("meta_info")
    meta = nested if isinstance(nested, dict) else doc
    dropped: list[str] = []
    output = bounded_count(non_negative_int(meta, "completion_tokens"), "output_tokens", dropped)
    prompt = bounded_count(non_negative_int(meta, "prompt_tokens"), "prompt_tokens", dropped)
    parameters = _request_parameters(doc.get("request_parameters"))
    limit = _max_new_tokens(parameters, dropped)
    stream = parameters.get("stream")
    streaming = stream if isinstance(stream, bool) else None
    e2e = non_negative_number(meta, "e2e_latency")
    queue = _queue_seconds(meta, dropped)
    kind, status = finish_of(meta.get("finish_reason"))
    decode = ttft = None
    throughput = non_negative_number(meta, "decode_throughput")  # (completion_tokens - 1) / decode time
    # not streamed, SGLang's "first token" is its first output batch (every 50 tokens, or the end):
    # no TTFT or decode time to read from it, as the proxy takes none from a response in one piece
    if throughput and output is not None and output > 1 and streaming is not False:
        decode = (output - 1) / throughput
        if e2e is not None:
            ttft = max(e2e - decode, 0.0)
    received = non_negative_number(meta, "request_received_ts")
    if received is None:
        sent = non_negative_number(meta, "response_sent_to_client_ts") or non_negative_number(
            meta, "request_finished_ts"
        )
        received = (sent if sent is not None else now) - (e2e or 0.0)
    return RequestRecord(
        replica=replica,
        model_name=model_name,
        source="sglang_file",
        outcome=outcome_of(kind, status),
        started_at=received,
        finish_reason=kind,
        status_code=status,
        prompt_tokens=prompt,
        output_tokens=output,
        max_tokens=limit,
        ttft_seconds=ttft,
        e2e_seconds=e2e,
        queue_seconds=queue,
        decode_seconds=decode,
        streaming=streaming,
        dropped_values=tuple(dropped),
    )


@dataclass(slots=True)
class _Followed:
    offset: int
    size: int = -1
    skipping: bool = False  # inside a line longer than MAX_READ_BYTES
    identity: tuple[int, int] | None = None  # (device, inode): a file deleted and made anew differs
    tail: bytes = b""  # the last bytes read: a file made anew at the same inode differs there


@dataclass(eq=False)
class SglangFileFollower:
    """Polls one SGLang export directory; ``poll()`` returns the new records (call from a thread)."""

    config: SglangFilesConfig
    model_name: str
    count: Count
    from_start: bool = False
    report: Report | None = None
    collector: str = field(init=False)
    error: str | None = field(init=False, default=None)  # why the last poll could not list the directory
    files: dict[str, _Followed] = field(init=False, default_factory=dict)
    _started: bool = field(init=False, default=False)
    _missing_logged: bool = field(init=False, default=False)
    #: the engine's files can repeat every line below at will
    _throttle: LogThrottle = field(init=False, default_factory=LogThrottle)
    _task: asyncio.Task | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.collector = f"sglang_files:{self.config.replica}"
        for result in ("request", "malformed"):  # zero series from the start
            with contextlib.suppress(Exception):
                self.count(LINES, self.config.replica, result, amount=0)

    def poll(self) -> list[RequestRecord]:
        try:
            names = sorted(n for n in os.listdir(self.config.directory) if FILE_PATTERN.match(n))
        except OSError as exc:
            self.error = f"cannot list {self.config.directory}: {exc.strerror or exc}"
            self._started = True  # nothing existed at start: files that appear later are new
            if not self._missing_logged:
                self._missing_logged = True
                log.warning(
                    "sglang_request_files[%s]: cannot list %s (%s); will keep trying",
                    self.config.replica,
                    self.config.directory,
                    exc.strerror or exc,
                )
            return []
        self._missing_logged = False
        self.error = None
        records: list[RequestRecord] = []
        for name in names:
            if name not in self.files:
                path = os.path.join(self.config.directory, name)
                start_at_end = not self._started and not self.from_start
                size, identity = _stat(path)
                self.files[name] = _Followed(
                    offset=size if start_at_end and size >= 0 else 0, identity=identity
                )
        self._started = True
        for gone in set(self.files) - set(names):
            del self.files[gone]
        active = set(names[-ACTIVE_FILES:])
        for name in names:
            state = self.files[name]
            if name in active or state.size < 0 or state.offset < state.size:
                records += self._read(name, state)
        return records

    def _read(self, name: str, state: _Followed) -> list[RequestRecord]:
        path = os.path.join(self.config.directory, name)
        size, identity = _stat(path)
        if size < 0:
            return []
        if size < state.offset or identity != state.identity:  # rewritten: shorter, or another file
            state.offset, state.skipping, state.identity, state.tail = 0, False, identity, b""
        state.size = size
        if size == state.offset:
            return []
        try:
            with open(path, "rb") as f:
                f.seek(state.offset - len(state.tail))
                if f.read(len(state.tail)) != state.tail:  # made anew, its inode reused
                    state.offset, state.skipping, state.tail = 0, False, b""
                f.seek(state.offset)
                data = f.read(min(size - state.offset, MAX_READ_BYTES))
        except OSError as exc:
            self._throttle.log(
                log,
                logging.WARNING,
                "read",
                "sglang_request_files[%s]: cannot read %s: %s",
                self.config.replica,
                path,
                exc.strerror or exc,
            )
            return []
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) == MAX_READ_BYTES:  # no newline in 16 MiB: skip this line
                state.offset += len(data)
                state.tail = (state.tail + data)[-TAIL_BYTES:]
                if not state.skipping:
                    state.skipping = True
                    self._counted("malformed")
            return []  # else a partial last line: wait for its newline
        state.offset += end + 1
        state.tail = (state.tail + data[: end + 1])[-TAIL_BYTES:]
        lines = data[:end].split(b"\n")
        if state.skipping:
            state.skipping = False
            lines = lines[1:]  # the rest of the oversized line
        now = time.time()
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                out.append(line_record(loads(line), self.config.replica, self.model_name, now))
            except Exception:  # not what SGLang writes (or a line this reader fails on): that line only,
                self._counted("malformed")  # the offset has moved past the whole read
                continue
            self._counted("request")
        return out

    def _counted(self, result: str) -> None:
        with contextlib.suppress(Exception):
            self.count(LINES, self.config.replica, result)

    async def run(self, sink: Sink) -> None:
        """Poll forever on the loop's default executor, emitting records on the loop thread."""
        while True:
            started = time.perf_counter()
            try:
                records = await asyncio.to_thread(self.poll)
            except Exception as exc:
                self._throttle.log(
                    log,
                    logging.ERROR,
                    "poll",
                    "sglang_request_files[%s]: poll failed",
                    self.config.replica,
                    exc_info=True,
                )
                records, self.error = [], repr(exc)
            if self.report is not None:
                with contextlib.suppress(Exception):
                    self.report(self.collector, self.error is None, time.perf_counter() - started, self.error)
            for record in records:
                try:
                    sink(record)
                except Exception:
                    self._throttle.log(
                        log,
                        logging.ERROR,
                        "sink",
                        "sglang_request_files[%s]: request sink failed",
                        self.config.replica,
                        exc_info=True,
                    )
            await asyncio.sleep(self.config.poll_s)

    def start(self, sink: Sink) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(sink))

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)


async def start_follower(
    files: SglangFilesConfig,
    config: Config,
    sink: Sink,
    count: Count,
    report: Report | None = None,
    from_start: bool = False,
) -> SglangFileFollower:
    """Follow one replica's export directory (the agent's wiring entry point); ``await stop()``.

    ``report`` (``NodeState.report``) hears of every poll as collector ``sglang_files:<replica>``.
    """
    replica = config.replica(files.replica)
    model = ModelLabels(config.known_models, replica.model_name if replica else None).label(None)
    follower = SglangFileFollower(files, model, count, from_start, report)
    follower.start(sink)
    return follower


#: bytes before the offset remembered to tell a file from a new one at the same inode (the end of
#: the last line read holds its request's own timestamps: another file does not repeat them there)
TAIL_BYTES = 64


def _stat(path: str) -> tuple[int, tuple[int, int] | None]:
    """(size, (device, inode)); (-1, None) for a file that cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return -1, None
    return st.st_size, (st.st_dev, st.st_ino)
