"""The accounting channel from a relay worker process to the agent: what the in-process proxy hands
the agent directly (``Sink``, ``Count``, ``InFlight``), batched into datagrams on a unix
``SOCK_SEQPACKET`` socket pair.

Why SEQPACKET: it keeps message boundaries like a datagram socket, but it is connected, so the
agent reads an end of file when a worker dies, after every message the worker sent before dying.
That is what makes the accounting exact: each record the worker sent is applied once, and the
requests the worker had started but not finished are known and counted as lost.

Batching: messages made in one loop turn go out in one datagram on the next (``call_soon``), so a
busy worker sends a few hundred datagrams a second, not one per request. Counter increments are
summed per series until then; in-flight progress (chunks so far, per stream, for the live gauges)
is sent at most every ``PROGRESS_INTERVAL_S``.

When the channel backs up (the agent's loop is slow to read), the worker never waits: datagrams
queue in the worker, up to ``MAX_BACKLOG_BYTES``. Past that, finished records and in-flight starts
are dropped and *counted* (``kvwatch_proxy_worker_records_lost_total{reason="backlog"}``), counter
sums and in-flight finishes are still kept (they are small and bounded by the open streams). The
proxy must never make a client's request worse: blocking a worker would stall every stream on it.

Wire format: one datagram is a JSON array of messages, each an array whose first item says what
it is (``MESSAGE_KINDS``). A record is its ``RequestRecord`` fields in declaration order. Records
carry labels, counts and times only, never prompt or completion text (``RequestRecord`` has no
field for either). The agent checks every field's type, and that its replica is one this worker
group serves, before applying anything: a datagram that fails is refused whole and counted
(``kvwatch_proxy_worker_datagrams_refused_total``).

The other way, the agent sends a worker one message only: ``["log_level", N]`` when a config reload
changed the log level (``logging`` level numbers), so the workers log as the agent does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import time
import types
import typing
from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

from kvwatch.jsonsafe import finite, loads
from kvwatch.model import InFlightRequest, Outcome, RequestRecord
from kvwatch.requests.accounting import InFlight
from kvwatch.requests.proxy.seams import ACCOUNTING_ERRORS, RELAY_COUNTERS, Sink
from kvwatch.selfmetrics import Count

log = logging.getLogger("kvwatch.requests.proxy.workers")

RECORDS_LOST = "kvwatch_proxy_worker_records_lost"  # replica, reason: worker_died | backlog
DATAGRAMS_REFUSED = "kvwatch_proxy_worker_datagrams_refused"
WORKER_RESTARTS = "kvwatch_proxy_worker_restarts"

#: the counter families a worker may increment through the channel (anything else is refused)
WORKER_FAMILIES = RELAY_COUNTERS | {RECORDS_LOST}

MAX_DATAGRAM_BYTES = 64 * 1024  # a batch is split before this; SEQPACKET's own limit is the send buffer
RECEIVE_BYTES = 256 * 1024  # a larger datagram arrives cut short, fails to parse, and is refused
MAX_BACKLOG_BYTES = 32 * 1024 * 1024
PROGRESS_INTERVAL_S = 0.1
MAX_LABELS = 4

# message kinds (the first item of each message)
RECORD, START, PROGRESS, FINISH, CALIBRATE, COUNT, READY = "r", "s", "p", "f", "k", "c", "ready"
MESSAGE_KINDS = (RECORD, START, PROGRESS, FINISH, CALIBRATE, COUNT, READY)
LOG_LEVEL = "log_level"  # the agent's one message to a worker
AGENT_MESSAGE_BYTES = 64


def log_level_message(level: int) -> bytes:
    return json.dumps([LOG_LEVEL, level]).encode()


def read_log_level(data: bytes) -> int | None:
    """The level a message from the agent sets; None for anything else (ignored, not fatal)."""
    try:
        message = loads(data)
    except ValueError:
        return None
    if (
        isinstance(message, list)
        and len(message) == 2
        and message[0] == LOG_LEVEL
        and type(message[1]) is int
        and logging.NOTSET <= message[1] <= logging.CRITICAL
    ):
        return message[1]
    return None


# --------------------------------------------------------------------------------------------
# the codec: dataclass fields in order, each checked against its annotation on the way in
# --------------------------------------------------------------------------------------------


class ChannelError(ValueError):
    """A datagram the agent refuses (why, in words)."""


def _reader(hint: Any, name: str) -> Callable[[Any], Any]:
    """A checker-converter for one JSON value of the annotated type (raises ChannelError)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        inner = _reader(next(a for a in args if a is not type(None)), name)
        return lambda v: None if v is None else inner(v)
    if origin is tuple:
        item = _reader(typing.get_args(hint)[0], name)

        def read_tuple(v: Any) -> tuple[Any, ...]:
            if not isinstance(v, list) or len(v) > 4096:
                raise ChannelError(f"{name}: expected a list")
            return tuple(item(x) for x in v)

        return read_tuple
    if isinstance(hint, type) and issubclass(hint, Enum):
        enum = hint

        def read_enum(v: Any) -> Any:
            try:
                return enum(v)
            except ValueError:
                raise ChannelError(f"{name}: unknown value") from None

        return read_enum
    if hint is bool:
        return lambda v: v if isinstance(v, bool) else _refuse(name, "a boolean")
    if hint is int:
        return lambda v: v if isinstance(v, int) and not isinstance(v, bool) else _refuse(name, "an integer")
    if hint is float:
        return lambda v: _refuse(name, "a number") if (number := finite(v)) is None else number
    if hint is str:
        return lambda v: v if isinstance(v, str) and len(v) <= 256 else _refuse(name, "a short string")
    raise TypeError(f"{name}: no channel codec for {hint!r}")  # a new field type: teach the codec


