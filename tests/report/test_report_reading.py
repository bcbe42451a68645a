"""Reading ledgers: malformed lines, the fast and the careful path agree, pieces, gzip, rotation."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvwatch.cli import main
from kvwatch.model import Outcome
from kvwatch.report import ReportError, build_report, render_text
from kvwatch.report.inputs import expand
from kvwatch.report.jsonlines import JsonLinesColumns
from kvwatch.report.load import LEDGER_FIELDS
from kvwatch.report.pieces import read_json_lines
from kvwatch.report.progress import Progress
from kvwatch.report.summary import ALL

from . import ledgers

GOOD = ledgers.line(ledgers.HAND[0])


@pytest.mark.parametrize("value", ["1" + "0" * 400, "-100"], ids=["overflow", "negative"])
@pytest.mark.parametrize("path", ["fast", "careful"])
def test_a_count_no_request_has_is_unknown_and_the_line_kept(tmp_path: Path, path: str, value: str) -> None:
    """float() of 1 and 400 zeros raises OverflowError: it stopped `kvwatch report` on the careful path
    (json.loads, taken by a line the fast pattern does not match: here an escaped string). A negative
    count was read as it was, into the percentiles."""
    huge = GOOD.replace('"prompt_tokens":100', f'"prompt_tokens":{value}')
    assert huge != GOOD
    if path == "careful":
        huge = huge.replace('"replica":"r0"', '"replica":"r\\u0030"')
        assert json.loads(huge)["replica"] == "r0"
    ledger = ledgers.write(tmp_path / "ledger.jsonl", ledgers.HAND, extra_lines={0: huge})
    report = build_report([str(ledger)])
    assert report.requests == len(ledgers.HAND) + 1 and report.malformed == 0
    frame = read_json_lines(expand([str(ledger)]), LEDGER_FIELDS, {"v": 1}, Progress(1, False), jobs=1).frame
    assert frame["prompt_tokens"].isna().sum() == 1 + sum(r.prompt_tokens is None for r in ledgers.HAND)


def test_a_start_no_calendar_holds_is_shown_as_unknown(tmp_path: Path) -> None:
    """time.gmtime(1e300) raises OverflowError: the report's window line ended `kvwatch report`."""
    far = GOOD.replace('"started_at":1750000000.0', '"started_at":1e300')
    assert far != GOOD
    report = build_report([str(ledgers.write(tmp_path / "ledger.jsonl", ledgers.HAND, extra_lines={0: far}))])
    assert "window: 2025-06-15 15:06:40Z -> - (" in render_text(report)


