"""Report values against a hand-computed ledger.

Six requests (``ledgers.HAND``), default bands:

====  =======  =========  ======  ======  ====  =====  =======
id    replica  outcome    prompt  output  TTFT  e2e    band
====  =======  =========  ======  ======  ====  =====  =======
A     r0       completed  100     500     0.5   10.5   0-1k
B     r0       truncated  200     1000    1.0   21.0   1k-5k
C     r0       aborted    300     200     2.0   4.0    0-1k
D     r1       error      50      -       -     1.0    unknown
E     r1       completed  100     6000    0.2   60.2   5k-10k
F     r0       completed  100     999     1.5   11.5   0-1k
====  =======  =========  ======  ======  ====  =====  =======

KV token-seconds = prompt x e2e + output x (e2e - TTFT) / 2:
A 1050 + 2500 = 3550; B 4200 + 10000 = 14200; C 1200 + 200 = 1400; D 50 + 0 = 50 (no output,
TTFT missing counts as 0); E 6020 + 180000 = 186020; F 1150 + 4995 = 6145. Total 211365.

Percentiles are pandas' default (linear between closest ranks): for 0-1k TTFT [0.5, 1.5, 2.0],
p90 sits at rank 0.9 x 2 = 1.8, i.e. 1.5 + 0.8 x 0.5 = 1.9.

The window runs from A's start to E's end: 4 + 60.2 = 64.2 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwatch.model import LengthBands, Outcome
from kvwatch.report import build_report
from kvwatch.report.summary import ALL, BandRow, Report, parse_band_edges

from . import ledgers

KV = {"A": 3550.0, "B": 14200.0, "C": 1400.0, "D": 50.0, "E": 186020.0, "F": 6145.0}
TOTAL_KV = sum(KV.values())
WINDOW = 64.2


@pytest.fixture
def report(tmp_path: Path) -> Report:
    return build_report([str(ledgers.write(tmp_path / "ledger.jsonl", ledgers.HAND))])


def row(report: Report, replica: str, band: str) -> BandRow:
    return next(r for r in report.rows if r.replica == replica and r.length_band == band)


def test_counts_and_shares_per_band(report: Report) -> None:
    assert report.requests == 6
    short = row(report, ALL, "0-1k")
    assert short.requests == 3
    assert short.request_share == pytest.approx(0.5)
    assert row(report, ALL, "unknown").requests == 1
    assert row(report, ALL, "10k-20k").requests == 0
    assert row(report, ALL, ALL).requests == 6


def test_outcome_ratios_are_exact(report: Report) -> None:
    short = row(report, ALL, "0-1k")
    assert short.completed_ratio == pytest.approx(2 / 3)
    assert short.aborted_ratio == pytest.approx(1 / 3)
    assert short.truncated_ratio == 0.0
    assert short.error_ratio == 0.0
    everything = row(report, ALL, ALL)
    assert everything.completed_ratio == pytest.approx(3 / 6)
    assert everything.truncated_ratio == pytest.approx(1 / 6)
    assert everything.error_ratio == pytest.approx(1 / 6)
    assert everything.rejected_ratio == 0.0


def test_latency_percentiles_use_linear_interpolation(report: Report) -> None:
    short = row(report, ALL, "0-1k")
    assert short.ttft_p50_seconds == pytest.approx(1.5)
    assert short.ttft_p90_seconds == pytest.approx(1.9)
    assert short.ttft_p99_seconds == pytest.approx(1.99)
    # e2e [4.0, 10.5, 11.5]
    assert short.e2e_p50_seconds == pytest.approx(10.5)
    assert short.e2e_p90_seconds == pytest.approx(10.5 + 0.8 * 1.0)
    # TPOT = (e2e - TTFT) / (output - 1): A 10/499, C 2/199, F 10/998
    tpots = sorted([10 / 499, 2 / 199, 10 / 998])
    assert short.tpot_p50_seconds == pytest.approx(tpots[1])


def test_output_token_distribution(report: Report) -> None:
    short = row(report, ALL, "0-1k")
    assert short.output_tokens_p50 == 500
    assert short.output_tokens_p90 == pytest.approx(500 + 0.8 * 499)
    assert short.output_tokens_mean == pytest.approx((500 + 200 + 999) / 3)
    assert row(report, ALL, "unknown").output_tokens_p50 is None


def test_kv_token_seconds_and_shares(report: Report) -> None:
    short = row(report, ALL, "0-1k")
    assert short.kv_token_seconds == pytest.approx(KV["A"] + KV["C"] + KV["F"])
    assert short.kv_share == pytest.approx((KV["A"] + KV["C"] + KV["F"]) / TOTAL_KV)
    assert row(report, ALL, "5k-10k").kv_share == pytest.approx(KV["E"] / TOTAL_KV)
    assert row(report, ALL, "unknown").kv_token_seconds == pytest.approx(KV["D"])
    assert row(report, ALL, ALL).kv_token_seconds == pytest.approx(TOTAL_KV)
    assert report.window_seconds == pytest.approx(WINDOW)
    assert short.kv_mean_tokens == pytest.approx((KV["A"] + KV["C"] + KV["F"]) / WINDOW)


def test_per_replica_rows_use_that_replicas_totals(report: Report) -> None:
    assert report.replicas == (ALL, "r0", "r1")
    r0 = row(report, "r0", "0-1k")
    assert r0.requests == 3
    assert r0.request_share == pytest.approx(3 / 4)
    r1 = row(report, "r1", "5k-10k")
    assert r1.kv_share == pytest.approx(KV["E"] / (KV["D"] + KV["E"]))
    assert row(report, "r1", ALL).error_ratio == pytest.approx(0.5)


def test_replica_filter_keeps_only_that_replica(tmp_path: Path) -> None:
    report = build_report([str(ledgers.write(tmp_path / "l.jsonl", ledgers.HAND))], replicas=["r1"])
    assert report.replicas == (ALL, "r1")
    assert row(report, ALL, ALL).requests == 2


def test_unknown_replica_filter_names_the_replicas_present(tmp_path: Path) -> None:
    from kvwatch.report import ReportError

    with pytest.raises(ReportError, match=r"r9.*replicas: r0, r1"):
        build_report([str(ledgers.write(tmp_path / "l.jsonl", ledgers.HAND))], replicas=["r9"])


def test_bands_option_rebands_from_output_tokens(tmp_path: Path) -> None:
    path = ledgers.write(tmp_path / "l.jsonl", ledgers.HAND)
    report = build_report([str(path)], bands=parse_band_edges("600,2k"))
    assert report.bands.names == ("0-600", "600-2k", "2k+")
    assert row(report, ALL, "0-600").requests == 2  # A (500), C (200)
    assert row(report, ALL, "600-2k").requests == 2  # B (1000), F (999)
    assert row(report, ALL, "2k+").requests == 1  # E


def test_ledger_bands_are_used_when_not_given(tmp_path: Path) -> None:
    bands = LengthBands((2000, 8000))
    path = ledgers.write(tmp_path / "l.jsonl", ledgers.HAND, bands=bands)
    report = build_report([str(path)])
    assert report.bands == bands
    assert "recorded in the ledger" in report.bands_origin
    assert row(report, ALL, "2k-8k").requests == 1  # E


def test_bad_band_edges_are_a_clear_error() -> None:
    from kvwatch.report import ReportError

    with pytest.raises(ReportError, match="ascending"):
        parse_band_edges("5000,1000")
    with pytest.raises(ReportError, match="--bands"):
        parse_band_edges("1k,lots")


@pytest.mark.parametrize("edge", ["inf", "-inf", "1e400", "1e308k", "nan"])
def test_a_band_edge_no_output_can_reach_is_a_clear_error(edge: str) -> None:
    """int(inf) raises OverflowError, which parse_band_edges did not catch: `--bands inf` ended
    `kvwatch report` in a traceback."""
    from kvwatch.report import ReportError

    with pytest.raises(ReportError, match=rf"--bands '1k,{edge}': '{edge}' is not a whole token count"):
        parse_band_edges(f"1k,{edge}")


def test_estimated_output_tokens_are_noted(tmp_path: Path) -> None:
    recs = [
        *ledgers.HAND,
        ledgers.record("r0", Outcome.COMPLETED, 6, 10, 20, 0.1, 1.0, output_tokens_estimated=True),
    ]
    report = build_report([str(ledgers.write(tmp_path / "l.jsonl", recs))])
    assert report.estimated_output_requests == 1
    assert any("counted from chunks" in n for n in report.notes)


def test_a_stream_left_before_usage_holds_its_estimated_prompt_in_kv_token_seconds(tmp_path: Path) -> None:
    """The proxy records no prompt count for a stream whose client left; its KV was held all the
    same, so KV token-seconds take the proxy's estimate from the request size, and say so."""
    left = ledgers.record("r0", Outcome.ABORTED, 1, None, 5, 1.0, 10.0, prompt_tokens_estimate=400)
    # left in the queue, never a token: it may never have held KV, so its estimate is not used
    unknown = ledgers.record("r0", Outcome.ABORTED, 2, None, None, None, 3.0, prompt_tokens_estimate=900)
    done = ledgers.record("r0", Outcome.COMPLETED, 3, 100, 20, 0.5, 2.5)
    report = build_report([str(ledgers.write(tmp_path / "l.jsonl", [left, unknown, done]))])
    assert report.kv_estimated_prompt_requests == 1 and report.kv_excluded_requests == 1
    [row] = [r for r in report.rows if r.replica == ALL and r.length_band == "0-1k"]
    assert row.kv_token_seconds == pytest.approx((400 * 10.0 + 5 * 9.0 / 2) + (100 * 2.5 + 20 * 2.0 / 2))
    assert row.prompt_tokens_p50 == 100  # the prompt percentiles stay the engine's counts
    assert any("estimated it from the request's size" in n for n in report.notes)


@pytest.mark.parametrize(
    ("recorded", "origin"),
    [
        (("1k-5k", "0-1k"), "from the band names recorded in the ledger"),
        (("0-2k", "0-1k"), "defaults: the ledger's band names come from more than one set of edges"),
        (("unknown",), "defaults"),  # read as names from several sets of edges before
        ((), "defaults"),
    ],
)
def test_a_ledgers_bands_come_from_the_names_it_recorded(recorded: tuple[str, ...], origin: str) -> None:
    from kvwatch.report.load import Loaded
    from kvwatch.report.summary import choose_bands

    _bands, said = choose_bands(Loaded("ledger", frame=None, recorded_bands=recorded), None)
    assert said.startswith(origin)
