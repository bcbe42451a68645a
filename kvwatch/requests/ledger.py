"""Request ledger: one JSON line per finished request, for ``kvwatch report``. Off by default.

Written by one background thread, every 0.1 s or per 512 lines, so the proxy's loop never waits on
disk. A line is
encoded where ``write`` is called (the loop, for the proxy), and the thread only hands bytes to
write(2), which releases the GIL: were it to encode, it would take the GIL just as a request ends,
which is when that client's next request arrives, and the loop would wait for it (measured: +0.2 ms
on the late-tail TTFT median, docs/performance.md). One line at
a time (the proxy, the vLLM plugin, SGLang files) may wait ``queue_size`` deep; past that, or on a
failed write, a line is dropped and counted (``kvwatch_ledger_write_errors_total``), with one log
line per burst. A bulk source (an OTLP export: 55,000 spans in one POST) asks ``admit(n)`` before
it accepts the export: admitted lines are never dropped for room, and an export that does not fit
is refused by the receiver with 503 and ``Retry-After`` (the sender retries it later), so nothing
the receiver answered 2xx is lost. Admitted lines still to write are at most
``max(queue_size, the largest single export)``: one export larger than the queue is let in alone,
its records being in memory already (the receiver decoded them).
The file rotates at ``max_bytes`` (``path`` -> ``path.1`` -> ... ``path.<backups>``), so the ledger
takes at most ``(backups + 1) x max_bytes`` of disk.

A line is ``{"v": 1, <every RequestRecord field>, "length_band", "admission_band",
"tpot_seconds"}``. ``RequestRecord`` carries no prompt or completion text, and ``model_name`` is the
bounded label value, so neither can reach the ledger.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
from typing import BinaryIO

from kvwatch.logthrottle import LogThrottle
from kvwatch.model import LEDGER_VERSION, LengthBands, RequestRecord
from kvwatch.selfmetrics import Count

log = logging.getLogger(__name__)

WRITE_ERRORS = "kvwatch_ledger_write_errors"
MIN_LINES_PER_SECOND = 20_000  # what stop() allows the writer for a backlog (measured: ~55,000)
FLUSH_S = 0.1  # the writer wakes this often, or once BATCH_LINES are waiting
BATCH_LINES = 512


_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))


def encode_line(record: RequestRecord, bands: LengthBands) -> bytes:
    """One ledger line, newline included."""
    return (json.dumps(ledger_line(record, bands), separators=(",", ":")) + "\n").encode()


def ledger_line(record: RequestRecord, bands: LengthBands) -> dict:
    """The ledger's view of one request (docs/requests.md "Request ledger")."""
    line: dict = {"v": LEDGER_VERSION}
    for name in _FIELDS:
        value = getattr(record, name)
        line[name] = list(value) if isinstance(value, tuple) else value
    line["outcome"] = record.outcome.value
    line["length_band"] = bands.band_for(record.output_tokens)
    line["admission_band"] = bands.band_for(record.max_tokens)
    line["tpot_seconds"] = record.tpot_seconds
    return line


