"""Reference traces: Azure, BurstGPT and Mooncake files written from their documented columns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwatch.report import ReportError, build_report, render_text
from kvwatch.report.summary import ALL, Report

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.5386800,879,1500
2023-11-16 18:16:06.0000000,1200,6000
"""

BURSTGPT = """Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type
5,s1,2.5,ChatGPT,472,18,490,Conversation log
45,s2,10.0,ChatGPT,1087,230,1317,Conversation log
118,s3,30.0,GPT-4,417,1200,1617,API log
200,s4,60.0,GPT-4,900,0,900,API log
"""


def mooncake_lines() -> list[str]:
    rows = [(0, 6955, 52), (3052, 6472, 26), (3660, 3000, 2400), (5000, 20000, 12000)]
    return [
        json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": [1, 2, 3]})
        for t, i, o in rows
    ]


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def rows(report: Report) -> dict[str, object]:
    return {r.length_band: r for r in report.rows_for(report.replicas[1])}


def test_azure_trace_gives_length_distribution_without_latency(tmp_path: Path) -> None:
    report = build_report([write(tmp_path / "AzureLLMInferenceTrace_conv.csv", AZURE)])
    assert report.kind == "azure"
    assert report.replicas == (ALL, "AzureLLMInferenceTrace_conv")
    by_band = rows(report)
    assert by_band["0-1k"].requests == 2
    assert by_band["1k-5k"].requests == 1
    assert by_band["5k-10k"].request_share == pytest.approx(0.25)
    assert by_band[ALL].prompt_tokens_p50 == pytest.approx((396 + 879) / 2)
    assert by_band[ALL].completed_ratio is None  # no outcome in the trace
    assert by_band[ALL].e2e_p50_seconds is None
    assert by_band[ALL].kv_token_seconds is None
    assert report.window_seconds == pytest.approx(19.31941)
    assert "no latency" in " ".join(report.notes)
    text = render_text(report)
    assert "TTFT p50" not in text and "completed" not in text


def test_burstgpt_trace_uses_elapsed_time_as_e2e_and_zero_tokens_as_failure(tmp_path: Path) -> None:
    report = build_report([write(tmp_path / "BurstGPT_1.csv", BURSTGPT)])
    assert report.kind == "burstgpt"
    by_band = rows(report)
    assert by_band["0-1k"].requests == 2
    assert by_band["0-1k"].e2e_p50_seconds == pytest.approx(6.25)
    assert by_band["unknown"].requests == 1  # Response tokens 0: failed, length unknown
    assert by_band[ALL].error_ratio == pytest.approx(0.25)
    assert by_band[ALL].completed_ratio == pytest.approx(0.75)
    # KV token-seconds with TTFT 0: 472 x 2.5 + 18 x 2.5 / 2
    assert by_band["0-1k"].kv_token_seconds == pytest.approx(472 * 2.5 + 18 * 2.5 / 2 + 1087 * 10 + 230 * 5)
    assert by_band[ALL].ttft_p50_seconds is None
    assert "TTFT as 0" in " ".join(report.notes)


def test_burstgpt_without_elapsed_time_has_no_latency(tmp_path: Path) -> None:
    old = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,ChatGPT,472,18,490,x\n"
    report = build_report([write(tmp_path / "BurstGPT_old.csv", old)])
    assert not report.has_e2e
    assert rows(report)["0-1k"].requests == 1


def test_mooncake_trace(tmp_path: Path) -> None:
    report = build_report([write(tmp_path / "conversation_trace.jsonl", "\n".join(mooncake_lines()) + "\n")])
    assert report.kind == "mooncake"
    by_band = rows(report)
    assert by_band["0-1k"].requests == 2
    assert by_band["10k-20k"].requests == 1
    assert by_band[ALL].output_tokens_p50 == pytest.approx((52 + 2400) / 2)
    assert report.window_seconds == pytest.approx(5.0)  # ms timestamps


