"""What the proxy's pieces need of the rest of the agent, typed: counters, meters, sinks.

The agent passes ``NodeState.count`` and ``RequestMeter``; tests pass their own. These Protocols (and
``selfmetrics.Count``, the one counter type every source takes) say exactly which calls the proxy
makes, so either is checked against them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvwatch.model import RequestRecord
from kvwatch.requests.accounting import InFlight, RequestInfo, RequestMeter

Sink = Callable[[RequestRecord], None]  # gets every finished metered request
Clock = Callable[[], float]

ACCOUNTING_ERRORS = "kvwatch_proxy_accounting_errors"
TIMED_OUT = "kvwatch_proxy_connections_timed_out"
USAGE_REFUSED = "kvwatch_proxy_usage_injection_refused"
SHED = "kvwatch_proxy_requests_shed"  # reason: buffer (proxy.max_buffered_bytes) | connections
ACCEPT_ERRORS = "kvwatch_proxy_accept_errors"
REFUSED = "kvwatch_proxy_requests_refused"  # status: what kvwatch answered while reading the request
REFUSED_CLIENT_GONE = "kvwatch_proxy_refusals_undelivered"  # status: the client left before the answer

#: every counter family the relay itself increments (a relay worker's channel carries only these)
RELAY_COUNTERS = frozenset(
    {ACCOUNTING_ERRORS, TIMED_OUT, USAGE_REFUSED, SHED, ACCEPT_ERRORS, REFUSED, REFUSED_CLIENT_GONE}
)


class MeterFactory(Protocol):
    """``RequestMeter`` or a subclass: one request's meter, made when its body has been read."""

    def __call__(
        self,
        replica: str,
        model_name: str,
        info: RequestInfo,
        started_at: float,
        t0: float,
        in_flight: InFlight | None = None,
        handle: int | None = None,
        /,
    ) -> RequestMeter: ...
