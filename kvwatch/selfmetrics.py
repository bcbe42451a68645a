"""The two callbacks through which a source reports on itself, as ``NodeState`` implements them.

Sources must not import ``kvwatch.state`` (it sits above them), so they take these callables; the agent
passes ``NodeState.count`` and ``NodeState.report``, tests pass their own recorders.
"""

from __future__ import annotations

from typing import Protocol


class Count(Protocol):
    """Add ``amount`` to one of kvwatch's own counters: ``count("kvwatch_otlp_spans", "malformed")``."""

    def __call__(self, family: str, *labels: str, amount: float = ...) -> None: ...


class Report(Protocol):
    """Record one run of a collector: did it succeed, how long it took, and why it failed."""

    def __call__(self, collector: str, success: bool, duration_s: float, error: str | None = ...) -> None: ...