@dataclasses.dataclass(eq=False)
class RequestLedger:
    """``write(record)`` from any thread or the loop; never blocks, never raises."""

    path: str
    bands: LengthBands
    max_bytes: int = 64 * 1024 * 1024
    backups: int = 4
    counter: Count | None = None
    queue_size: int = 10_000
    #: (encoded line, admitted) items; its depth is bounded by the two counts below
    _pending: list[tuple[bytes, bool]] = dataclasses.field(init=False, default_factory=list)
    _lock: threading.Lock = dataclasses.field(init=False, default_factory=threading.Lock)
    _wake: threading.Condition = dataclasses.field(init=False)
    _stopping: bool = dataclasses.field(init=False, default=False)
    #: lines write() queued one at a time, not yet written
    _waiting: int = dataclasses.field(init=False, default=0)
    #: lines admit() made room for, not yet written (queued or still to come)
    _admitted: int = dataclasses.field(init=False, default=0)
    _throttle: LogThrottle = dataclasses.field(init=False, default_factory=LogThrottle)
    _thread: threading.Thread | None = dataclasses.field(init=False, default=None)
    _file: BinaryIO | None = dataclasses.field(init=False, default=None)
    _size: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        self._wake = threading.Condition(self._lock)

    def start(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        if self.counter is not None:
            with contextlib.suppress(Exception):
                self.counter(WRITE_ERRORS, amount=0)  # a zero series from the start
        self._thread = threading.Thread(target=self._run, name="kvwatch-ledger", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        """True while admitted lines fill the queue: a bulk source may refuse before decoding."""
        with self._lock:
            return self._admitted >= self.queue_size

    def admit(self, lines: int) -> bool:
        """Make room for ``lines`` a bulk source is about to ``write(..., admitted=True)``; False when
        they do not fit now (the source refuses them, to be sent again). An export larger than the
        queue is admitted when nothing else admitted is waiting."""
        with self._lock:
            if self._admitted and self._admitted + lines > self.queue_size:
                return False
            self._admitted += lines
            return True

    def release(self, lines: int) -> None:
        """Give back room ``admit`` made for lines that will not be written after all."""
        with self._lock:
            self._admitted = max(0, self._admitted - lines)

    def write(self, record: RequestRecord, admitted: bool = False) -> None:
        """Queue one line; ``admitted``: its room was made by ``admit`` (it is never dropped for room)."""
        try:
            line = encode_line(record, self.bands)
        except (TypeError, ValueError, OverflowError) as exc:
            if admitted:
                self.release(1)
            self._failed(1, f"cannot encode: {type(exc).__name__}", "encode")
            return
        with self._lock:
            full = not admitted and self._waiting >= self.queue_size
            if not full:
                self._waiting += not admitted
                self._pending.append((line, admitted))
                if len(self._pending) == BATCH_LINES:
                    self._wake.notify()
        if full:
            self._failed(1, "queue full", "queue_full")

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop: waits ``timeout`` or longer for a long backlog (an
        admitted export may queue more than 10,000 lines; the writer does ~55,000 a second)."""
        if self._thread is None:
            return
        with self._lock:
            backlog = self._waiting + self._admitted
            self._stopping = True
            self._wake.notify()
        self._thread.join(max(timeout, backlog / MIN_LINES_PER_SECOND))
        self._thread = None

    # -- writer thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        """Every ``FLUSH_S``, or as soon as ``BATCH_LINES`` wait: not once per line, since a wake-up
        per request puts a third thread on the cores just as the next request arrives."""
        try:
            while True:
                with self._lock:
                    if not self._stopping and len(self._pending) < BATCH_LINES:
                        self._wake.wait(FLUSH_S)
                    items, self._pending = self._pending[:BATCH_LINES], self._pending[BATCH_LINES:]
                    stop = self._stopping and not self._pending
                if items:
                    self._write([line for line, _ in items])
                    admitted = sum(1 for _, was_admitted in items if was_admitted)
                    with self._lock:
                        self._admitted = max(0, self._admitted - admitted)
                        self._waiting -= len(items) - admitted
                if stop:
                    return
        finally:
            self._close()

    def _write(self, lines: list[bytes]) -> None:
        """One write per file the batch goes to: a batch that crosses ``max_bytes`` is split where
        the file rotates, so no file outgrows it (a single line larger than it gets a file alone)."""
        start = 0
        while start < len(lines):
            try:
                file = self._file if self._file is not None else self._open()
                room, end = self.max_bytes - self._size, start
                while end < len(lines) and (room >= len(lines[end]) or (end == start and self._size == 0)):
                    room -= len(lines[end])
                    end += 1
                if end == start:  # the file is full: the next line starts the next one
                    self._rotate()
                    continue
                data = b"".join(lines[start:end])
                file.write(data)
                file.flush()
                self._size += len(data)
            except OSError as exc:
                self._close()
                self._failed(len(lines) - start, f"{self.path}: {exc.strerror or exc}", "write")
                return
            start = end

    def _open(self) -> BinaryIO:
        file = self._file = open(self.path, "ab")  # noqa: SIM115 - held open across batches
        self._size = file.tell()
        if self._size >= self.max_bytes:
            return self._rotate()
        return file

    def _rotate(self) -> BinaryIO:
        self._close()
        if self.backups > 0:
            for i in range(self.backups - 1, 0, -1):
                src = f"{self.path}.{i}"
                if os.path.exists(src):
                    os.replace(src, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        else:
            os.truncate(self.path, 0)
        file = self._file = open(self.path, "ab")  # noqa: SIM115
        self._size = 0
        return file

    def _close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _failed(self, lines: int, reason: str, kind: str) -> None:
        """Count every dropped line; log one line per ``kind`` per burst (LogThrottle)."""
        if self.counter is not None:
            with contextlib.suppress(Exception):
                self.counter(WRITE_ERRORS, amount=lines)
        self._throttle.log(
            log,
            logging.WARNING,
            kind,
            "request ledger: %d line(s) dropped (%s); every dropped line is counted in "
            "kvwatch_ledger_write_errors_total",
            lines,
            reason,
        )
