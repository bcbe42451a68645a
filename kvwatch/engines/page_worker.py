"""Parsing a large engine page in a separate process, so its objects never enter the agent's heap.

Why a process: slicing the parse (``kvwatch.cooperative``) keeps each step short, but a page of
100,000 series is half a million container objects alive at once, and every full garbage
collection the agent runs while they live walks all of them in one pause: 0.2-0.7 s measured
(``gc.callbacks``) on a 15 MB page, whatever the slice size. A worker thread would not help (same
heap, same collector, and it holds the GIL). The worker process parses, runs the adapter and
sends back only the ``ParseResult`` (a few hundred samples at most, by the page limits); its
own collections pause only itself.

The page goes as the bytes received: decoding, checking (``metrics_text``) and parsing all happen
in the worker, and the agent writes the body to the pipe in 1 MiB pieces, so even a 16 MB page
costs the loop only steps of a millisecond or so.

Protocol on the worker's stdin/stdout: an 8-byte big-endian length, then a pickle (replica, URL,
backend, scraped_at, ``Limits``, CPU budget), then the length and bytes of the body; one reply
(length, pickle) per request. Both ends are this code, so the pickles are trusted; the page itself
is only ever parsed as text.
The worker enforces the CPU budget itself; the agent gives up on it past a wall-clock deadline
(a starved or wedged worker), kills it and starts a new one for the next page.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import sys
from typing import Any, BinaryIO

from kvwatch.cooperative import BudgetExceededError, run_budgeted
from kvwatch.engines.exposition_parser import ExpositionError, Limits, TooManySeriesError, parse_steps
from kvwatch.engines.fetch import ScrapeError, metrics_text
from kvwatch.engines.registry import NoEngineMetricsError, ParseResult, parse_families

_LENGTH = 8
_PIECE = 1024 * 1024
_ERRORS: dict[str, type[Exception]] = {
    "TooManySeriesError": TooManySeriesError, "ExpositionError": ExpositionError,
    "BudgetExceededError": BudgetExceededError, "NoEngineMetricsError": NoEngineMetricsError,
    "ScrapeError": ScrapeError,
}


class AdapterError(Exception):
    """The adapter raised in the worker (its type name and a short text, never the page)."""


class WorkerFailedError(Exception):
    """The worker died or did not answer within its deadline; it has been killed."""


def parse_page(body: bytes, content_type: str, replica: str, url: str, backend: str, scraped_at: float,
               limits: Limits, budget_s: float) -> ParseResult:
    """Check, parse and adapt one page within ``budget_s`` of CPU (what the worker runs per request)."""
    text = metrics_text(body, content_type, replica=replica, url=url)
    expo = run_budgeted(parse_steps(text, limits), budget_s)
    return parse_families(expo, replica, backend, scraped_at)


def _error_reply(exc: Exception) -> tuple[Any, ...]:
    if isinstance(exc, ScrapeError):
        return ("error", "ScrapeError", (exc.reason, exc.message))
    if isinstance(exc, ExpositionError):
        return ("error", type(exc).__name__, (exc.line, exc.message))
    if isinstance(exc, BudgetExceededError):
        return ("error", "BudgetExceededError", (exc.spent_s, exc.budget_s))
    if isinstance(exc, NoEngineMetricsError):
        return ("error", "NoEngineMetricsError", (str(exc),))
    text = f"{type(exc).__name__}: {exc}"
    return ("error", "AdapterError", (text if len(text) <= 160 else text[:160] + "...",))


def _answer(request: bytes, body: bytes) -> bytes:
    try:
        result = parse_page(body, *pickle.loads(request))
        reply: tuple[Any, ...] = ("ok", result)
    except Exception as exc:  # every failure goes back as a value; the worker keeps serving
        reply = _error_reply(exc)
    return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """The worker's loop: one request in, one reply out, until stdin closes."""
    while True:
        head = stdin.read(_LENGTH)
        if len(head) < _LENGTH:
            return
        request = stdin.read(int.from_bytes(head, "big"))
        reply = _answer(request, stdin.read(int.from_bytes(stdin.read(_LENGTH), "big")))
        stdout.write(len(reply).to_bytes(_LENGTH, "big") + reply)
        stdout.flush()


def _unpack(reply: tuple[Any, ...]) -> ParseResult:
    if reply[0] == "ok":
        return reply[1]  # type: ignore[no-any-return]
    _, kind, args = reply
    raise _ERRORS.get(kind, AdapterError)(*args)


class PageWorker:
    """The agent's handle on one worker process, started at the first page and reused."""

    def __init__(self, deadline_s: float = 60.0) -> None:
        self.deadline_s = deadline_s
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def parse(self, body: bytes, content_type: str, replica: str, url: str, backend: str,
                    scraped_at: float, limits: Limits, budget_s: float) -> ParseResult:
        """``parse_page`` in the worker; raises what it raises, or ``WorkerFailedError``."""
        request = pickle.dumps((content_type, replica, url, backend, scraped_at, limits, budget_s),
                               protocol=pickle.HIGHEST_PROTOCOL)
        async with self._lock:  # one page at a time: the worker's memory holds one page
            proc = await self._started()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                async with asyncio.timeout(self.deadline_s):
                    proc.stdin.write(len(request).to_bytes(_LENGTH, "big"))
                    proc.stdin.write(request)
                    proc.stdin.write(len(body).to_bytes(_LENGTH, "big"))
                    view = memoryview(body)
                    for start in range(0, len(body), _PIECE):
                        proc.stdin.write(view[start:start + _PIECE])
                        await proc.stdin.drain()
                    await proc.stdin.drain()
                    size = int.from_bytes(await proc.stdout.readexactly(_LENGTH), "big")
                    reply = pickle.loads(await proc.stdout.readexactly(size))
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                await self._kill()
                why = f"did not answer within {self.deadline_s:g}s" if isinstance(exc, TimeoutError) \
                    else f"died ({type(exc).__name__})"
                raise WorkerFailedError(f"the page-parsing worker process {why}") from None
        return _unpack(reply)

    async def _started(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvwatch.engines.page_worker",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        return self._proc

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def close(self) -> None:
        """Stop the worker (closing its stdin ends it; a wedged one is killed)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 2.0)
        except TimeoutError:
            self._proc = proc
            await self._kill()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
