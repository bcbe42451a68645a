"""The page-parsing worker process gives exactly what parsing in the agent gives, errors included."""

from __future__ import annotations

import pytest

from kvwatch.cooperative import BudgetExceededError
from kvwatch.engines.exposition_parser import ExpositionError, Limits, TooManySeriesError
from kvwatch.engines.page_worker import PageWorker, WorkerFailedError, parse_page
from kvwatch.engines.registry import NoEngineMetricsError
from tests.engines import hostile

LIMITS = Limits()


async def test_worker_results_and_errors_equal_parsing_here() -> None:
    worker = PageWorker()
    try:
        for page in (hostile.vllm_page(), hostile.many_ranks(300)):
            assert await worker.parse(page, "r0", "vllm", 1.0, LIMITS, 5.0) == \
                parse_page(page, "r0", "vllm", 1.0, LIMITS, 5.0)
        cases = [
            (hostile.vllm_page() + "a" * 20_000 + " 1\n", ExpositionError, "scrape.max_line_length"),
            (hostile.unrelated_series(200_000), TooManySeriesError, "more than 100 series"),
            ("unrelated_metric 1\n", NoEngineMetricsError, "expected vllm families"),
        ]
        for page, error, words in cases:
            limits = Limits(max_series=100) if error is TooManySeriesError else LIMITS
            with pytest.raises(error, match=words) as raised:
                await worker.parse(page, "r0", "vllm", 1.0, limits, 5.0)
            if isinstance(raised.value, ExpositionError):
                assert raised.value.line > 1
        with pytest.raises(BudgetExceededError):
            await worker.parse(hostile.many_ranks(3200), "r0", "vllm", 1.0, LIMITS, 0.001)
        assert await worker.parse(hostile.vllm_page(), "r0", "vllm", 1.0, LIMITS, 5.0)  # still serving
    finally:
        await worker.close()
    assert worker._proc is None


async def test_a_worker_past_its_deadline_is_killed_and_replaced() -> None:
    worker = PageWorker(deadline_s=0.001)
    try:
        with pytest.raises(WorkerFailedError, match="did not answer"):
            await worker.parse(hostile.many_ranks(3200), "r0", "vllm", 1.0, LIMITS, 5.0)
        assert worker._proc is None
        worker.deadline_s = 60.0
        assert (await worker.parse(hostile.vllm_page(), "r0", "vllm", 1.0, LIMITS, 5.0)).backend == "vllm"
    finally:
        await worker.close()
