"""Parsing a large engine page in kvwatch's worker process, so its objects never enter the agent's heap.

A page of 100,000 series is half a million container objects alive at once, and every full garbage
collection the agent runs while they live walks all of them in one pause: 0.2-0.7 s measured
(``gc.callbacks``) on a 15 MB page, whatever the slice size of a cooperative parse. The worker
(``kvwatch.workers``) decodes, checks (``metrics_text``), parses and runs the adapter, and sends
back only the ``ParseResult`` (a few hundred samples at most, by the page limits). It enforces the
CPU budget itself; every error comes back as the exception the agent would have raised parsing
the page itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvwatch.cooperative import BudgetExceededError, run_budgeted
from kvwatch.engines.exposition_parser import ExpositionError, Limits, TooManySeriesError, parse_steps
from kvwatch.engines.fetch import ScrapeError, metrics_text
from kvwatch.engines.registry import NoEngineMetricsError, ParseResult, parse_families
from kvwatch.workers import WorkerProcess, brief_error

_ERRORS: dict[str, type[Exception]] = {
    "TooManySeriesError": TooManySeriesError,
    "ExpositionError": ExpositionError,
    "BudgetExceededError": BudgetExceededError,
    "NoEngineMetricsError": NoEngineMetricsError,
    "ScrapeError": ScrapeError,
}


class AdapterError(Exception):
    """The adapter raised in the worker (its type name and a short text, never the page)."""


@dataclass(frozen=True, slots=True)
class PageJob:
    """What parsing one page needs besides its body: the worker receives it as one pickled value."""

    content_type: str
    replica: str
    url: str
    backend: str
    scraped_at: float
    limits: Limits
    budget_s: float


def parse_page(body: bytes, job: PageJob) -> ParseResult:
    """Check, parse and adapt one page within ``job.budget_s`` of CPU (what the worker runs per request)."""
    text = metrics_text(body, job.content_type, replica=job.replica, url=job.url)
    expo = run_budgeted(parse_steps(text, job.limits), job.budget_s)
    return parse_families(expo, job.replica, job.backend, job.scraped_at)


def _error_reply(exc: Exception) -> tuple[Any, ...]:
    if isinstance(exc, ScrapeError):
        return ("error", "ScrapeError", (exc.reason, exc.message))
    if isinstance(exc, ExpositionError):
        return ("error", type(exc).__name__, (exc.line, exc.message))
    if isinstance(exc, BudgetExceededError):
        return ("error", "BudgetExceededError", (exc.spent_s, exc.budget_s))
    if isinstance(exc, NoEngineMetricsError):
        return ("error", "NoEngineMetricsError", (str(exc),))
    return ("error", "AdapterError", (brief_error(exc),))


def answer(job: PageJob, body: bytes) -> Iterator[tuple[Any, ...]]:
    """The worker's handler (``kvwatch.workers``): one frame, the result or the error as a value."""
    try:
        yield ("ok", parse_page(body, job))
    except Exception as exc:  # every failure goes back as a value; the worker keeps serving
        yield _error_reply(exc)


def _unpack(reply: tuple[Any, ...]) -> ParseResult:
    if reply[0] == "ok":
        result: ParseResult = reply[1]
        return result
    if reply[0] == "crashed":
        raise AdapterError(reply[1])
    _, kind, args = reply
    raise _ERRORS.get(kind, AdapterError)(*args)


async def parse_in_worker(worker: WorkerProcess, body: bytes, job: PageJob) -> ParseResult:
    """``parse_page`` in the worker process; raises what it raises, or ``WorkerFailedError``."""
    [reply] = await worker.call(answer, job, body)
    return _unpack(reply)
