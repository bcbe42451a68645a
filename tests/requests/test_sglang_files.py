"""Following SGLang's per-request metrics files, built from the documented exporter format.

SGLang's ``FileRequestMetricsExporter`` writes ``{"request_parameters": json.dumps(obj fields),
**meta_info}`` per line (``json.dump``: default separators, one object per line), in
``sglang-request-metrics-YYYYMMDD_HH.log`` files, one per hour.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from kvwatch.config import SglangFilesConfig
from kvwatch.model import Outcome, RequestRecord
from kvwatch.requests.sglang_files import LINES, SglangFileFollower, line_record
from tests.local import until

PROMPT = "the secret prompt text 7f3a9c"


def exporter_line(completion: int = 120, finish: object = None, metrics: bool = True, **extra: object) -> str:
    """One line as SGLang writes it (meta_info spread at the top level)."""
    params = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 2048, "temperature": 0.6},
        "rid": "3c1e",
        "stream": True,
    }
    meta: dict = {
        "id": "3c1e",
        "finish_reason": finish or {"type": "stop", "matched": 151645},
        "prompt_tokens": 40,
        "weight_version": "default",
        "completion_tokens": completion,
        "cached_tokens": 0,
        "e2e_latency": 2.5,
    }
    if metrics:
        meta |= {
            "request_received_ts": 1_760_000_000.25,
            "api_server_dispatch_finish_ts": 1_760_000_000.3,
            "response_sent_to_client_ts": 1_760_000_002.7,
            "request_finished_ts": 1_760_000_002.75,
            "decode_throughput": (completion - 1) / 2.0,
            "queue_time": 0.125,
        }
    return json.dumps({"request_parameters": json.dumps(params), **meta, **extra}) + "\n"


def test_a_line_becomes_a_record() -> None:
    record = line_record(json.loads(exporter_line()), "s0", "qwen", now=0.0)
    assert (record.source, record.replica, record.model_name, record.outcome) == (
        "sglang_file",
        "s0",
        "qwen",
        Outcome.COMPLETED,
    )
    assert (record.prompt_tokens, record.output_tokens, record.max_tokens) == (40, 120, 2048)
    assert record.e2e_seconds == 2.5 and record.queue_seconds == 0.125
    assert record.decode_seconds == pytest.approx(2.0) and record.ttft_seconds == pytest.approx(0.5)
    assert record.tpot_seconds == pytest.approx(2.0 / 119)
    assert record.started_at == 1_760_000_000.25
    assert PROMPT not in repr(record)


def _with_parameters(line: str, **parameters: object) -> dict:
    doc = json.loads(line)
    doc["request_parameters"] = json.dumps(json.loads(doc["request_parameters"]) | parameters)
    return doc


def test_a_request_not_streamed_has_no_ttft_or_decode_time() -> None:
    # SGLang's first token of a response in one piece is its first output batch (every 50 tokens,
    # or the end): decode_throughput then made TTFT ~ e2e and TPOT ~ 0
    record = line_record(_with_parameters(exporter_line(completion=20), stream=False), "s0", "qwen", 0.0)
    assert (record.ttft_seconds, record.decode_seconds, record.tpot_seconds) == (None, None, None)
    assert (record.streaming, record.e2e_seconds, record.output_tokens) == (False, 2.5, 20)
    assert line_record(json.loads(exporter_line()), "s0", "qwen", 0.0).streaming is True


def test_a_retracted_request_is_kept_with_its_queue_time_unknown() -> None:
    # a re-queue overwrites SGLang's queue entry time, its first forward's stays: queue_time < 0;
    # the line was refused as malformed, and the preempted long request vanished
    record = line_record(json.loads(exporter_line(queue_time=-3.25)), "s0", "qwen", 0.0)
    assert (record.queue_seconds, record.dropped_values) == (None, ("queue_seconds",))
    assert record.output_tokens == 120 and record.outcome is Outcome.COMPLETED
    with pytest.raises(ValueError):
        line_record(json.loads(exporter_line(queue_time="late")), "s0", "qwen", 0.0)


def test_without_enable_metrics_only_counts_and_e2e_are_known() -> None:
    record = line_record(json.loads(exporter_line(metrics=False)), "s0", "qwen", now=1000.0)
    assert (record.output_tokens, record.e2e_seconds, record.ttft_seconds, record.tpot_seconds) == (
        120,
        2.5,
        None,
        None,
    )
    assert record.started_at == 997.5  # read at 1000, took 2.5 s


def test_nested_meta_info_is_read_too() -> None:
    doc = {
        "request_parameters": "{}",
        "meta_info": {"completion_tokens": 7, "e2e_latency": 1.0, "finish_reason": "length"},
    }
    record = line_record(doc, "s0", "m", now=10.0)
    assert (record.output_tokens, record.outcome, record.finish_reason) == (7, Outcome.TRUNCATED, "length")


@pytest.mark.parametrize(
    ("finish", "outcome"),
    [
        ({"type": "stop", "matched": 2}, Outcome.COMPLETED),
        ({"type": "length", "length": 120}, Outcome.TRUNCATED),
        ({"type": "abort", "message": "client disconnected"}, Outcome.ABORTED),
        ({"type": "abort", "message": "prompt too long", "status_code": 400}, Outcome.REJECTED),
        ({"type": "abort", "message": "internal", "status_code": 500}, Outcome.ERROR),
        ("length", Outcome.TRUNCATED),
    ],
)
def test_finish_reason_to_outcome(finish: object, outcome: Outcome) -> None:
    assert line_record(json.loads(exporter_line(finish=finish)), "s0", "m", 0.0).outcome is outcome


@pytest.mark.parametrize(
    "doc",
    [
        [1, 2],
        {"completion_tokens": "12"},
        {"completion_tokens": -1},
        {"e2e_latency": "slow"},
        {"decode_throughput": float("nan")},
    ],
)
def test_wrong_types_are_malformed(doc: object) -> None:
    with pytest.raises(ValueError):
        line_record(doc, "s0", "m", 0.0)


class Dir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.counts: Counter = Counter()

    def follower(self, from_start: bool = False) -> SglangFileFollower:
        def count(family: str, *labels: str, amount: float = 1) -> None:
            self.counts[(family, *labels)] += amount

        return SglangFileFollower(SglangFilesConfig("s0", str(self.path), 0.05), "qwen", count, from_start)

    def append(self, hour: str, text: str) -> None:
        with open(self.path / f"sglang-request-metrics-{hour}.log", "a", encoding="utf-8") as f:
            f.write(text)


@pytest.fixture
def export_dir(tmp_path: Path) -> Dir:
    return Dir(tmp_path)


def test_starts_at_the_end_of_existing_files(export_dir: Dir) -> None:
    export_dir.append("20260101_10", exporter_line(completion=1) * 3)
    follower = export_dir.follower()
    assert follower.poll() == []
    export_dir.append("20260101_10", exporter_line(completion=2))
    assert [r.output_tokens for r in follower.poll()] == [2]


def test_from_start_reads_existing_lines(export_dir: Dir) -> None:
    export_dir.append("20260101_10", exporter_line(completion=1) * 3)
    assert len(export_dir.follower(from_start=True).poll()) == 3


def test_new_hourly_files_are_read_from_their_start(export_dir: Dir) -> None:
    export_dir.append("20260101_10", exporter_line(completion=1))
    follower = export_dir.follower()
    follower.poll()
    export_dir.append("20260101_10", exporter_line(completion=2))
    export_dir.append("20260101_11", exporter_line(completion=3) + exporter_line(completion=4))
    assert sorted(r.output_tokens for r in follower.poll()) == [2, 3, 4]
    assert follower.poll() == []


def test_partial_last_line_waits_for_its_newline(export_dir: Dir) -> None:
    follower = export_dir.follower()
    follower.poll()
    line = exporter_line(completion=5)
    export_dir.append("20260101_10", line[:40])
    assert follower.poll() == []
    export_dir.append("20260101_10", line[40:])
    assert [r.output_tokens for r in follower.poll()] == [5]
    assert export_dir.counts[(LINES, "s0", "malformed")] == 0


def test_truncated_json_lines_are_counted_and_skipped(export_dir: Dir) -> None:
    follower = export_dir.follower()
    follower.poll()
    export_dir.append(
        "20260101_10",
        exporter_line(completion=1)[:60]
        + "\n"
        + exporter_line(completion=2)
        + "not json at all\n"
        + exporter_line(completion=3),
    )
    assert [r.output_tokens for r in follower.poll()] == [2, 3]
    assert export_dir.counts[(LINES, "s0", "malformed")] == 2
    assert export_dir.counts[(LINES, "s0", "request")] == 2


def test_a_line_the_reader_fails_on_costs_that_line_only(
    export_dir: Dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected error on one line (OverflowError did this before jsonsafe.finite) failed the
    whole poll after the offset had moved past the read: every line of it was lost."""
    from kvwatch.requests import sglang_files

    def fails_on_two(doc, *args):
        if doc.get("completion_tokens") == 2:
            raise ArithmeticError("a reader bug")
        return line_record(doc, *args)

    monkeypatch.setattr(sglang_files, "line_record", fails_on_two)
    follower = export_dir.follower()
    follower.poll()
    export_dir.append("20260101_10", "".join(exporter_line(completion=n) for n in (1, 2, 3)))
    assert [r.output_tokens for r in follower.poll()] == [1, 3]
    assert export_dir.counts[(LINES, "s0", "malformed")] == 1


