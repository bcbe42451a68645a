"""What the report prints and writes: text, CSV, HTML, and nothing beyond its known columns."""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

import pytest

from kvwatch.cli import main
from kvwatch.model import Outcome
from kvwatch.report import ROW_COLUMNS, build_report, render_csv, render_html, render_text
from kvwatch.report.summary import ALL

from . import ledgers

SECRET = "SECRET-COMPLETION-TEXT"


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    return ledgers.write(tmp_path / "ledger.jsonl", ledgers.HAND)


def test_csv_has_the_documented_columns_and_one_row_per_band_and_replica(ledger: Path) -> None:
    report = build_report([str(ledger)])
    rows = list(csv.reader(io.StringIO(render_csv(report))))
    assert tuple(rows[0]) == ROW_COLUMNS
    assert ROW_COLUMNS[:4] == ("replica", "length_band", "requests", "request_share")
    body = rows[1:]
    # (all): 5 bands + unknown + all; r0: 5 + all (no unknown); r1: 5 + unknown + all
    assert len(body) == 7 + 6 + 7
    first = dict(zip(ROW_COLUMNS, body[0], strict=True))
    assert first["replica"] == ALL and first["length_band"] == "0-1k" and first["requests"] == "3"
    assert float(first["completed_ratio"]) == pytest.approx(2 / 3)
    empty = dict(zip(ROW_COLUMNS, next(r for r in body if r[1] == "20k+"), strict=True))
    assert empty["requests"] == "0" and empty["ttft_p50_seconds"] == ""


def test_html_is_self_contained(ledger: Path) -> None:
    page = render_html(build_report([str(ledger)]))
    assert page.startswith("<!DOCTYPE html>")
    assert "http" not in page  # no external resources, not even an xmlns
    assert not re.search(r"<(script|link|img|iframe)\b", page)
    assert re.search(r"\b(src|href)\s*=", page) is None
    assert page.count("<svg") >= 4  # TTFT, TPOT, e2e, output histogram, shares
    assert "<style>" in page


def test_html_escapes_names_from_the_input(tmp_path: Path) -> None:
    recs = [ledgers.record("<b>evil</b>", Outcome.COMPLETED, 0, 10, 20, 0.1, 1.0), *ledgers.HAND]
    page = render_html(build_report([str(ledgers.write(tmp_path / "l.jsonl", recs))]))
    assert "<b>evil</b>" not in page
    assert "&lt;b&gt;evil&lt;/b&gt;" in page


def test_no_field_outside_the_known_columns_reaches_any_output(tmp_path: Path) -> None:
    """Even if a ledger line carried text (RequestLedger never writes any), no output shows it."""
    lines = [ledgers.line(r).replace('{"v":1,', f'{{"v":1,"completion":"{SECRET}",') for r in ledgers.HAND]
    path = tmp_path / "l.jsonl"
    path.write_text("\n".join(lines) + "\n")
    report = build_report([str(path)])
    assert report.requests == len(ledgers.HAND)
    for output in (render_text(report), render_csv(report), render_html(report)):
        assert SECRET not in output


def test_text_report_is_aligned_and_names_each_replica(ledger: Path) -> None:
    text = render_text(build_report([str(ledger)]))
    assert "== all replicas: 6 requests ==" in text
    assert "== replica r0: 4 requests ==" in text
    assert "KV token-seconds: kv_token_seconds = prompt_tokens x e2e" in text
    table = text.split("== all replicas: 6 requests ==\n\n")[1].split("\n\n")[0].splitlines()
    header, first = table[0], table[1]
    assert header.index("requests") + len("requests") == first.index("3") + 1  # right-aligned


def test_cli_writes_csv_and_html_and_prints_text(
    ledger: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_csv, out_html = tmp_path / "bands.csv", tmp_path / "report.html"
    assert main(["report", str(ledger), "--csv", str(out_csv), "--html", str(out_html)]) == 0
    assert out_csv.read_text().startswith("replica,length_band,")
    assert "<svg" in out_html.read_text()
    captured = capsys.readouterr()
    assert "== all replicas" in captured.out
    assert captured.err == ""  # no progress bar when stderr is not a terminal


def test_cli_progress_bar_on_request(ledger: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(ledger), "--progress", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "reading [" in captured.err and "100%" in captured.err
    assert captured.out == ""


def test_cli_errors_name_what_to_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing.jsonl")]) == 1
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    ledger = ledgers.write(tmp_path / "l.jsonl", ledgers.HAND)
    assert main(["report", str(ledger), "--bands", "10,5"]) == 1
    assert "--bands '10,5'" in capsys.readouterr().err
    assert main(["report", str(ledger), "--html", str(tmp_path / "no" / "dir.html")]) == 1
    assert "cannot write" in capsys.readouterr().err
