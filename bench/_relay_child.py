"""One measurement of ``bench/relay_bench.py``, in a process of its own, on the kvwatch that comes first
on ``PYTHONPATH`` (this checkout's or the baseline checkout's): each side runs its own proxy and
everything it imports (accounting, SSE, HTTP/1, in-flight state), not one side's proxy on the
other's helpers. Run as a file by relay_bench (its folder, not a checkout, first on ``sys.path``):

  PYTHONPATH=CHECKOUT .venv/bin/python bench/_relay_child.py CHUNKS STREAMS

Prints one JSON line: nanoseconds per chunk, and what the streams did (bytes written to the client
and chunks metered per stream), which relay_bench compares between the two sides.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import kvwatch
from kvwatch.config import HostPort, ProxyConfig, ReplicaConfig
from kvwatch.model import DEFAULT_BANDS
from kvwatch.requests.accounting import ModelLabels
from kvwatch.requests.http1 import parse_request_head, parse_response_head
from kvwatch.state import InFlightTracker

try:  # the proxy package (from c6134be on)
    from kvwatch.requests.proxy import Accounting, ProxyServer
    from kvwatch.requests.proxy.client import ClientConnection
    from kvwatch.requests.proxy.exchange import Exchange
except ImportError:  # one module, kvwatch/requests/proxy.py (3b6fc93 and before)
    from kvwatch.requests import proxy as _one_module

    ProxyServer = _one_module.ProxyServer
    ClientConnection = _one_module._ClientConnection
    Exchange = _one_module._Exchange

#: a vLLM chat chunk as it arrives from the engine, one per read
EVENT = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[{"index":0,"delta":{"content":"tok"},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
BODY = b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"stream":true}'
RESPONSE = parse_response_head(
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
)


class Sink(asyncio.Transport):
    """The client side: keeps the count of bytes written, sends nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0

    def write(self, data: Any) -> None:
        self.written += len(data)

    def close(self) -> None:
        pass


def exchange_factory() -> Callable[[], Any]:
    """A started exchange per call: a metered streaming chat request whose response head came."""
    replica = ReplicaConfig(
        name="r0",
        metrics_url="http://127.0.0.1:1/metrics",
        api_url="http://127.0.0.1:1",
        proxy_listen=HostPort("127.0.0.1", 0),
        model_name="bench",
    )
    server = ProxyServer(
        replica,
        ProxyConfig(),
        ModelLabels((), "bench"),
        Accounting(DEFAULT_BANDS, InFlightTracker(), lambda record: None, lambda *a, **k: None),
    )
    head = parse_request_head(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d" % len(BODY)
    )

    layered = hasattr(server, "clients")  # the package since its pieces get contexts, not the server

    def make() -> Any:
        conn = ClientConnection(server.clients if layered else server)
        conn.transport = Sink()
        if layered:  # no engine connection: the request counts as written, the bench feeds the response
            exchange = Exchange(server.clients.exchanges, conn, head, BODY, 0.0, 0.0)
            exchange._send = lambda: exchange._to(type(exchange.phase).AWAITING_HEAD)
        else:
            exchange = Exchange(conn, head, BODY, 0.0, 0.0)
            exchange._send = lambda: None  # no engine connection: the bench feeds the response itself
        exchange.start()
        exchange.on_head(RESPONSE, None, True)
        exchange.flush()
        return exchange

    return make


async def measure(chunks: int, streams: int) -> dict[str, Any]:
    """On a running loop: an exchange's end schedules its bookkeeping there."""
    make = exchange_factory()
    total, written, metered = 0, set(), set()
    for _ in range(streams):
        exchange = make()
        sink, meter = exchange.down, exchange.meter
        on_body, flush = exchange.on_body, exchange.flush
        before = sink.written
        start = time.perf_counter_ns()
        for _ in range(chunks):
            on_body(EVENT)
            flush()
        total += time.perf_counter_ns() - start
        written.add(sink.written - before)
        metered.add(meter.chunks if meter is not None else 0)
        exchange.abandon()
    return {
        "ns_per_chunk": total / (chunks * streams),
        "bytes_per_stream": sorted(written),
        "metered_chunks_per_stream": sorted(metered),
        "kvwatch": kvwatch.__file__,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(measure(int(sys.argv[1]), int(sys.argv[2])))))
