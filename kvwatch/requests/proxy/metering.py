"""What one replica's exchanges share for accounting: the meters' inputs, the sink, the counters and
the throttled log, and the byte budget every connection and exchange holds its buffers in.

Each piece of the proxy gets these objects, not the server: an exchange acquires and releases
budget through ``Holding``, counts and records through ``Metering``, and never sees the listener.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from time import perf_counter

from kvwatch.logthrottle import LogThrottle
from kvwatch.model import LengthBands, Outcome, RequestRecord
from kvwatch.requests.accounting import InFlight, ModelLabels, RequestMeter
from kvwatch.requests.http1 import RequestHead
from kvwatch.requests.proxy.seams import (
    ACCOUNTING_ERRORS,
    REFUSED,
    REFUSED_CLIENT_GONE,
    SHED,
    USAGE_REFUSED,
    Clock,
    MeterFactory,
    Sink,
)
from kvwatch.selfmetrics import Count

log = logging.getLogger("kvwatch.requests.proxy")

METERED_PATHS = {b"/v1/chat/completions": "chat", b"/v1/completions": "completions"}


@dataclass(slots=True, eq=False)
class BufferBudget:
    """Bytes held by all of a replica's connections and exchanges (``proxy.max_buffered_bytes``)."""

    limit: int
    held: int = field(init=False, default=0)

    def acquire(self, n: int) -> bool:
        """Count ``n`` more bytes held; False when that puts the total over the limit."""
        self.held += n
        return self.held <= self.limit

    def release(self, n: int) -> None:
        self.held -= n

    def fits(self, n: int) -> bool:
        return self.held + n <= self.limit


@dataclass(slots=True, eq=False)
class Holding:
    """One owner's share of a ``BufferBudget``: it says what it holds now, the budget follows."""

    budget: BufferBudget
    held: int = field(init=False, default=0)

    def hold(self, n: int) -> bool:
        """Now ``n`` bytes are held; False when the share grew and the budget is over its limit."""
        delta = n - self.held
        if not delta:
            return True
        self.held = n
        if delta > 0:
            return self.budget.acquire(delta)
        self.budget.release(-delta)
        return True

    def release(self) -> None:
        self.hold(0)


@dataclass(frozen=True, slots=True)
class Accounting:
    """Where proxied requests are accounted, the same for every replica's proxy of a process: the
    agent's state, a relay worker's channel to it, or a test's lists. Made once, handed to each proxy.
    """

    bands: LengthBands
    in_flight: InFlight
    sink: Sink  # gets every finished metered request
    count: Count  # ``NodeState.count``
    meter_factory: MeterFactory = RequestMeter
    clock: Clock = perf_counter  # durations are measured on it (the demo passes the simulator's clock)
    wall_clock: Clock = time.time  # started_at: the agent's time base, which its scrapes share


@dataclass(eq=False)
class Metering:
    """A replica's accounting: what a meter is made of, where records go, what is counted and logged.

    No method raises into the relay: a failing sink or counter is itself counted and logged.
    """

    replica: str
    labels: ModelLabels
    accounting: Accounting
    inject_usage: bool  # proxy.inject_usage; never switched off by a request
    #: seen: a usage chunk in a stream nobody asked usage of
    engine_forces_usage: bool = field(init=False, default=False)
    #: every line a client or the engine can repeat goes through it
    log_throttle: LogThrottle = field(init=False, default_factory=LogThrottle)

    def asks_usage(self) -> bool:
        """Whether kvwatch adds ``stream_options.include_usage`` to a streaming body."""
        return self.inject_usage and not self.engine_forces_usage

    def counted(self, family: str, *labels: str) -> None:
        """Count one occurrence of a self-metric of this replica; counting never raises into the proxy."""
        with contextlib.suppress(Exception):
            self.accounting.count(family, self.replica, *labels)

    def log_repeatable(
        self, level: int, key: str, msg: str, *args: object, exc_info: BaseException | bool | None = None
    ) -> None:
        """Log a line a client or the engine can make kvwatch repeat: throttled per ``key``."""
        self.log_throttle.log(log, level, key, msg, *args, exc_info=exc_info)

    def shed(self, reason: str) -> None:
        self.counted(SHED, reason)
        self.log_repeatable(
            logging.WARNING,
            f"{SHED}:{reason}",
            "proxy %s: answering 503 (%s limit reached: proxy.%s; counted in %s_total)",
            self.replica,
            reason,
            "max_buffered_bytes" if reason == "buffer" else "max_connections",
            SHED,
        )

    def refused(self, status: int, client_gone: bool) -> None:
        """A request kvwatch answered itself while reading it (``ClientConnection._refuse``)."""
        self.counted(REFUSED, str(status))
        if client_gone:  # nothing to tell anyone: the client left before its answer could be written
            self.counted(REFUSED_CLIENT_GONE, str(status))

    def accounting_failed(self, where: str, exc: BaseException | None = None) -> None:
        self.counted(ACCOUNTING_ERRORS)
        self.log_repeatable(
            logging.ERROR,
            ACCOUNTING_ERRORS,
            "proxy %s: request accounting failed in %s; the stream kept flowing (counted in %s_total)",
            self.replica,
            where,
            ACCOUNTING_ERRORS,
            exc_info=exc if exc is not None else True,
        )

    def emit(self, record: RequestRecord) -> None:
        try:
            self.accounting.sink(record)
            if record.chunks and record.output_tokens and not record.output_tokens_estimated:
                # exact usage of a finished stream teaches the in-flight estimate how many tokens
                # a chunk carries on this replica (stream intervals, speculative decoding)
                self.accounting.in_flight.calibrate(self.replica, record.output_tokens, record.chunks)
        except Exception as exc:
            self.accounting_failed("sink", exc)

    def record_refusal(self, head: RequestHead, status: int, t0: float, wall: float) -> None:
        """A metered request kvwatch answered itself (413): counted as rejected, never relayed."""
        endpoint = METERED_PATHS.get(head.path) if head.method == b"POST" else None
        if endpoint is None:
            return
        try:
            self.emit(
                RequestRecord(
                    replica=self.replica,
                    model_name=self.labels.label(None),
                    source="proxy",
                    outcome=Outcome.REJECTED,
                    started_at=wall,
                    endpoint=endpoint,
                    status_code=status,
                    e2e_seconds=self.accounting.clock() - t0,
                )
            )
        except Exception as exc:
            self.accounting_failed("refusal", exc)

    def usage_injection_refused(self) -> None:
        """The engine refused a body with include_usage and took the client's own: counted, logged.

        Nothing is decided for the replica from it: one client's body must not switch usage counting
        off for everyone (an operator whose engine refuses the field sets proxy.inject_usage: false).
        """
        self.counted(USAGE_REFUSED)
        self.log_repeatable(
            logging.WARNING,
            USAGE_REFUSED,
            "proxy %s: the engine refused a body with stream_options.include_usage and "
            "took the client's own; that stream is counted from chunks (counted in "
            "%s_total; set proxy.inject_usage: false if the engine never takes it)",
            self.replica,
            USAGE_REFUSED,
        )

    def engine_sends_usage_unasked(self) -> None:
        """Engine output, which no client can forge (its text is JSON-escaped inside one event)."""
        if not self.engine_forces_usage:
            self.engine_forces_usage = True
            log.info(
                "proxy %s: the engine sends a usage chunk unasked (--enable-force-include-usage); "
                "kvwatch no longer asks for it, and relays it as the engine sent it",
                self.replica,
            )
