"""The worker process runs whatever module-level handler its caller passes, and survives one that fails."""

from __future__ import annotations

from kvwatch.workers import WorkerProcess
from tests.worker_handlers import broken, echo_sizes


async def test_a_caller_passed_handler_runs_in_the_worker_and_a_failing_one_is_a_frame() -> None:
    worker = WorkerProcess()
    try:
        assert await worker.call(echo_sizes, {"k": 1}, b"x" * 3_000_000) == [
            ("size", 3_000_000),
            ("args", {"k": 1}),
        ]
        assert await worker.call(broken, None, b"") == [("crashed", "RuntimeError: handler bug")]
        assert await worker.call(echo_sizes, 2, b"") == [("size", 0), ("args", 2)]  # still serving
    finally:
        await worker.close()
