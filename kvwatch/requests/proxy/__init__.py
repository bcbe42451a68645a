"""Streaming reverse proxy in front of one OpenAI-compatible engine (vLLM, SGLang, TRT-LLM, ...).

One listener per replica, on the agent's loop, or with ``proxy.workers`` in relay worker processes
that all listen on every replica's port (``workers.py``, accounting to the agent over
``channel.py``; docs/requests.md "Every core"). Every request is relayed; ``POST /v1/chat/completions`` and
``POST /v1/completions`` are also measured (``requests/accounting.py``) and end as one
``RequestRecord`` handed to ``sink``. Everything else (``/v1/models``, ``/health``, ``/metrics``, ...)
passes through untouched: status, headers (minus hop-by-hop) and body bytes as the engine sent them.

The package, by concern:

- ``server.py``: the listener, accepting, the connection cap and descriptor limit; it builds what a
  replica's connections share and hands each piece only its context; ``start_proxy``.
- ``client.py``: one client connection, the HTTP/1.1 protocol per client (keep-alive, pipelining,
  the slow-client timer); gets a ``ClientContext``.
- ``exchange.py``: one request and its response, with its accounting; explicit phases
  (``Phase``: sending upstream, awaiting the head, head read, streaming, done, failed), every move
  checked against a table; gets an ``ExchangeContext`` and sees its client as ``Downstream``.
- ``pool.py``: the engine (address, connecting, spares), keep-alive engine connections, and one
  engine connection reading a response for a ``ResponseReader``.
- ``metering.py``: the accounting a replica's pieces share (meter inputs, sink, counters, throttled
  log) and the buffer budget (``BufferBudget``, one ``Holding`` per owner).

Imports point one way (server -> client -> exchange -> pool, metering -> seams); none is hidden
under ``TYPE_CHECKING``.
- ``relay.py``: the usage-chunk relay, pure bytes in and out (no I/O, no clock).
- ``answers.py``: kvwatch's own error answers; ``seams.py``: the typed interfaces to the agent.
- ``workers.py``: relay worker processes (``SO_REUSEPORT``) and their supervisor; ``channel.py``: their
  accounting channel to the agent; ``cpus.py``: the CPUs the agent may use (cgroup quota, affinity).

Built on raw asyncio protocols, not aiohttp: measured in ``bench/proxy_bench.py`` (docs/performance.md
"Streaming proxy"), an aiohttp server+client relay cost 2.3x nginx's CPU per chunk with uvloop and
added 15-25 ms TTFT under a burst; a protocol relay costs about what nginx does. It also sees the
first byte of a request (TTFT starts there, not when a framework's handler runs) and owns the
slow-client timer. Runs on whatever loop the agent runs; uvloop makes it about 20% cheaper.

Per upstream read the hot path is: de-chunk, find the last event boundary, one ``in`` test for
``"usage"``, write to the client, per event a bytes search for compact ``"content":"`` (the ``sse.CONTENT``
regex where that does not decide), a bisect for the gap. No JSON is parsed per chunk; the usage
chunk is parsed once. When a response ends, the client connection is handed on first and the
request's record, sink and in-flight entry follow on the next loop turn.

Per request the work is callback-driven: the request is written to a pooled keep-alive upstream
connection inside the callback that read its last byte (no task, no connect, no extra loop turn),
so a request arriving among many busy streams reaches the engine at once. Only when no idle
connection is pooled does a task connect one. A request whose reused connection turns out closed
before answering anything is sent again on a fresh one.

Failure semantics: the proxy never makes a request worse. Accounting errors are counted
(``kvwatch_proxy_accounting_errors_total``) and the bytes keep flowing; a client that disconnects
closes the upstream connection at once (the engine aborts the request and frees its KV); an
upstream that refuses, times out or breaks shows the client the same kind of failure (502/504
before the response head, a cut stream after it).
"""

from kvwatch.requests.proxy.metering import Accounting
from kvwatch.requests.proxy.seams import (
    ACCEPT_ERRORS,
    ACCOUNTING_ERRORS,
    REFUSED,
    REFUSED_CLIENT_GONE,
    SHED,
    TIMED_OUT,
    USAGE_REFUSED,
    MeterFactory,
    Sink,
)
from kvwatch.requests.proxy.server import ProxyServer, UpstreamAddress, start_proxy
from kvwatch.selfmetrics import Count

__all__ = [
    "ACCEPT_ERRORS",
    "ACCOUNTING_ERRORS",
    "REFUSED",
    "REFUSED_CLIENT_GONE",
    "SHED",
    "TIMED_OUT",
    "USAGE_REFUSED",
    "Accounting",
    "Count",
    "MeterFactory",
    "ProxyServer",
    "Sink",
    "UpstreamAddress",
    "start_proxy",
]