def test_a_trace_file_without_one_valid_line_leaves_the_others_readable(tmp_path: Path) -> None:
    """Its frame had no rows, and its empty categories another dtype: joining the files' frames
    raised TypeError (union_categoricals) and the report ended in a traceback."""
    good = write(tmp_path / "good.jsonl", "\n".join(mooncake_lines()) + "\n")
    bad = write(tmp_path / "bad.jsonl", '{"timestamp":"x","input_length":10,"output_length":5}\n')
    report = build_report([good, bad], trace_format="mooncake")
    assert rows(report)[ALL].requests == len(mooncake_lines())
    assert report.malformed == 1 and report.replicas == (ALL, "good")


def test_each_trace_file_is_its_own_group(tmp_path: Path) -> None:
    a = write(tmp_path / "conv.csv", AZURE)
    b = write(tmp_path / "code.csv", AZURE.replace(",6000", ",60"))
    report = build_report([a, b])
    assert report.replicas == (ALL, "code", "conv")
    assert rows(report)["5k-10k"].requests == 0  # "code" sorts first


def test_malformed_trace_rows_are_counted(tmp_path: Path) -> None:
    text = AZURE + "2023-11-16 18:17:00,abc,12\n2023-11-16 18:17:01,5,6,7,8\n"
    report = build_report([write(tmp_path / "t.csv", text)])
    assert report.requests == 4
    assert report.malformed == 2
    bad_json = "\n".join([*mooncake_lines(), '{"timestamp": 1, "input_length": "x", "output_length": 2}'])
    report = build_report([write(tmp_path / "m.jsonl", bad_json + "\n")])
    assert report.malformed == 1
    assert report.malformed_examples == (f"{tmp_path / 'm.jsonl'}:5: input_length is not a number",)


@pytest.mark.parametrize("bad", ["-5", "1e400", "inf", "1" + "0" * 400])
def test_trace_rows_with_counts_no_request_has_are_counted_malformed(tmp_path: Path, bad: str) -> None:
    """A negative, infinite or overflowing token count was taken as is: "prompt p50 inf", and -5 output
    tokens inside the percentiles."""
    text = AZURE + f"2023-11-16 18:17:00,{bad},12\n2023-11-16 18:17:01,12,{bad}\n"
    report = build_report([write(tmp_path / "t.csv", text)])
    assert (report.requests, report.malformed) == (4, 2)
    assert rows(report)[ALL].prompt_tokens_p50 == pytest.approx((396 + 879) / 2)


@pytest.mark.parametrize("bad", ["-3", "abc", "inf", "1" + "0" * 400, ""])
@pytest.mark.parametrize("column", ["Timestamp", "Elapsed time"])
def test_burstgpt_rows_with_times_no_request_has_are_counted_malformed(
    tmp_path: Path, column: str, bad: str
) -> None:
    """Only the token columns were checked: a row at Elapsed -3 was kept, and the report showed an e2e
    of -3 s and KV shares of 113.6% and -17.9%."""
    cells = {"Timestamp": "300", "Elapsed time": "5.0"} | {column: bad}
    text = BURSTGPT + f"{cells['Timestamp']},s5,{cells['Elapsed time']},GPT-4,100,50,150,API log\n"
    report = build_report([write(tmp_path / "BurstGPT_1.csv", text)])
    assert (report.requests, report.malformed) == (4, 1)
    assert dict(report.malformed_reasons) == {
        "missing, unparsable or negative Timestamp, Elapsed time, Request tokens or Response tokens": 1
    }
    by_band = rows(report)
    assert by_band["0-1k"].e2e_p50_seconds == pytest.approx(6.25)
    assert all(0 <= row.kv_share <= 1 for row in by_band.values() if row.kv_share is not None)


def test_old_burstgpt_rows_with_a_negative_timestamp_are_counted_malformed(tmp_path: Path) -> None:
    old = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,ChatGPT,472,18,490,x\n"
    report = build_report([write(tmp_path / "BurstGPT_old.csv", old + "-1,ChatGPT,10,10,20,x\n")])
    assert (report.requests, report.malformed) == (1, 1)
    assert dict(report.malformed_reasons) == {
        "missing, unparsable or negative Timestamp, Request tokens or Response tokens": 1
    }


