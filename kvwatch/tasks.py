"""Stopping a background task: cancel it and wait until it has finished unwinding.

A job's ``stop()`` must not return while its task still runs (it could write into state after the
agent thinks it stopped), and the ``CancelledError`` it raises is the expected end, not an error.
"""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task[object] | None) -> None:
    """Cancel ``task`` (None: nothing to stop) and wait for it to end; its cancellation is swallowed."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
