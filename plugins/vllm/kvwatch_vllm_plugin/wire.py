"""The datagram format (version 1) and a sender that never blocks: standard library only.

Engine steps are sent in compact JSON datagrams: a step that finishes a request is sent at once with
the steps buffered before it; other steps wait at most FLUSH_INTERVAL_S (or MAX_STEPS_PER_DATAGRAM),
because the kernel queues only ``net.unix.max_dgram_qlen`` (10 by default) datagrams per socket;
what a full queue refuses waits in the sender's bounded backlog, which a thread of the plugin's own
sends as soon as the agent reads again.
The kvwatch agent decodes them (``kvwatch/requests/vllm_plugin.py``); the two sides share only
this format, documented in kvwatch's docs/vllm-plugin.md:

    {"v": 1, "e": engine index (DP rank), "p": pid, "n": sequence number, "t": unix time,
     "d": datagrams dropped before this one, "ds": the timed engine steps (with "it") in them,
     "pa": 1 if vLLM records prefix-cache lookups once per admission, 0 if once per lookup (older vLLM:
           the resumed requests' figures are upper bounds), missing if unknown,
     "s": [{step: "t" unix time, "run", "wait", "kv", "pc_req", "pc_q", "pc_h", "pre_req", "pre_q", "pre_h"
           (local prefix cache; null when vLLM does not count it: prefix caching off),
           "cpre_q", "cpre_h" (a KV connector's lookups for resumed requests, with a connector only),
           "preempted", "gen", "pt_comp", "pt_local", "pt_ext",
           "it": [ctx requests, ctx tokens, generation requests, generation tokens, elapsed ms]}, ...],
     "f": [{finished request: "reason", "e2e", "queue", "prefill", "decode", "inference",
            "prompt", "output", "cached", "max_tokens", "preemptions"}, ...],
     "ev": [[block lifetime s, idle s, [reuse gaps s, ...]], ...], "evx": eviction events left out}

A value vLLM did not provide is ``null`` (never 0), and a key may be missing: readers treat both as
unknown. So is a negative duration (vLLM's difference of two timestamps, one of which never happened)
and a ``max_tokens`` that vLLM may have resolved itself (the client's limit is sent only where it
provably is the client's). No prompt or output text and no request id is ever put in a datagram.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

WIRE_VERSION = 1
SOCKET_ENV = "KVWATCH_VLLM_SOCKET"
DEFAULT_SOCKET = "/run/kvwatch/vllm.sock"
#: the agent refuses datagrams over 64 KiB; finished requests are split well below that
FINISHED_PER_DATAGRAM = 32
#: eviction samples kept per datagram, which may carry several steps (vLLM samples 1% of blocks by
#: default); the rest are counted
MAX_EVICTIONS = 64
#: steps that finish no request are batched for at most this long / this many
FLUSH_INTERVAL_S = 0.05
MAX_STEPS_PER_DATAGRAM = 64
MAX_REUSE_GAPS = 16
#: datagrams kept while the agent's queue is full (about 200 bytes per step: at most ~3 MB)
MAX_BACKLOG = 256
#: how soon the drain thread retries a backlog the agent's queue refused (doubling up to the max)
RETRY_S = 0.002
MAX_RETRY_S = 0.05
#: errors of the moment (the kernel short of buffers or memory): the datagram waits, as for a full queue
TRANSIENT_ERRNOS = frozenset({errno.ENOBUFS, errno.ENOMEM, errno.EAGAIN, errno.EINTR})

_SEPARATORS = (",", ":")


def number(value: Any) -> int | float | None:
    """A finite int or float as is; anything else (missing, bool, NaN, a str) is None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def encode(
    header: Mapping[str, Any],
    steps: Sequence[Mapping[str, Any]],
    finished: Sequence[Mapping[str, Any]],
    evictions: Sequence[Sequence[Any]],
    evictions_left_out: int,
) -> list[dict[str, Any]]:
    """Buffered steps' facts as datagram bodies (dicts; ``dumps`` makes the bytes). The first carries
    the steps and the evictions; finished requests go FINISHED_PER_DATAGRAM to a datagram."""
    first: dict[str, Any] = dict(header)
    if steps:
        first["s"] = list(steps)
    if evictions:
        first["ev"] = list(evictions)
    if evictions_left_out:
        first["evx"] = evictions_left_out
    bodies = [first]
    for start in range(0, len(finished), FINISHED_PER_DATAGRAM):
        chunk = list(finished[start : start + FINISHED_PER_DATAGRAM])
        if start == 0:
            first["f"] = chunk
        else:
            bodies.append({**header, "f": chunk})
    return bodies


def dumps(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=_SEPARATORS, allow_nan=False).encode()


def eviction_sample(lifetime: Any, idle: Any, gaps: Iterable[Any]) -> list[Any]:
    kept = [g for g in (number(x) for x in list(gaps)[:MAX_REUSE_GAPS]) if g is not None]
    return [number(lifetime), number(idle), kept]