def _refuse(name: str, expected: str) -> Any:
    raise ChannelError(f"{name}: expected {expected}")


def _codec(cls: type) -> tuple[tuple[str, ...], tuple[Callable[[Any], Any], ...]]:
    hints = typing.get_type_hints(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    return names, tuple(_reader(hints[n], f"{cls.__name__}.{n}") for n in names)


_RECORD_FIELDS, _RECORD_READERS = _codec(RequestRecord)
_IN_FLIGHT_FIELDS, _IN_FLIGHT_READERS = _codec(InFlightRequest)


def _encode_fields(obj: Any, names: tuple[str, ...]) -> list[Any]:
    return [v.value if isinstance(v := getattr(obj, n), Enum) else v for n in names]


def _decode_fields(cls: type, raw: Any, readers: tuple[Callable[[Any], Any], ...]) -> Any:
    if not isinstance(raw, list) or len(raw) != len(readers):
        raise ChannelError(f"{cls.__name__}: expected {len(readers)} fields")
    return cls(*(read(v) for read, v in zip(readers, raw, strict=True)))


def encode_record(record: RequestRecord) -> list[Any]:
    return _encode_fields(record, _RECORD_FIELDS)


def decode_record(raw: Any) -> RequestRecord:
    record: RequestRecord = _decode_fields(RequestRecord, raw, _RECORD_READERS)
    if not isinstance(record.outcome, Outcome):
        raise ChannelError("RequestRecord.outcome: unknown value")
    return record


def encode_in_flight(request: InFlightRequest) -> list[Any]:
    return _encode_fields(request, _IN_FLIGHT_FIELDS)


def decode_in_flight(raw: Any) -> InFlightRequest:
    request: InFlightRequest = _decode_fields(InFlightRequest, raw, _IN_FLIGHT_READERS)
    return request


def _small_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
        raise ChannelError(f"{name}: expected a count")
    return value


# --------------------------------------------------------------------------------------------
# the worker's end
# --------------------------------------------------------------------------------------------


class WorkerChannel:
    """The worker's ``Sink``, ``Count`` and ``InFlight`` in one: everything goes to the agent.

    Handles are the worker's own; the agent maps them to its tracker's. Never raises into the relay
    and never blocks it (see the module docstring for what happens when the channel backs up).
    """

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.loop = loop
        self.messages: list[list[Any]] = []
        self.counts: dict[tuple[str, ...], float] = {}
        self.progress_of: dict[int, int] = {}
        self.open: set[int] = set()  # handles whose start was sent and finish not yet
        self.backlog: deque[bytes] = deque()
        self.backlog_bytes = 0
        self._next = 0
        self._flush_due = False
        self._progress_timer: asyncio.TimerHandle | None = None
        self._writer_waiting = False

    # -- Sink ------------------------------------------------------------------------------------
    def sink(self, record: RequestRecord) -> None:
        if self.backlog_bytes > MAX_BACKLOG_BYTES:
            self._count((RECORDS_LOST, record.replica, "backlog"), 1)
        else:
            self._add([RECORD, encode_record(record)])

    # -- Count -----------------------------------------------------------------------------------
    def count(self, family: str, *labels: str, amount: float = 1) -> None:
        self._count((family, *labels), amount)

    def _count(self, key: tuple[str, ...], amount: float) -> None:
        self.counts[key] = self.counts.get(key, 0) + amount
        self._schedule()

    # -- InFlight --------------------------------------------------------------------------------
    def start(self, request: InFlightRequest) -> int:
        self._next += 1
        handle = self._next
        if self.backlog_bytes <= MAX_BACKLOG_BYTES:  # past it: not shown in flight (the record may be)
            self.open.add(handle)
            self._add([START, handle, encode_in_flight(request)])
        return handle

    def progress(self, handle: int, content_chunks: int) -> None:
        if handle in self.open:
            self.progress_of[handle] = content_chunks
            if self._progress_timer is None:
                self._progress_timer = self.loop.call_later(PROGRESS_INTERVAL_S, self._send_progress)

    def finish(self, handle: int, prompt_tokens: int | None = None) -> None:
        if handle in self.open:
            self.open.discard(handle)
            self.progress_of.pop(handle, None)
            self._add([FINISH, handle] if prompt_tokens is None else [FINISH, handle, prompt_tokens])

    def calibrate(self, replica: str, output_tokens: int, content_chunks: int) -> None:
        self._add([CALIBRATE, replica, output_tokens, content_chunks])

    def ready(self) -> None:
        self._add([READY])

    # -- sending ---------------------------------------------------------------------------------
    def _add(self, message: list[Any]) -> None:
        self.messages.append(message)
        self._schedule()

    def _schedule(self) -> None:
        if not self._flush_due:
            self._flush_due = True
            self.loop.call_soon(self.flush)

    def _send_progress(self) -> None:
        self._progress_timer = None
        if self.progress_of:
            self.messages.extend([PROGRESS, h, n] for h, n in self.progress_of.items())
            self.progress_of.clear()
            self._schedule()

    def flush(self) -> None:
        """Send what this loop turn made; what the socket will not take now waits in the backlog."""
        self._flush_due = False
        messages = self.messages
        if self.counts:
            messages.extend([COUNT, key[0], list(key[1:]), amount] for key, amount in self.counts.items())
            self.counts = {}
        self.messages = []
        for datagram in _datagrams(messages):
            self.backlog.append(datagram)
            self.backlog_bytes += len(datagram)
        self._drain()

    def _drain(self) -> None:
        while self.backlog:
            datagram = self.backlog[0]
            try:
                self.sock.send(datagram)
            except (BlockingIOError, InterruptedError):
                if not self._writer_waiting:
                    self._writer_waiting = True
                    self.loop.add_writer(self.sock.fileno(), self._writable)
                return
            except OSError:  # the agent is gone: the worker is being stopped (see workers.serve)
                self.backlog.clear()
                self.backlog_bytes = 0
                return
            self.backlog.popleft()
            self.backlog_bytes -= len(datagram)
        if self._writer_waiting:
            self._writer_waiting = False
            self.loop.remove_writer(self.sock.fileno())

    def _writable(self) -> None:
        self._drain()


def _datagrams(messages: list[list[Any]]) -> Iterable[bytes]:
    """``messages`` as JSON arrays of at most about MAX_DATAGRAM_BYTES each."""
    batch: list[bytes] = []
    size = 2
    for message in messages:
        encoded = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
        if batch and size + len(encoded) + 1 > MAX_DATAGRAM_BYTES:
            yield b"[" + b",".join(batch) + b"]"
            batch, size = [], 2
        batch.append(encoded)
        size += len(encoded) + 1
    if batch:
        yield b"[" + b",".join(batch) + b"]"


# --------------------------------------------------------------------------------------------
# the agent's end
# --------------------------------------------------------------------------------------------


class ChannelReceiver:
    """Reads one worker's datagrams on the agent's loop and applies them to the agent's own sink,
    counters and in-flight tracker, as the in-process proxy would have (``ProxyServer.emit``'s
    order: the record, then its calibration, then the in-flight finish).

    ``closed`` resolves at end of file: every datagram the worker sent has been applied, and
    ``fail_in_flight`` may count what it left unfinished.
    """

    def __init__(
        self,
        sock: socket.socket,
        replicas: Iterable[str],
        sink: Sink,
        count: Count,
        in_flight: InFlight,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.replicas = frozenset(replicas)
        self.sink = sink
        self.count = count
        self.in_flight = in_flight
        self.on_ready = on_ready
        self.handles: dict[int, tuple[int, str]] = {}  # worker handle -> (tracker handle, replica)
        self.loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self.last_refusal_logged = 0.0
        self.loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        for _ in range(256):  # then let the loop run other callbacks; the reader fires again
            try:
                data = self.sock.recv(RECEIVE_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self.close()
                return
            self.handle(data)

    def tell_log_level(self, level: int) -> None:
        """A reloaded log level, to the worker: one small datagram, never waited for (a worker whose
        buffer is full, or that is gone, reads the level anew when it is started again)."""
        if not self.closed.done():
            with contextlib.suppress(OSError):
                self.sock.send(log_level_message(level))

    def close(self) -> None:
        if self.closed.done():
            return
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self.closed.set_result(None)

    def handle(self, data: bytes) -> None:
        """Apply one datagram, or refuse it whole (checked before anything is applied)."""
        try:
            actions = self._parse(data)
        except ChannelError as exc:
            self._refused(str(exc))
            return
        for action in actions:
            try:
                action()
            except Exception:  # the agent's sink failing is the in-process proxy's accounting error
                log.exception("proxy worker accounting failed; counted in %s_total", ACCOUNTING_ERRORS)
                with contextlib.suppress(Exception):
                    self.count(ACCOUNTING_ERRORS, next(iter(self.replicas), ""))

    def _refused(self, why: str) -> None:
        self.count(DATAGRAMS_REFUSED)
        now = time.monotonic()
        if now - self.last_refusal_logged > 60:
            self.last_refusal_logged = now
            log.error(
                "proxy worker channel: refused a datagram (%s); counted in %s_total", why, DATAGRAMS_REFUSED
            )

    def _replica(self, value: Any) -> str:
        if not isinstance(value, str) or value not in self.replicas:
            raise ChannelError("not a replica this worker serves")
        return value

    def _parse(self, data: bytes) -> list[Callable[[], None]]:
        try:
            messages = loads(data)
        except ValueError:
            raise ChannelError("not JSON") from None
        if not isinstance(messages, list):
            raise ChannelError("not a list of messages")
        actions: list[Callable[[], None]] = []
        for message in messages:
            if not isinstance(message, list) or not message or message[0] not in MESSAGE_KINDS:
                raise ChannelError("unknown message")
            kind, args = message[0], message[1:]
            actions.append(self._action(kind, args))
        return actions

    def _action(self, kind: str, args: list[Any]) -> Callable[[], None]:
        if kind == RECORD and len(args) == 1:
            record = decode_record(args[0])
            self._replica(record.replica)
            return lambda: self.sink(record)
        if kind == START and len(args) == 2:
            handle = _small_int(args[0], "handle")
            request = decode_in_flight(args[1])
            self._replica(request.replica)
            return lambda: self._start(handle, request)
        if kind == PROGRESS and len(args) == 2:
            handle, chunks = _small_int(args[0], "handle"), _small_int(args[1], "chunks")
            return lambda: self._progress(handle, chunks)
        if kind == FINISH and len(args) in (1, 2):
            handle = _small_int(args[0], "handle")
            prompt = _small_int(args[1], "prompt_tokens") if len(args) == 2 else None
            return lambda: self._finish(handle, prompt)
        if kind == CALIBRATE and len(args) == 3:
            replica = self._replica(args[0])
            tokens, chunks = _small_int(args[1], "output_tokens"), _small_int(args[2], "chunks")
            return lambda: self.in_flight.calibrate(replica, tokens, chunks)
        if kind == COUNT and len(args) == 3:
            family, labels, amount = args
            if family not in WORKER_FAMILIES:
                raise ChannelError("not a proxy counter")
            if not isinstance(labels, list) or not labels or len(labels) > MAX_LABELS:
                raise ChannelError("counter labels")
            self._replica(labels[0])
            if not all(isinstance(v, str) and len(v) <= 64 for v in labels):
                raise ChannelError("counter labels")
            if isinstance(amount, bool) or not isinstance(amount, int | float) or not 0 <= amount < 1e15:
                raise ChannelError("counter amount")
            return lambda: self.count(family, *labels, amount=amount)
        if kind == READY and not args:
            return self._ready
        raise ChannelError(f"{kind}: wrong arguments")

    def _ready(self) -> None:
        if self.on_ready is not None:
            self.on_ready()

    def _start(self, handle: int, request: InFlightRequest) -> None:
        if handle not in self.handles:
            self.handles[handle] = (self.in_flight.start(request), request.replica)

    def _progress(self, handle: int, chunks: int) -> None:
        entry = self.handles.get(handle)
        if entry is not None:
            self.in_flight.progress(entry[0], chunks)

    def _finish(self, handle: int, prompt_tokens: int | None) -> None:
        entry = self.handles.pop(handle, None)
        if entry is not None:
            self.in_flight.finish(entry[0], prompt_tokens)

    def fail_in_flight(self) -> int:
        """The worker is gone: its unfinished requests leave the tracker and are counted as lost."""
        lost = 0
        for tracker_handle, replica in self.handles.values():
            self.in_flight.finish(tracker_handle)
            self.count(RECORDS_LOST, replica, "worker_died")
            lost += 1
        self.handles.clear()
        return lost