def test_rewritten_file_is_read_again(export_dir: Dir) -> None:
    follower = export_dir.follower()
    follower.poll()
    export_dir.append("20260101_10", exporter_line(completion=1) * 2)
    assert len(follower.poll()) == 2
    (export_dir.path / "sglang-request-metrics-20260101_10.log").write_text(exporter_line(completion=9))
    assert [r.output_tokens for r in follower.poll()] == [9]


def test_a_file_deleted_and_made_anew_is_read_from_its_start(export_dir: Dir) -> None:
    # only shrinking told a rewrite before: a new file that grew past the old offset between two
    # polls was read from the middle, its first lines lost and a partial one counted malformed
    follower = export_dir.follower()
    follower.poll()
    export_dir.append("20260101_10", exporter_line(completion=1))
    assert len(follower.poll()) == 1
    path = export_dir.path / "sglang-request-metrics-20260101_10.log"
    path.unlink()
    path.write_text("".join(exporter_line(completion=n) for n in (5, 6, 7)))
    assert [r.output_tokens for r in follower.poll()] == [5, 6, 7]
    assert export_dir.counts[(LINES, "s0", "malformed")] == 0


def test_missing_directory_is_retried(tmp_path: Path) -> None:
    export_dir = Dir(tmp_path / "not-yet")
    follower = export_dir.follower()
    assert follower.poll() == []
    (tmp_path / "not-yet").mkdir()
    export_dir.append("20260101_10", exporter_line(completion=4))
    assert [r.output_tokens for r in follower.poll()] == [4]  # the file is new: read from its start


