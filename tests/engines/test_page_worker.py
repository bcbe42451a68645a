"""kvwatch's worker process parses a page exactly as the agent would, errors included."""

from __future__ import annotations

import pytest

from kvwatch.cooperative import BudgetExceededError
from kvwatch.engines.exposition_parser import ExpositionError, Limits, TooManySeriesError
from kvwatch.engines.fetch import ScrapeError
from kvwatch.engines.page_worker import PageJob, parse_in_worker, parse_page
from kvwatch.engines.registry import NoEngineMetricsError
from kvwatch.workers import WorkerFailedError, WorkerProcess
from tests.engines import hostile

LIMITS = Limits()
TEXT = "text/plain; version=0.0.4"


def _args(page: str, budget_s: float = 5.0, limits: Limits = LIMITS) -> tuple[bytes, PageJob]:
    return (page.encode(), PageJob(TEXT, "r0", "http://127.0.0.1:1/metrics", "vllm", 1.0, limits, budget_s))


async def test_worker_results_and_errors_equal_parsing_here() -> None:
    worker = WorkerProcess()
    try:
        for page in (hostile.vllm_page(), hostile.many_ranks(300)):
            assert await parse_in_worker(worker, *_args(page)) == parse_page(*_args(page))
        cases = [
            (hostile.vllm_page() + "a" * 20_000 + " 1\n", ExpositionError, "scrape.max_line_length"),
            (hostile.unrelated_series(200_000), TooManySeriesError, "more than 100 series"),
            ("unrelated_metric 1\n", NoEngineMetricsError, "expected vllm families"),
            ("<html>engine error</html>\n", ScrapeError, "not_metrics: .* HTML page"),
        ]
        for page, error, words in cases:
            limits = Limits(max_series=100) if error is TooManySeriesError else LIMITS
            with pytest.raises(error, match=words) as raised:
                await parse_in_worker(worker, *_args(page, limits=limits))
            if isinstance(raised.value, ExpositionError):
                assert raised.value.line > 1
        with pytest.raises(BudgetExceededError):
            await parse_in_worker(worker, *_args(hostile.many_ranks(3200), budget_s=0.001))
        assert await parse_in_worker(worker, *_args(hostile.vllm_page()))  # still serving
    finally:
        await worker.close()
    assert worker._proc is None


async def test_a_worker_past_its_deadline_is_killed_and_replaced() -> None:
    worker = WorkerProcess(deadline_s=0.001)
    try:
        with pytest.raises(WorkerFailedError, match="did not answer"):
            await parse_in_worker(worker, *_args(hostile.many_ranks(3200)))
        assert worker._proc is None
        worker.deadline_s = 60.0
        assert (await parse_in_worker(worker, *_args(hostile.vllm_page()))).backend == "vllm"
    finally:
        await worker.close()
