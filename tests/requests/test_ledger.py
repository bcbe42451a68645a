"""The request ledger: line format, rotation cap, failures counted, and no text ever written."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import ClientSession

from kvwatch.model import DEFAULT_BANDS, Outcome, RequestRecord
from kvwatch.requests.ledger import WRITE_ERRORS, RequestLedger, ledger_line
from tests.local import until

from .scripted import Script, ScriptedEngine, launch_proxy

SECRET_PROMPT = "kvwatch-secret-prompt-6b1f9e"
SECRET_COMPLETION = "kvwatch-secret-completion-41d7"


def record(output: int = 1500, **kw: object) -> RequestRecord:
    base = {
        "replica": "r0",
        "model_name": "tiny",
        "source": "proxy",
        "outcome": Outcome.COMPLETED,
        "started_at": 1_760_000_000.5,
        "output_tokens": output,
        "max_tokens": 8000,
        "ttft_seconds": 0.25,
        "e2e_seconds": 15.25,
        "gap_bounds": (0.1, 1.0),
        "gap_counts": (3, 1, 0),
        "gap_sum": 1.5,
    }
    return RequestRecord(**{**base, **kw})  # type: ignore[arg-type]


def test_line_format() -> None:
    line = ledger_line(record(), DEFAULT_BANDS)
    assert line["v"] == 1
    assert (line["length_band"], line["admission_band"], line["outcome"]) == ("1k-5k", "5k-10k", "completed")
    assert line["tpot_seconds"] == pytest.approx(15.0 / 1499)
    assert line["gap_counts"] == [3, 1, 0]
    assert json.loads(json.dumps(line)) == line  # flat JSON: scalars and flat arrays only
    assert all(not isinstance(v, dict) for v in line.values())


class Counts:
    def __init__(self) -> None:
        self.c: Counter = Counter()

    def __call__(self, family: str, *labels: str, amount: float = 1) -> None:
        self.c[(family, *labels)] += amount


def _drain(ledger: RequestLedger) -> None:
    ledger.stop()


def test_lines_are_written_and_the_report_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = RequestLedger(str(path), DEFAULT_BANDS, counter=Counts())
    ledger.start()
    for output in (10, 1500, 1500, 25000):
        ledger.write(record(output))
    _drain(ledger)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["length_band"] for line in lines] == ["0-1k", "1k-5k", "1k-5k", "20k+"]

    from kvwatch.report import build_report

    report = build_report([str(path)])
    assert report.requests == 4 and report.malformed == 0
    counts = {r.length_band: r.requests for r in report.rows_for("r0")}
    assert counts["1k-5k"] == 2


def test_rotation_keeps_the_ledger_under_its_cap(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    size = len(json.dumps(ledger_line(record(), DEFAULT_BANDS), separators=(",", ":"))) + 1
    ledger = RequestLedger(str(path), DEFAULT_BANDS, max_bytes=size * 10, backups=2, counter=Counts())
    ledger.start()
    for _ in range(100):  # one batch for the writer, split where the file rotates
        ledger.write(record())
    _drain(ledger)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["ledger.jsonl", "ledger.jsonl.1", "ledger.jsonl.2"]
    assert all((tmp_path / f).stat().st_size <= size * 10 for f in files)


def test_write_errors_are_counted_never_raised(tmp_path: Path) -> None:
    counts = Counts()
    (tmp_path / "ledger.jsonl").mkdir()  # the path is a directory: every write fails
    ledger = RequestLedger(str(tmp_path / "ledger.jsonl"), DEFAULT_BANDS, counter=counts)
    ledger.start()
    ledger.write(record())
    ledger.write(record())
    _drain(ledger)
    assert counts.c[(WRITE_ERRORS,)] == 2


def test_a_line_that_cannot_be_encoded_is_counted_and_the_rest_written(tmp_path: Path) -> None:
    """Encoding happens in ``write`` (the caller's thread); a record JSON cannot hold is dropped and
    counted there, and an admitted one gives its room back."""
    counts = Counts()
    path = tmp_path / "ledger.jsonl"
    ledger = RequestLedger(str(path), DEFAULT_BANDS, counter=counts, queue_size=1)
    ledger.start()
    assert ledger.admit(1)
    ledger.write(record(finish_reason=object()), admitted=True)  # type: ignore[arg-type]
    assert not ledger.busy()  # the room it was admitted to is free again
    ledger.write(record(finish_reason=b"stop"))  # type: ignore[arg-type]
    ledger.write(record(10))
    _drain(ledger)
    assert counts.c[(WRITE_ERRORS,)] == 2
    assert [json.loads(line)["output_tokens"] for line in path.read_text().splitlines()] == [10]


def test_a_full_queue_drops_and_counts(tmp_path: Path) -> None:
    counts = Counts()
    ledger = RequestLedger(str(tmp_path / "l.jsonl"), DEFAULT_BANDS, counter=counts, queue_size=2)
    for _ in range(5):  # the writer is not started: nothing drains the queue
        ledger.write(record())
    assert counts.c[(WRITE_ERRORS,)] == 3


async def test_no_prompt_or_completion_text_reaches_the_ledger_or_the_logs(
    engine: ScriptedEngine, http: ClientSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "ledger.jsonl"
    ledger = RequestLedger(str(path), DEFAULT_BANDS, counter=Counts())
    ledger.start()
    records: list[RequestRecord] = []

    def sink(r: RequestRecord) -> None:
        records.append(r)
        ledger.write(r)

    harness = await launch_proxy(engine.url, sink=sink)
    try:
        engine.script = Script(contents=[(0.0, SECRET_COMPLETION), (0.0, SECRET_COMPLETION)])
        messages = [{"role": "user", "content": SECRET_PROMPT}]
        chat = {"model": SECRET_PROMPT, "messages": messages, "stream": True}
        completion = {"model": "tiny", "prompt": SECRET_PROMPT, "stream": False}
        async with http.post(f"{harness.url}/v1/chat/completions", json=chat) as response:
            assert SECRET_COMPLETION.encode() in await response.read()
        async with http.post(f"{harness.url}/v1/completions", json=completion) as response:
            await response.read()
        engine.script = Script(status=500, error_body=json.dumps({"error": SECRET_PROMPT}).encode())
        async with http.post(f"{harness.url}/v1/chat/completions", json=chat) as response:
            assert response.status == 500
        async with http.post(f"{harness.url}/v1/chat/completions", data=SECRET_PROMPT.encode()) as response:
            await response.read()
        await until(lambda: len(records) == 4)
    finally:
        await harness.server.stop()
        ledger.stop()
    text = path.read_text()
    assert len(text.splitlines()) == 4
    assert SECRET_PROMPT not in text and SECRET_COMPLETION not in text
    assert SECRET_PROMPT not in caplog.text and SECRET_COMPLETION not in caplog.text
    assert records[0].model_name == "other"  # the client's model string is not a label either
