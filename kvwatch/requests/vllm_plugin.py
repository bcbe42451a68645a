"""Receiver for kvwatch's vLLM stat-logger plugin: per-request and per-step facts from inside vLLM.

The plugin (``plugins/vllm``, package ``kvwatch_vllm_plugin``) sends one compact JSON datagram per
engine step to a Unix datagram socket; the agent binds one socket per replica
(``vllm_plugin_sockets[]``) and maps the datagram's engine index to the replica's DP rank. Each
finished request becomes a ``RequestRecord`` (source ``vllm_plugin``) handed to the request sink;
each step becomes an ``EngineStep`` handed to the step sink with its ``PluginLink`` (sender pid and
its drop count). Each socket is read by a thread of its own (the sinks are thread-safe).

Datagrams come from a process we do not control: anything over ``MAX_DATAGRAM_BYTES``, not JSON,
of the wrong shape or of an unknown version is counted (``kvwatch_vllm_plugin_datagrams_total
{result}``) and dropped; a finished request that is wrong is refused alone and counted
(``kvwatch_vllm_plugin_refused_requests_total{reason}``), its datagram's steps and other requests are
kept (so step samples + dropped steps still add up to vLLM's iterations); nothing here raises.
Parsing is ``json.loads`` of at most 64 KiB, linear in the size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvwatch.jsonsafe import finite, loads
from kvwatch.logthrottle import LogThrottle
from kvwatch.model import EngineStep, EvictionSample, Outcome, PluginLink, RequestRecord
from kvwatch.requests.values import VALUES_DROPPED, bounded_count, out_of_range
from kvwatch.selfmetrics import Count, Report

log = logging.getLogger(__name__)

SOURCE = "vllm_plugin"
WIRE_VERSIONS = frozenset({1})
MAX_DATAGRAM_BYTES = 64 * 1024
MAX_ENGINE_INDEX = 1023
RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024
POLL_S = 0.2  # how often the reader thread looks whether it should stop
DATAGRAMS = "kvwatch_vllm_plugin_datagrams"
RESULTS = ("accepted", "malformed", "oversized", "unknown_version")
#: finished requests refused one by one (the rest of their datagram is kept), by reason
REFUSED_REQUESTS = "kvwatch_vllm_plugin_refused_requests"
REFUSAL_REASONS = ("negative_duration", "malformed")
#: FinishedRequestStats durations: vLLM subtracts timestamps that stay 0.0 when the event never came
#: (a request that finishes with no token), so an older plugin may send them negative
DURATION_KEYS = ("e2e", "queue", "prefill", "decode", "inference")
COLLECTOR = "vllm_plugin"

#: vLLM finish reasons (``FinishReason.__str__``) -> outcome; anything else is completed
OUTCOMES = {"length": Outcome.TRUNCATED, "abort": Outcome.ABORTED, "error": Outcome.ERROR}

RecordSink = Callable[[RequestRecord], None]
StepSink = Callable[[PluginLink, EngineStep | None], None]


class DatagramError(ValueError):
    """A datagram that is dropped; ``result`` is the counter label that says why."""

    def __init__(self, result: str, reason: str) -> None:
        super().__init__(reason)
        self.result = result


@dataclass(frozen=True, slots=True)
class Decoded:
    link: PluginLink
    steps: tuple[EngineStep, ...]
    records: tuple[RequestRecord, ...]
    #: step counts over MAX_COUNT, left out of their step (``step_<key>``); a record names its own
    dropped_step_values: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()  # one reason per finished request that was refused


def _num(value: Any, what: str) -> float | None:
    if value is None:
        return None
    number = finite(value)
    if number is None or number < 0:
        raise DatagramError("malformed", f"{what} must be a non-negative number or null")
    return number


def _int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DatagramError("malformed", f"{what} must be a non-negative integer or null")
    return value


def _sender_count(value: Any, what: str) -> int | None:
    """A sender's cumulative count (datagrams, steps it dropped): exported as a float, so one past
    2^53 (1 and 400 zeros) is unknown rather than an OverflowError in every later /metrics."""
    count = _int(value, what)
    return count if count is None or count <= 2**53 else None


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise DatagramError("malformed", f"{what} must be an object")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise DatagramError("malformed", f"{what} must be a list")
    return value


def request_record(fields: Mapping[str, Any], replica: str, model_name: str, sent_at: float) -> RequestRecord:
    """One finished request of a datagram -> RequestRecord; raises DatagramError (its result is the
    refusal reason: ``negative_duration``, ``malformed``)."""
    f = _mapping(fields, "a finished request")
    for key in DURATION_KEYS:
        value = f.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise DatagramError(
                "negative_duration",
                f"{key} is negative ({value}): a request that never reached that point (an older plugin)",
            )
    reason = f.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise DatagramError("malformed", "reason must be a string or null")
    e2e = _num(f.get("e2e"), "e2e")
    dropped: list[str] = []
    prompt, output, limit, preemptions, cached = (
        bounded_count(_int(f.get(key), key), field, dropped)
        for key, field in (
            ("prompt", "prompt_tokens"),
            ("output", "output_tokens"),
            ("max_tokens", "max_tokens"),
            ("preemptions", "preemptions"),
            ("cached", "cached_prompt_tokens"),
        )
    )
    return RequestRecord(
        replica=replica,
        model_name=model_name,
        source=SOURCE,
        outcome=OUTCOMES.get(reason or "", Outcome.COMPLETED),
        started_at=sent_at - e2e if e2e is not None else sent_at,
        finish_reason=reason[:16] if reason else None,
        prompt_tokens=prompt,
        output_tokens=output,
        max_tokens=limit,
        e2e_seconds=e2e,
        queue_seconds=_num(f.get("queue"), "queue"),
        prefill_seconds=_num(f.get("prefill"), "prefill"),
        decode_seconds=_num(f.get("decode"), "decode"),
        preemptions=preemptions,
        cached_prompt_tokens=cached,
        dropped_values=tuple(dropped),
    )


def _evictions(raw: Any) -> tuple[EvictionSample, ...]:
    out = []
    for item in _list(raw, "ev"):
        if not isinstance(item, list) or len(item) != 3:
            raise DatagramError("malformed", "an eviction sample must be [lifetime, idle, [gaps]]")
        gaps = tuple(
            g for g in (_num(x, "a reuse gap") for x in _list(item[2], "reuse gaps")) if g is not None
        )
        out.append(EvictionSample(_num(item[0], "lifetime"), _num(item[1], "idle"), gaps))
    return tuple(out)


def engine_step(
    raw: Any,
    replica: str,
    dp_rank: str,
    sent_at: float,
    evictions: Any,
    left_out: Any,
    dropped: list[str] | None = None,
) -> EngineStep:
    """One step of a datagram; a count over ``MAX_COUNT`` becomes None, named in ``dropped``."""
    s = _mapping(raw, "s")
    shape = _list(s.get("it"), "it")
    if shape and len(shape) != 5:
        raise DatagramError(
            "malformed", "it must be [ctx requests, ctx tokens, gen requests, gen tokens, ms]"
        )
    noted: list[str] = [] if dropped is None else dropped

    def count(value: Any, what: str) -> int | None:
        return bounded_count(_int(value, what), f"step_{what}", noted)

    ctx_r, ctx_t, gen_r, gen_t = (
        (
            count(v, name)
            for v, name in zip(
                shape[:4], ("ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens"), strict=True
            )
        )
        if shape
        else (None,) * 4
    )
    usage = _num(s.get("kv"), "kv")
    at = _num(s.get("t"), "t")
    return EngineStep(
        replica=replica,
        dp_rank=dp_rank,
        at=at if at is not None else sent_at,
        running=count(s.get("run"), "run"),
        waiting=count(s.get("wait"), "wait"),
        kv_usage_ratio=usage,
        ctx_requests=ctx_r,
        ctx_tokens=ctx_t,
        gen_requests=gen_r,
        gen_tokens=gen_t,
        elapsed_ms=_num(shape[4], "elapsed_ms") if shape else None,
        preempted=count(s.get("preempted"), "preempted"),
        resumed_requests=count(s.get("pre_req"), "pre_req"),
        resumed_queried_tokens=count(s.get("pre_q"), "pre_q"),
        resumed_hit_tokens=count(s.get("pre_h"), "pre_h"),
        connector_resumed_queried_tokens=count(s.get("cpre_q"), "cpre_q"),
        connector_resumed_hit_tokens=count(s.get("cpre_h"), "cpre_h"),
        evictions=_evictions(evictions),
        evictions_left_out=count(left_out, "evx") or 0,
    )


def decode(data: bytes, replica: str, model_name: str) -> Decoded:
    """Pure: one datagram -> its link facts, steps and finished requests; raises DatagramError."""
    if len(data) > MAX_DATAGRAM_BYTES:
        raise DatagramError("oversized", f"datagram of {len(data)} bytes (limit {MAX_DATAGRAM_BYTES})")
    try:
        body = loads(data)
    except ValueError:  # UnicodeDecodeError is one, and jsonsafe.loads raises one for deep nesting
        raise DatagramError("malformed", "not JSON") from None
    body = _mapping(body, "a datagram")
    version = body.get("v")
    if not isinstance(version, int) or isinstance(version, bool) or version not in WIRE_VERSIONS:
        raise DatagramError("unknown_version", f"wire version {version!r} (this agent reads 1)")
    engine = _int(body.get("e"), "e")
    if engine is None or engine > MAX_ENGINE_INDEX:
        raise DatagramError("malformed", f"e must be an engine index 0..{MAX_ENGINE_INDEX}")
    sent_at = _num(body.get("t"), "t")
    if sent_at is None:
        raise DatagramError("malformed", "t (unix time) is required")
    dp_rank = str(engine)
    per_admission = body.get("pa")
    if per_admission not in (None, 0, 1) or isinstance(per_admission, bool):
        raise DatagramError("malformed", "pa must be 0, 1 or missing")
    link = PluginLink(
        replica,
        dp_rank,
        _int(body.get("p"), "p"),
        _int(body.get("n"), "n"),
        _sender_count(body.get("d"), "d"),
        _sender_count(body.get("ds"), "ds"),
        None if per_admission is None else per_admission == 1,
    )
    dropped: list[str] = []
    steps = tuple(
        engine_step(
            raw,
            replica,
            dp_rank,
            sent_at,
            body.get("ev") if i == 0 else None,
            body.get("evx") if i == 0 else None,
            dropped,
        )
        for i, raw in enumerate(_list(body.get("s"), "s"))
    )
    records: list[RequestRecord] = []
    refused: list[str] = []
    for fields in _list(body.get("f"), "f"):  # one bad request costs that request, not the datagram
        try:
            records.append(request_record(fields, replica, model_name, sent_at))
        except DatagramError as exc:
            refused.append(exc.result)
        except Exception:  # a request this reader fails on: refused as malformed, the others kept
            refused.append("malformed")
    return Decoded(link, steps, tuple(records), tuple(dropped), tuple(refused))


@dataclass(eq=False)
class PluginReceiver:
    """One bound socket (one replica), read by its own thread. ``await start()``, ``await stop()``.

    A thread, not the event loop: the kernel queues only ``net.unix.max_dgram_qlen`` datagrams per
    socket (10 by default) and the plugin drops when the queue is full, so a reader must never wait
    behind a scrape or a /metrics render. The sinks it calls are thread-safe.
    """

    replica: str
    path: str
    model_name: str
    records: RecordSink
    steps: StepSink
    count: Count
    report: Report | None = None
    _sock: socket.socket | None = field(init=False, default=None)
    _thread: threading.Thread | None = field(init=False, default=None)
    _stopping: threading.Event = field(init=False, default_factory=threading.Event)
    #: the engine process can repeat every line below at will
    _throttle: LogThrottle = field(init=False, default_factory=LogThrottle)

    async def start(self) -> None:
        sock = bind_socket(self.path)
        sock.settimeout(POLL_S)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name=f"vllm-plugin:{self.replica}", daemon=True)
        self._thread.start()
        log.info("vLLM plugin receiver for %s on %s", self.replica, self.path)

    async def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5 * POLL_S)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stopping.is_set():
            try:
                data = sock.recv(MAX_DATAGRAM_BYTES + 1)  # one byte more: an oversized one shows
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._stopping.is_set():
                    self._throttle.log(
                        log,
                        logging.WARNING,
                        "receive",
                        "vllm plugin: receiving on %s failed: %s",
                        self.path,
                        exc,
                    )
                    time.sleep(POLL_S)
                continue
            self.handle(data)

    def handle(self, data: bytes) -> None:
        """Decode, hand on, count; never raises (it runs on the receiver's thread, which must not die)."""
        started = time.perf_counter()
        try:
            decoded = decode(data, self.replica, self.model_name)
        except DatagramError as exc:
            self._count(exc.result)
            self._warn(exc)
            return
        except Exception as exc:  # a decoder bug must not take the receiver down
            self._count("malformed")
            self._warn(exc)
            return
        self._count("accepted")
        for name in decoded.dropped_step_values:
            with contextlib.suppress(Exception):
                self.count(VALUES_DROPPED, self.replica, SOURCE, out_of_range(name))
        for reason in decoded.refused:
            self._count_refused(reason)
        try:
            for step in decoded.steps or (None,):
                self.steps(decoded.link, step)
            for record in decoded.records:
                self.records(record)
        except Exception:
            self._throttle.log(log, logging.ERROR, "sink", "vllm plugin: a sink failed", exc_info=True)
        if self.report is not None:
            with contextlib.suppress(Exception):
                self.report(f"{COLLECTOR}:{self.replica}", True, time.perf_counter() - started)

    def _count(self, result: str, n: int = 1) -> None:
        try:
            self.count(DATAGRAMS, self.replica, result, amount=n)
        except Exception:
            log.exception("vllm plugin: counting failed")

    def _count_refused(self, reason: str, n: int = 1) -> None:
        try:
            self.count(REFUSED_REQUESTS, self.replica, reason, amount=n)
        except Exception:
            log.exception("vllm plugin: counting failed")

    def _warn(self, exc: Exception) -> None:
        self._throttle.log(
            log, logging.WARNING, "dropped", "vllm plugin: dropped a datagram on %s: %s", self.path, exc
        )


def bind_socket(path: str) -> socket.socket:
    """A Unix datagram socket bound at ``path`` (a stale socket file left by a dead agent is replaced;
    any other file there is an error). Mode 0660: the engine's group may send."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        sock.bind(path)
        os.chmod(path, 0o660)
    except BaseException:
        sock.close()
        raise
    return sock


class PluginSocket(Protocol):
    """One configured socket (``vllm_plugin_sockets`` entry): whose datagrams arrive where."""

    @property
    def replica(self) -> str: ...
    @property
    def path(self) -> str: ...


async def start_receivers(
    sockets: Iterable[PluginSocket],
    replicas: Mapping[str, str],
    records: RecordSink,
    steps: StepSink,
    count: Count,
    report: Report | None = None,
) -> list[PluginReceiver]:
    """Start one receiver per configured socket (the agent's wiring entry point).

    ``replicas`` maps replica name -> model_name label; every result series starts at zero.
    """
    started = []
    for entry in sockets:
        receiver = PluginReceiver(
            entry.replica, entry.path, replicas.get(entry.replica, "other"), records, steps, count, report
        )
        for result in RESULTS:
            receiver._count(result, 0)
        for reason in REFUSAL_REASONS:
            receiver._count_refused(reason, 0)
        await receiver.start()
        started.append(receiver)
    return started
