"""Running a long pure computation on the event loop in slices, so it never stalls other work.

Outsider-controlled input (an engine's metrics page, an OTLP export) can be large. A computation
written as a generator that yields between slices of a few milliseconds runs here: after each slice
the loop serves everything else that is ready (proxied chunks, other scrapes, /metrics), and the
CPU time spent in the slices is held to a budget. Threads would not do: under the GIL a pure-Python
worker thread takes the loop's time away in 5 ms turns, and cannot be stopped at a budget.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")


class BudgetExceededError(TimeoutError):
    """The computation used more than its CPU-time budget and was abandoned."""

    def __init__(self, spent_s: float, budget_s: float) -> None:
        self.spent_s = spent_s
        self.budget_s = budget_s
        super().__init__(f"used {spent_s:.2f}s of CPU, over its {budget_s:g}s budget")


def run_now(steps: Generator[None, None, T]) -> T:
    """Run a sliced computation to the end at once (for callers that are not on a loop)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def run_budgeted(steps: Generator[None, None, T], budget_s: float) -> T:
    """Run a sliced computation to the end at once, abandoning it past ``budget_s`` of CPU time
    (``BudgetExceededError``): for a worker process, where no loop waits between slices."""
    started = time.thread_time()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        spent = time.thread_time() - started
        if spent > budget_s:
            steps.close()
            raise BudgetExceededError(spent, budget_s)


async def run_sliced(steps: Generator[None, None, T], budget_s: float) -> T:
    """Drive ``steps`` to its return value, yielding to the loop after each slice.

    Raises ``BudgetExceededError`` once the CPU time spent inside the slices (this thread's, so
    neither waiting for the loop nor other processes on a busy host count) passes ``budget_s``;
    exceptions from the computation propagate.
    """
    spent = 0.0
    while True:
        started = time.thread_time()
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        spent += time.thread_time() - started
        if spent > budget_s:
            steps.close()
            raise BudgetExceededError(spent, budget_s)
        await asyncio.sleep(0)