def test_other_files_in_the_directory_are_ignored(export_dir: Dir) -> None:
    follower = export_dir.follower()
    follower.poll()
    (export_dir.path / "notes.log").write_text(exporter_line())
    (export_dir.path / "sglang-request-metrics-latest.log").write_text(exporter_line())
    assert follower.poll() == []


async def test_start_follower_reports_each_poll(tmp_path: Path) -> None:
    from kvwatch.config import Config, ReplicaConfig
    from kvwatch.requests.sglang_files import start_follower

    config = Config(replicas=(ReplicaConfig("s0", "http://127.0.0.1:1/metrics", model_name="qwen"),))
    reports: list[tuple] = []
    got: list[RequestRecord] = []
    follower = await start_follower(
        SglangFilesConfig("s0", str(tmp_path / "later"), 0.05),
        config,
        got.append,
        lambda *a, **k: None,
        lambda *a: reports.append(a),
    )
    try:
        await until(lambda: reports, what="the first poll's report")
        assert reports[0][:2] == ("sglang_files:s0", False) and "cannot list" in reports[0][3]
        (tmp_path / "later").mkdir()
        Dir(tmp_path / "later").append("20260101_10", exporter_line(completion=3))
        await until(lambda: got, what="the record of the file that appeared")
        assert [(r.output_tokens, r.model_name) for r in got] == [(3, "qwen")]
        assert reports[-1][:2] == ("sglang_files:s0", True)
    finally:
        await follower.stop()


async def test_run_emits_records_on_the_loop(export_dir: Dir) -> None:
    follower = export_dir.follower()
    polls: list[tuple] = []
    follower.report = lambda *a: polls.append(a)
    got: list[RequestRecord] = []
    task = asyncio.create_task(follower.run(got.append))
    try:
        # a file there before the first poll is followed from its end: append after that poll
        await until(lambda: polls, what="the follower's first poll")
        export_dir.append("20260101_10", exporter_line(completion=6))
        await until(lambda: got, what="the appended line's record")
        assert [r.output_tokens for r in got] == [6]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