def test_malformed_lines_are_counted_reported_and_skipped(tmp_path: Path) -> None:
    bad = {
        0: "this is not json",
        1: GOOD[: len(GOOD) // 2],  # truncated write
        2: "[1, 2, 3]",
        3: GOOD.replace('"v":1', '"v":2'),
        4: GOOD.replace('"replica":"r0",', ""),
        5: GOOD.replace('"outcome":"completed"', '"outcome":"exploded"'),
        # then a blank line: not a record and not a problem
        5 + 1: GOOD.replace('"output_tokens":500', '"output_tokens":"500"') + "\n",
    }
    path = ledgers.write(tmp_path / "ledger.jsonl", ledgers.HAND, extra_lines=bad)
    report = build_report([str(path)])
    assert report.requests == len(ledgers.HAND)
    assert report.malformed == 7
    reasons = dict(report.malformed_reasons)
    assert reasons["not JSON"] == 2
    assert reasons["not a JSON object"] == 1
    assert reasons["v is 2, expected 1"] == 1
    assert reasons["missing replica"] == 1
    assert any(r.startswith("outcome 'exploded' is not one of") for r in reasons)
    assert reasons["output_tokens is not a number"] == 1
    assert report.malformed_examples[0] == f"{path}:1: not JSON"
    assert report.malformed_examples[1] == f"{path}:3: not JSON"
    clean = build_report([str(ledgers.write(tmp_path / "clean.jsonl", ledgers.HAND))])
    assert report.rows == clean.rows


def test_malformed_lines_never_echo_their_content(tmp_path: Path) -> None:
    path = ledgers.write(tmp_path / "l.jsonl", ledgers.HAND, extra_lines={0: "SECRET-PROMPT-TEXT {"})
    report = build_report([str(path)])
    assert report.malformed == 1
    assert all("SECRET" not in line for line in report.malformed_examples)


def test_writer_lines_take_the_fast_path(tmp_path: Path) -> None:
    """RequestLedger's own lines are read by the pattern, not by json.loads (the 1M-line target)."""
    path = ledgers.write(tmp_path / "l.jsonl", ledgers.HAND)
    reader = JsonLinesColumns(LEDGER_FIELDS, {"v": 1})
    reader.add_chunk(path.read_bytes(), str(path), 1)
    assert reader.records == reader.fast_lines == len(ledgers.HAND)


def test_careful_path_reads_the_same_values(tmp_path: Path) -> None:
    """Lines json.loads must read (spaces, other key order, escapes) give the same report."""
    respaced = [json.dumps(json.loads(ledgers.line(r))) for r in ledgers.HAND]  # ", " and ": "
    reordered = [json.dumps(dict(reversed(json.loads(ledgers.line(r)).items()))) for r in ledgers.HAND]
    fast = build_report([str(ledgers.write(tmp_path / "fast.jsonl", ledgers.HAND))])
    for name, lines in (("spaced", respaced), ("reordered", reordered)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        assert build_report([str(path)]).rows == fast.rows, name


def test_escaped_strings_are_decoded_like_json(tmp_path: Path) -> None:
    recs = [ledgers.record('r"quoted"', Outcome.COMPLETED, 0, 10, 20, 0.1, 1.0, model="m\\x"), *ledgers.HAND]
    report = build_report([str(ledgers.write(tmp_path / "l.jsonl", recs))])
    assert 'r"quoted"' in report.replicas
    assert report.malformed == 0


def test_pieces_read_every_line_once_in_parallel(tmp_path: Path) -> None:
    """Cut into many small pieces read by two worker processes: same columns, same line numbers."""
    many = [
        ledgers.record(f"r{i % 3}", Outcome.COMPLETED, i, 100 + i, 10 * i + 1, 0.1, 1.0 + i)
        for i in range(400)
    ]
    path = ledgers.write(tmp_path / "l.jsonl", many, extra_lines={150: "garbage", 399: "{broken"})
    files = expand([str(path)])
    whole = read_json_lines(files, LEDGER_FIELDS, {"v": 1}, Progress(1, False), jobs=1)
    split = read_json_lines(files, LEDGER_FIELDS, {"v": 1}, Progress(1, False), jobs=2, piece_bytes=4096)
    assert len(split.frame) == len(whole.frame) == 400
    assert sorted(split.frame["output_tokens"]) == sorted(whole.frame["output_tokens"])
    assert (
        split.problems.example_lines()
        == whole.problems.example_lines()
        == [f"{path}:151: not JSON", f"{path}:401: not JSON"]
    )


def test_a_piece_of_only_malformed_lines_leaves_the_rest_readable(tmp_path: Path) -> None:
    """A corrupt stretch longer than a piece gave a piece no rows: its empty string columns had
    another category dtype than the others', and combining the pieces raised TypeError."""
    good = [ledgers.record("r0", Outcome.COMPLETED, i, 100 + i, 10 * i + 1, 0.1, 1.0 + i) for i in range(20)]
    corrupt = "\n".join(["{broken " + "x" * 200] * 30)
    path = ledgers.write(tmp_path / "l.jsonl", good, extra_lines={10: corrupt})
    files = expand([str(path)])
    whole = read_json_lines(files, LEDGER_FIELDS, {"v": 1}, Progress(1, False), jobs=1)
    split = read_json_lines(files, LEDGER_FIELDS, {"v": 1}, Progress(1, False), jobs=1, piece_bytes=1024)
    assert len(split.frame) == len(whole.frame) == 20
    assert list(split.frame["replica"]) == list(whole.frame["replica"]) == ["r0"] * 20
    assert split.problems.total == whole.problems.total == 30


def test_gzip_and_rotated_files_and_globs(tmp_path: Path) -> None:
    ledgers.write(tmp_path / "ledger.jsonl", ledgers.HAND[:3])
    ledgers.write(tmp_path / "ledger.jsonl.1", ledgers.HAND[3:5])
    plain = ledgers.write(tmp_path / "old.jsonl", ledgers.HAND[5:])
    with gzip.open(tmp_path / "ledger.jsonl.2.gz", "wb") as fh:
        fh.write(plain.read_bytes())
    plain.unlink()
    files = expand([str(tmp_path / "ledger.jsonl*")])
    assert [f.path.name for f in files] == ["ledger.jsonl.2.gz", "ledger.jsonl.1", "ledger.jsonl"]
    report = build_report([str(tmp_path / "ledger.jsonl*")])
    whole = build_report([str(ledgers.write(tmp_path / "all.jsonl", ledgers.HAND))])
    assert report.rows == whole.rows
    assert [f.records for f in report.files] == [1, 2, 3]


def test_a_rotated_ledger_whose_newest_file_is_empty_reports_the_full_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rotation (RequestLedger._rotate) leaves a new, empty ledger.jsonl next to ledger.jsonl.1: format
    detection refused the empty file, and `kvwatch report 'ledger.jsonl*'` printed "file is empty"."""
    ledgers.write(tmp_path / "ledger.jsonl.1", ledgers.HAND)
    (tmp_path / "ledger.jsonl").write_bytes(b"")
    report = build_report([str(tmp_path / "ledger.jsonl*")])
    whole = build_report([str(tmp_path / "ledger.jsonl.1")])
    assert report.requests == len(ledgers.HAND) and report.malformed == 0
    assert report.rows == whole.rows
    assert [(Path(f.path).name, f.records) for f in report.files] == [
        ("ledger.jsonl.1", 6),
        ("ledger.jsonl", 0),
    ]
    assert main(["report", str(tmp_path / "ledger.jsonl*")]) == 0
    assert "file is empty" not in capsys.readouterr().err


def test_a_ledger_of_only_empty_files_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "ledger.jsonl.1").write_bytes(gzip.compress(b""))
    (tmp_path / "ledger.jsonl").write_text("\n")
    with pytest.raises(ReportError, match=r"ledger\.jsonl\.1, .*ledger\.jsonl: every file is empty"):
        build_report([str(tmp_path / "ledger.jsonl*")])


def test_missing_inputs_are_named(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=r"nothing\.jsonl: no such file"):
        build_report([str(tmp_path / "nothing.jsonl")])
    with pytest.raises(ReportError, match="no file matches"):
        build_report([str(tmp_path / "*.jsonl")])


def test_truncated_gzip_is_a_clear_error(tmp_path: Path) -> None:
    data = gzip.compress(("\n".join(ledgers.line(r) for r in ledgers.HAND) + "\n").encode())
    path = tmp_path / "ledger.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ReportError, match=r"ledger\.jsonl\.gz: cannot"):
        build_report([str(path)])


def test_empty_ledger_reports_zero_requests(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    path.write_text(GOOD + "\n" + "not json\n")
    report = build_report([str(path)], replicas=[])
    assert report.requests == 1
    path.write_text("")
    with pytest.raises(ReportError, match="empty"):
        build_report([str(path)])


def test_total_row_comes_last_per_replica(tmp_path: Path) -> None:
    report = build_report([str(ledgers.write(tmp_path / "l.jsonl", ledgers.HAND))])
    bands = [r.length_band for r in report.rows_for(ALL)]
    assert bands == ["0-1k", "1k-5k", "5k-10k", "10k-20k", "20k+", "unknown", ALL]
