"""`plan replay --limit N` and `--bands`: the recorded side is the same requests, in the same bands.

The ledger below has 40 requests one second apart; the first 10 took 1 s end to end, the others
100 s, and two error and two rejected lines fall among them. Its lines are in completion order, not
arrival order, as a proxy writes them. Replaying the first 10 must compare with those 10 (and the
unreplayed lines that arrived meanwhile), not with the whole file.
"""

import json
import random

from kvwatch.cli import main
from kvwatch.plan.inputs import read_workload
from kvwatch.plan.recorded import recorded_report
from kvwatch.report.summary import ALL

T0 = 1.7e9


def _line(t: float, e2e: float, outcome: str = "completed", output: int = 100) -> dict:
    return {
        "v": 1,
        "replica": "r0",
        "outcome": outcome,
        "started_at": T0 + t,
        "prompt_tokens": 50,
        "output_tokens": output,
        "max_tokens": 4000,
        "ttft_seconds": 0.1,
        "e2e_seconds": e2e,
    }


def _ledger(tmp_path):
    lines = [_line(i, 1.0 if i < 10 else 100.0, output=100 if i % 2 else 3000) for i in range(40)]
    lines += [_line(5.5, 0.1, "error"), _line(7.5, 0.0, "rejected")]  # among the first 10
    lines += [_line(30.5, 0.1, "error"), _line(35.5, 0.0, "rejected")]  # after them
    random.Random(1).shuffle(lines)  # completion order
    path = tmp_path / "ledger.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _all_bands_line(out: str) -> str:
    return next(ln for ln in out.splitlines() if ln.startswith("all bands"))


def test_limit_compares_the_first_n_requests_with_the_same_recorded_requests(tmp_path, capsys):
    path = _ledger(tmp_path)
    assert main(["plan", "replay", str(path), "--limit", "10", "--candidate", _small(tmp_path)]) == 0
    out = capsys.readouterr().out
    # 10 replayed; recorded: those 10 and the error and rejected lines that arrived by the 10th
    assert "10 (12)" in _all_bands_line(out), out
    skipped = next(ln for ln in out.splitlines() if ln.startswith("not replayed: "))
    assert sorted(skipped.removeprefix("not replayed: ").split(", ")) == [
        "outcome error (never served) 1",
        "outcome rejected (never served) 1",
    ]
    recorded = recorded_report(read_workload([str(path)], limit=10, keep_lines=True))
    total = next(r for r in recorded.rows_for(ALL) if r.length_band == ALL)
    assert total.requests == 12 and total.e2e_p99_seconds == 1.0  # not the later requests' 100 s


def test_limit_on_a_trace_compares_the_same_first_rows(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 50, "output_length": 100} for i in range(40)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))
    assert main(["plan", "replay", str(trace), "--limit", "10", "--candidate", _small(tmp_path)]) == 0
    assert "10 (10)" in _all_bands_line(capsys.readouterr().out)


def test_a_limit_below_one_is_refused_by_name(tmp_path, capsys):
    path = _ledger(tmp_path)
    for limit in ("0", "-5"):
        assert main(["plan", "replay", str(path), "--limit", limit]) == 1
        assert (
            f"--limit must be at least 1 (replay the first N requests), got {limit}"
            in capsys.readouterr().err
        )


def test_bands_apply_to_the_recorded_rows_too(tmp_path, capsys):
    path = _ledger(tmp_path)
    assert main(["plan", "replay", str(path), "--bands", "2k,8k", "--candidate", _small(tmp_path)]) == 0
    rows = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln[:1].isdigit()}
    # 20 requests of 100 output tokens (and the 4 unreplayed lines, of 100 too), 20 of 3,000
    assert "20 (24)" in rows["0-2k"] and "20 (20)" in rows["2k-8k"]


def _small(tmp_path) -> str:
    """A one-GPU twin: the replay is quick and what it computes is not under test here."""
    path = tmp_path / "one.yaml"
    path.write_text("model: llama-3.1-8b\ndp: 1\n")
    return str(path)
