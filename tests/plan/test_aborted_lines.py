"""A ledger's aborted requests are replayed, also those the proxy could not count.

Usage comes in a stream's last chunk, so a client that leaves never gets it: the proxy's record of
an aborted request has no prompt length, and no output length when the client left before the first
token. `kvwatch plan replay` refused every ledger holding one such line, which is any real ledger.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwatch.cli import main
from kvwatch.model import DEFAULT_BANDS, Outcome, RequestRecord
from kvwatch.plan.inputs import (
    NO_PROMPT_KNOWN,
    PROMPT_FROM_MEDIAN,
    PROMPT_FROM_SIZE,
    PlanInputError,
    read_workload,
)
from kvwatch.requests.ledger import ledger_line

T0 = 1.7e9


def _record(replica: str, at: float, outcome: Outcome, prompt: int | None, output: int | None, **kw) -> dict:
    record = RequestRecord(
        replica=replica,
        model_name="tiny",
        source="proxy",
        outcome=outcome,
        started_at=T0 + at,
        prompt_tokens=prompt,
        output_tokens=output,
        **kw,
    )
    return ledger_line(record, DEFAULT_BANDS)


def _completed(replica: str, at: float, prompt: int) -> dict:
    return _record(
        replica, at, Outcome.COMPLETED, prompt, 50, max_tokens=400, ttft_seconds=0.2, e2e_seconds=2.0
    )


def _write(tmp_path: Path, lines: list[dict]) -> Path:
    path = tmp_path / "ledger.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_an_aborted_line_without_usage_is_replayed_with_its_replicas_median_prompt(tmp_path, capsys):
    lines = [
        _completed("r0", 0.0, 100),
        _completed("r0", 1.0, 300),
        _completed("r0", 2.0, 500),
        _completed("r1", 3.0, 1000),
        _completed("r1", 4.0, 2000),
        # left in the queue: no content, no usage
        _record("r0", 5.0, Outcome.ABORTED, None, None, max_tokens=800, e2e_seconds=30.0),
        # left mid-stream: its output counted from chunks, its prompt unknown
        _record(
            "r1",
            6.0,
            Outcome.ABORTED,
            None,
            40,
            output_tokens_estimated=True,
            ttft_seconds=1.0,
            e2e_seconds=9.0,
        ),
        # a replica with no line that gives a prompt length: the whole ledger's median
        _record("r2", 7.0, Outcome.ABORTED, None, None, e2e_seconds=12.0),
    ]
    assert all(line["prompt_tokens"] is None for line in lines[5:])  # as the ledger writes them

    workload = read_workload([str(_write(tmp_path, lines))])

    assert len(workload.requests) == 8 and workload.skipped == {}
    assert workload.estimated == {PROMPT_FROM_MEDIAN: 3}
    queued, streamed, other = workload.requests[5:]
    assert (queued.prompt_tokens, queued.max_tokens, queued.output_tokens) == (300, 800, 800)
    assert queued.total_patience == pytest.approx(30.0)
    assert streamed.prompt_tokens == 1000  # median_low of r1's 1000 and 2000
    assert streamed.output_tokens == 160  # no max_tokens: four times what it had streamed
    assert streamed.total_patience == pytest.approx(9.0)
    assert other.prompt_tokens == 500  # median of 100, 300, 500, 1000, 2000
    assert other.output_tokens == 4 and other.total_patience == pytest.approx(12.0)

    assert main(["plan", "replay", str(tmp_path / "ledger.jsonl")]) == 0
    out = capsys.readouterr().out
    assert f"filled in: {PROMPT_FROM_MEDIAN} 3" in out


def test_an_aborted_line_is_not_filled_in_where_no_line_gives_a_prompt_length(tmp_path):
    queued = _record("r0", 0.0, Outcome.ABORTED, None, None, max_tokens=800, e2e_seconds=30.0)
    rejected = _record("r0", 1.0, Outcome.REJECTED, None, None, status_code=400)
    with pytest.raises(
        PlanInputError, match=f"no replayable request \\({NO_PROMPT_KNOWN}: 2; outcome rejected"
    ):
        read_workload([str(_write(tmp_path, [queued, queued, rejected]))])


def test_a_completed_line_without_its_prompt_length_is_still_refused(tmp_path):
    broken = _record("r0", 1.0, Outcome.COMPLETED, None, 50, e2e_seconds=2.0)
    with pytest.raises(PlanInputError, match=r"line 2: missing 'prompt_tokens' \(a replay needs"):
        read_workload([str(_write(tmp_path, [_completed("r0", 0.0, 100), broken]))])


def test_an_export_gives_aborted_requests_the_tokens_their_clients_received(tmp_path, capsys):
    """Not what the twin's model would have gone on to: a benchmark client replaying the trace asks
    the engine for ``output_length`` tokens, so an aborted request is the work that was served."""
    lines = [
        _completed("r0", 0.0, 300),
        _record("r0", 1.0, Outcome.ABORTED, 250, 40, max_tokens=800, ttft_seconds=0.5, e2e_seconds=5.0),
        _record("r0", 2.0, Outcome.ABORTED, None, 70, max_tokens=800, ttft_seconds=0.5, e2e_seconds=6.0),
        _record("r0", 3.0, Outcome.ABORTED, None, None, max_tokens=800, e2e_seconds=30.0),
        _record("r0", 4.0, Outcome.TRUNCATED, 200, 800, max_tokens=800, ttft_seconds=0.5, e2e_seconds=9.0),
    ]
    out = tmp_path / "trace.jsonl"
    assert main(["plan", "export", str(_write(tmp_path, lines)), "-o", str(out)]) == 0
    assert f"filled in: {PROMPT_FROM_MEDIAN} 2" in capsys.readouterr().out
    trace = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(t["input_length"], t["output_length"]) for t in trace] == [
        (300, 50),
        (250, 40),
        (250, 70),  # its prompt: the median of r0's 300, 250 and 200
        (250, 1),  # left before its first token: at least one, as both readers ask for it
        (200, 800),
    ]


def test_the_proxys_estimate_from_the_request_size_comes_before_the_median(tmp_path):
    lines = [
        _completed("r0", 0.0, 100),
        _completed("r0", 1.0, 3000),
        _record(
            "r0", 2.0, Outcome.ABORTED, None, 12, max_tokens=800, prompt_tokens_estimate=1700, e2e_seconds=5.0
        ),
        _record("r0", 3.0, Outcome.ABORTED, None, None, max_tokens=800, e2e_seconds=5.0),  # an older ledger
    ]
    workload = read_workload([str(_write(tmp_path, lines))])
    assert [r.prompt_tokens for r in workload.requests[2:]] == [1700, 100]
    assert workload.estimated == {PROMPT_FROM_SIZE: 1, PROMPT_FROM_MEDIAN: 1}
