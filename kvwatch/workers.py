"""One long-lived helper process for the CPU-heavy parsing of what outsiders send, off the agent's heap.

Why a process: slicing a parse keeps each step short, and a thread keeps it off the event loop, but
neither keeps it off the agent's interpreter. A 15 MB engine page or a 55,000-span OTLP export is
hundreds of thousands of objects alive at once, so every full garbage collection the agent runs
meanwhile walks them all in one pause (0.2-0.7 s measured with ``gc.callbacks``), and a thread
doing pure-Python work holds the GIL in 5 ms turns against the loop. The worker does that work in
its own interpreter and sends back only the result, in frames the agent unpickles one at a time,
yielding to the loop in between.

Protocol on the worker's stdin/stdout (both ends are this code, so the pickles are trusted; what
the outsider sent travels only as the raw ``body`` bytes and is parsed by the handler): an 8-byte
big-endian length and a pickle ``(handler, args)``, then the length and bytes of the body; the
reply is any number of (length, pickle) frames, then a length of 0. A handler is a module-level
generator function ``(args, body) -> frames`` that the caller passes in: pickle sends it by
reference (module and name), and the worker imports its module at the first call, so this module
names no layer above it. A handler reports its own errors as frames, and one that escapes it anyway
comes back as a ``("crashed", text)`` frame, the worker keeps serving.
The agent gives up on the worker past a wall-clock deadline (starved or wedged), kills it and
starts a new one for the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

_LENGTH = 8
_PIECE = 1024 * 1024  # the body goes down the pipe in pieces: the loop never copies 16 MB at once

Handler = Callable[[Any, bytes], Iterator[Any]]


class WorkerFailedError(Exception):
    """The worker died or did not answer within its deadline; it has been killed."""


def brief_error(exc: BaseException) -> str:
    """An exception as one short line: its text may quote what an outsider sent."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 160 else text[:160] + "..."


def _frame(reply: Any) -> bytes:
    data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(_LENGTH, "big") + data


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """The worker's loop: one call in, its frames and an end mark out, until stdin closes."""
    while True:
        head = stdin.read(_LENGTH)
        if len(head) < _LENGTH:
            return
        request = stdin.read(int.from_bytes(head, "big"))
        body = stdin.read(int.from_bytes(stdin.read(_LENGTH), "big"))
        try:
            handler, args = pickle.loads(request)  # imports the handler's module at its first call
            for reply in handler(args, body):
                stdout.write(_frame(reply))
        except Exception as exc:  # a handler bug: the call fails, the worker keeps serving
            stdout.write(_frame(("crashed", brief_error(exc))))
        stdout.write((0).to_bytes(_LENGTH, "big"))
        stdout.flush()


class WorkerProcess:
    """The agent's handle on its worker process, started at the first call and reused.

    One call at a time: the worker's memory holds one body and its result.
    """

    def __init__(self, deadline_s: float = 60.0) -> None:
        self.deadline_s = deadline_s
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def call(self, handler: Handler, args: Any, body: bytes) -> list[Any]:
        """The handler's frames, in order; raises ``WorkerFailedError``.

        ``handler`` must be a module-level function (pickle sends it by reference)."""
        request = pickle.dumps((handler, args), protocol=pickle.HIGHEST_PROTOCOL)
        async with self._lock:
            proc = await self._started()
            assert proc.stdin is not None and proc.stdout is not None
            frames: list[Any] = []
            try:
                async with asyncio.timeout(self.deadline_s):
                    proc.stdin.write(len(request).to_bytes(_LENGTH, "big") + request)
                    proc.stdin.write(len(body).to_bytes(_LENGTH, "big"))
                    view = memoryview(body)
                    for start in range(0, len(body), _PIECE):
                        proc.stdin.write(view[start : start + _PIECE])
                        await proc.stdin.drain()
                    await proc.stdin.drain()
                    while size := int.from_bytes(await proc.stdout.readexactly(_LENGTH), "big"):
                        frames.append(pickle.loads(await proc.stdout.readexactly(size)))
                        await asyncio.sleep(0)  # a big result comes in frames: the loop runs between
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                await self._kill()
                why = (
                    f"did not answer within {self.deadline_s:g}s"
                    if isinstance(exc, TimeoutError)
                    else f"died ({type(exc).__name__})"
                )
                raise WorkerFailedError(f"kvwatch's parsing worker process {why}") from None
        return frames

    async def _started(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvwatch.workers",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
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