@pytest.mark.parametrize("bad", [-3, 10**400, "1e400"])
def test_mooncake_counts_no_request_has_are_unknown(tmp_path: Path, bad: object) -> None:
    line = f'{{"timestamp": 6000, "input_length": 10, "output_length": {bad}, "hash_ids": [1]}}'
    report = build_report([write(tmp_path / "m.jsonl", "\n".join([*mooncake_lines(), line]) + "\n")])
    assert report.requests == 5
    assert rows(report)[ALL].output_tokens_p50 == pytest.approx((52 + 2400) / 2)  # the four good rows


def test_forced_format_and_unknown_format(tmp_path: Path) -> None:
    path = write(tmp_path / "t.csv", AZURE)
    assert build_report([path], trace_format="azure").kind == "azure"
    with pytest.raises(ReportError, match="missing column"):
        build_report([path], trace_format="burstgpt")
    odd = write(tmp_path / "odd.csv", "a,b,c\n1,2,3\n")
    with pytest.raises(ReportError, match=r"odd.csv: cannot tell the format.*--trace-format"):
        build_report([odd])


@pytest.mark.parametrize("empty", ["", "\n"], ids=["no-bytes", "blank-line"])
@pytest.mark.parametrize(
    "name", ["AzureLLMInferenceTrace_conv.csv", "BurstGPT_1.csv", "conversation_trace.jsonl"]
)
def test_an_empty_file_next_to_a_trace_adds_no_request(tmp_path: Path, name: str, empty: str) -> None:
    """Detection refused the empty file; told its format, pandas refused it ("No columns to parse")."""
    texts = {
        ".csv": AZURE if name.startswith("Azure") else BURSTGPT,
        ".jsonl": "\n".join(mooncake_lines()) + "\n",
    }
    full = write(tmp_path / name, texts[Path(name).suffix])
    blank = write(tmp_path / f"zz{Path(name).suffix}", empty)
    report = build_report([full, blank])
    assert (report.requests, report.malformed) == (4, 0)
    assert report.replicas == (ALL, Path(name).stem)
    assert build_report([blank], trace_format=report.kind).requests == 0


def test_formats_are_not_mixed(tmp_path: Path) -> None:
    azure = write(tmp_path / "a.csv", AZURE)
    moon = write(tmp_path / "m.jsonl", "\n".join(mooncake_lines()) + "\n")
    with pytest.raises(ReportError, match="different formats"):
        build_report([azure, moon])


@pytest.mark.parametrize("stamp", ["yesterday", ""])
def test_azure_rows_without_a_time_are_counted_malformed(tmp_path: Path, stamp: str) -> None:
    """They were kept with an unknown start, so the window and rate read them as requests at no time."""
    report = build_report([write(tmp_path / "AzureLLMInferenceTrace_conv.csv", AZURE + f"{stamp},100,50\n")])
    assert (report.requests, report.malformed) == (4, 1)
    assert dict(report.malformed_reasons) == {"missing or unparsable TIMESTAMP": 1}
    assert report.window_seconds == pytest.approx(19.3194100)


def test_two_trace_files_of_one_name_stay_two_groups(tmp_path: Path) -> None:
    """Groups were named by file name alone: a/conv.csv and b/conv.csv merged into one."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write(tmp_path / "a" / "AzureLLMInferenceTrace_conv.csv", AZURE)
    second = write(tmp_path / "b" / "AzureLLMInferenceTrace_conv.csv", AZURE)
    report = build_report([first, second])
    assert report.replicas == (ALL, "a/AzureLLMInferenceTrace_conv", "b/AzureLLMInferenceTrace_conv")
    assert report.requests == 8
    alone = build_report([first, write(tmp_path / "other.csv", AZURE)])
    assert alone.replicas == (ALL, "AzureLLMInferenceTrace_conv", "other")  # no folder where names differ
