"""Shared by every role of bench/proxy_bench.py: the chunks the upstream writes, ports, uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "proxy_bench.py"  # every role runs as this script with --role
CLK_TCK = os.sysconf("SC_CLK_TCK")
NGINX = "/usr/sbin/nginx"

#: the role chunk's id carries the upstream's receive time of the request (perf_counter_ns)
ROLE_CHUNK = (
    b'data: {"id":"chatcmpl-%d","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)
CONTENT_CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[{"index":0,"delta":{"content":"%d"},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
FINISH_CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[{"index":0,"delta":{"content":""},"logprobs":null,'
    b'"finish_reason":"stop","stop_reason":null}]}\n\n'
)
USAGE_CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[],"usage":{"prompt_tokens":12,"total_tokens":%d,'
    b'"completion_tokens":%d}}\n\n'
)
DONE = b"data: [DONE]\n\n"


_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on now and this process has not handed out before: the kernel
    can give a released port back on the next call, so a bench that takes 24 in a row before binding
    any would otherwise, now and then, hand two roles the same one (the tests take theirs here too)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def _use_uvloop(on: bool) -> None:
    if on:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run_until_sigterm(role: Callable[[], Awaitable[None]]) -> None:
    """Run a role on a new event loop until SIGTERM. The signal cancels the role's task, so its
    ``finally`` blocks (stop the proxy, write totals) run on the loop, not inside whichever callback
    a signal raised into (which printed a traceback at every stop)."""

    async def until_sigterm() -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await role()

    asyncio.run(until_sigterm())


T = TypeVar("T")


def pair(text: str, kind: Callable[[str], T]) -> tuple[T, T]:
    """A ``LOW,HIGH`` flag's two values."""
    low, high = (kind(x) for x in text.split(","))
    return low, high


def rotated(targets: list[str], round_index: int) -> list[str]:
    """The targets in round ``round_index``'s order: each round starts one further along, so no
    target always runs right after the same other one (an A/A run of one checkout in two slots
    measured a steady gap when the order was fixed)."""
    k = round_index % len(targets)
    return targets[k:] + targets[:k]


def _ready(port: int) -> None:
    print(f"READY {port}", flush=True)


def _frame(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


BASELINE_ENV = "KVWATCH_BENCH_BASELINE"
