"""A replica's ProxyServer built but never started: exchanges and client connections driven by hand.

The property tests of the relay and of the per-chunk fast path drive it the same way: a client
connection on a transport that records what it was written, carrying one of the two bodies below.
"""

from __future__ import annotations

import asyncio
from time import perf_counter

from kvwatch.config import HostPort, ProxyConfig, ReplicaConfig
from kvwatch.model import DEFAULT_BANDS
from kvwatch.requests.accounting import ModelLabels, RequestMeter
from kvwatch.requests.proxy import Accounting, Count, MeterFactory, ProxyServer, Sink
from kvwatch.requests.proxy.seams import Clock
from kvwatch.state import InFlightTracker

STREAMING = b'{"model":"tiny","messages":[],"stream":true}'
ASKING = b'{"model":"tiny","messages":[],"stream":true,"stream_options":{"include_usage":true}}'


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def write(self, data) -> None:  # type: ignore[override]
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _ignore(family: str, *labels: str, amount: float = 1) -> None:
    pass


def unstarted_proxy(
    config: ProxyConfig | None = None,
    count: Count = _ignore,
    meter_factory: MeterFactory = RequestMeter,
    sink: Sink = lambda record: None,
    clock: Clock = perf_counter,
) -> ProxyServer:
    """The proxy of replica ``r0`` (model ``tiny``, an engine nobody listens for), records dropped
    unless a ``sink`` takes them."""
    replica = ReplicaConfig(
        name="r0",
        metrics_url="http://127.0.0.1:1/metrics",
        api_url="http://127.0.0.1:1",
        proxy_listen=HostPort("127.0.0.1", 0),
        model_name="tiny",
    )
    return ProxyServer(
        replica,
        config or ProxyConfig(),
        ModelLabels((), "tiny"),
        Accounting(DEFAULT_BANDS, InFlightTracker(), sink, count, meter_factory, clock),
    )
