"""A replica's ProxyServer built but never started: exchanges and client connections driven by hand."""

from __future__ import annotations

from time import perf_counter

from kvwatch.config import HostPort, ProxyConfig, ReplicaConfig
from kvwatch.model import DEFAULT_BANDS
from kvwatch.requests.accounting import ModelLabels, RequestMeter
from kvwatch.requests.proxy import Accounting, Count, MeterFactory, ProxyServer, Sink
from kvwatch.requests.proxy.seams import Clock
from kvwatch.state import InFlightTracker


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