class DatagramSender:
    """Sends to a Unix datagram socket without ever blocking or raising, and loses nothing to a slow agent.

    A full receive queue (the agent is alive but behind: the kernel queues only
    ``net.unix.max_dgram_qlen`` datagrams) or a kernel short of buffers keeps the datagram, in order,
    in a backlog of at most MAX_BACKLOG datagrams that the next ``send`` or ``drain`` sends first;
    past that bound the oldest is dropped. A missing socket (agent absent) or a refused one (agent
    gone, socket file left) drops the backlog; an error of the datagram itself (EMSGSIZE, ...) drops
    that one. Every drop is counted in ``dropped``, and the engine steps it carried in
    ``dropped_steps``.

    Thread-safe without waiting: one thread at a time drains (a non-blocking lock); another that
    finds it busy leaves its datagram in the backlog for that one, or for ``BacklogDrainer``.
    """

    def __init__(self, path: str, max_backlog: int = 0) -> None:
        self.path = path
        self.sent = 0
        self.dropped = 0
        self.dropped_steps = 0
        self.max_backlog = max_backlog or MAX_BACKLOG
        self._backlog: deque[tuple[bytes, int]] = deque()  # (datagram, engine steps in it)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    def send(self, data: bytes, steps: int = 0) -> bool:
        """True when it and everything before it left now; False when some waits or was dropped.
        ``steps``: the timed engine steps it carries (counted in ``dropped_steps`` if it drops)."""
        dropped = self.dropped
        self._backlog.append((data, steps))  # deque.append is atomic: safe beside a draining thread
        self.drain()
        return not self._backlog and self.dropped == dropped

    def drain(self) -> None:
        """Send the backlog, oldest first, until the queue is full again (never waits, not even for
        another thread that is draining: that one sends what is queued)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            backlog = self._backlog
            while len(backlog) > self.max_backlog:
                self._drop(backlog.popleft())
            while backlog:
                try:
                    if self._sock is None:
                        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                        sock.setblocking(False)
                        self._sock = sock
                    self._sock.sendto(backlog[0][0], self.path)
                except BlockingIOError:  # the agent is behind: keep it for the next try
                    return
                except (FileNotFoundError, ConnectionRefusedError):  # no agent: what waited is lost
                    while backlog:
                        self._drop(backlog.popleft())
                    return
                except OSError as exc:
                    if exc.errno in TRANSIENT_ERRNOS:  # ENOBUFS, ENOMEM: keep it for the next try
                        return
                    self._drop(backlog.popleft())  # EMSGSIZE, a file that is not a socket, ...
                    continue
                except Exception:
                    self._drop(backlog.popleft())
                    continue
                backlog.popleft()
                self.sent += 1
        finally:
            self._lock.release()

    def _drop(self, entry: tuple[bytes, int]) -> None:
        self.dropped += 1
        self.dropped_steps += entry[1]

    def after_fork_in_child(self) -> None:
        """In a forked child: a new lock (the parent's drain thread may have held it at the fork, and
        that thread does not exist here: the lock would stay taken forever) and a socket of its own.
        The parent's backlog and counts are the parent's."""
        self._lock = threading.Lock()
        self._sock = None
        self._backlog.clear()
        self.sent = self.dropped = self.dropped_steps = 0  # a new pid counts its own, from 0

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(Exception):
                    self._sock.close()
                self._sock = None


class BacklogDrainer:
    """Sends what a busy agent refused from a daemon thread, as soon as the agent reads again.

    Without it the backlog waits for vLLM's next step or its 10 s ``log()`` call, and an engine that
    goes idle right after its last step keeps that step (and the requests it finished) from the
    agent. ``wake()`` never blocks; the thread starts at the first wake (again after a fork) and retries
    every RETRY_S, doubling up to MAX_RETRY_S while the agent stays behind.
    """

    def __init__(self, sender: DatagramSender) -> None:
        self.sender = sender
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def wake(self) -> None:
        if self._thread is None or not self._thread.is_alive():  # a forked child has no thread
            thread = threading.Thread(target=self._run, name="kvwatch-plugin-drain", daemon=True)
            self._thread = thread
            thread.start()
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def after_fork_in_child(self) -> None:
        """The parent's thread does not exist in a forked child: the next wake starts one."""
        self._thread = None
        self._wake = threading.Event()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            delay = RETRY_S
            while self.sender.backlog and not self._stopped:
                time.sleep(delay)
                sent = self.sender.sent
                with contextlib.suppress(Exception):
                    self.sender.drain()
                delay = RETRY_S if self.sender.sent > sent else min(2 * delay, MAX_RETRY_S)


def socket_path(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(SOCKET_ENV) or DEFAULT_SOCKET
