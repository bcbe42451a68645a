"""CPU per relayed chunk of the proxy's exchange (on_body + flush, as an engine read drives it):
this checkout's against a baseline checkout's proxy module, in one process, interleaved, best of
several repeats. No sockets: the client side is a transport that keeps what is written, so the
figure is kvwatch's own Python per chunk (de-chunked data in, framed bytes out, the meter, the
in-flight update), without the syscalls and loop that bench/proxy_bench.py also counts.

  git show 3b6fc93:kvwatch/requests/proxy.py > /tmp/proxy_before.py   # before the package split
  .venv/bin/python bench/relay_bench.py --baseline /tmp/proxy_before.py
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from kvwatch.config import HostPort, ProxyConfig, ReplicaConfig
from kvwatch.model import DEFAULT_BANDS
from kvwatch.requests import proxy as current
from kvwatch.requests.accounting import ModelLabels
from kvwatch.requests.http1 import parse_request_head, parse_response_head
from kvwatch.requests.proxy.client import ClientConnection
from kvwatch.requests.proxy.exchange import Exchange, Phase
from kvwatch.state import InFlightTracker

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
    def write(self, data: Any) -> None:
        pass

    def close(self) -> None:
        pass


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("proxy_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def exchange_factory(server_cls: Any, conn_cls: Any, exchange_cls: Any) -> Callable[[], Any]:
    replica = ReplicaConfig(
        name="r0",
        metrics_url="http://127.0.0.1:1/metrics",
        api_url="http://127.0.0.1:1",
        proxy_listen=HostPort("127.0.0.1", 0),
        model_name="bench",
    )
    server = server_cls(
        replica,
        ProxyConfig(),
        ModelLabels((), "bench"),
        DEFAULT_BANDS,
        InFlightTracker(),
        lambda record: None,
        lambda *a, **k: None,
    )
    head = parse_request_head(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d" % len(BODY)
    )

    layered = hasattr(server, "clients")  # the proxy package since its pieces get contexts

    def make() -> Any:
        conn = conn_cls(server.clients if layered else server)
        conn.transport = Sink()
        if layered:
            exchange = exchange_cls(server.clients.exchanges, conn, head, BODY, 0.0, 0.0)
            exchange._send = lambda: exchange._to(Phase.AWAITING_HEAD)
        else:
            exchange = exchange_cls(conn, head, BODY, 0.0, 0.0)
            exchange._send = lambda: None
        exchange.start()
        exchange.on_head(RESPONSE, None, True)
        exchange.flush()
        return exchange

    return make


def per_chunk_ns(make: Callable[[], Any], chunks: int, streams: int) -> float:
    total = 0.0
    for _ in range(streams):
        exchange = make()
        on_body, flush = exchange.on_body, exchange.flush
        start = time.perf_counter_ns()
        for _ in range(chunks):
            on_body(EVENT)
            flush()
        total += time.perf_counter_ns() - start
        exchange.abandon()
    return total / (chunks * streams)


async def run(baseline: ModuleType, chunks: int, streams: int, repeat: int) -> None:
    makers = {
        "baseline": exchange_factory(baseline.ProxyServer, baseline._ClientConnection, baseline._Exchange),
        "this checkout": exchange_factory(current.ProxyServer, ClientConnection, Exchange),
    }
    best = {name: float("inf") for name in makers}
    for i in range(repeat):
        order = list(makers.items())
        for name, make in order[::-1] if i % 2 else order:  # neither always runs first
            best[name] = min(best[name], per_chunk_ns(make, chunks, streams))
    print("| per relayed chunk (on_body + flush) | baseline | this checkout | ratio |")
    print("|---|---|---|---|")
    print(
        f"| vLLM chat chunk, one per read, metered, usage asked | {best['baseline']:,.0f} ns | "
        f"{best['this checkout']:,.0f} ns | {best['this checkout'] / best['baseline']:.2f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, required=True, help="another checkout's proxy module (one file)")
    p.add_argument("--chunks", type=int, default=2000, help="chunks per stream")
    p.add_argument("--streams", type=int, default=20, help="streams per repeat")
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    asyncio.run(run(load(args.baseline), args.chunks, args.streams, args.repeat))


if __name__ == "__main__":
    main()
