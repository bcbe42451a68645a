"""Every bad input gets an error naming the line or key, and the command exits 1 without a traceback."""

import contextlib
import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from kvwatch.cli import main
from kvwatch.config import ConfigError
from kvwatch.mixin.slo import load_slo_file
from kvwatch.model import DEFAULT_BANDS
from kvwatch.plan.calibration import CalibrationError, calibration_from_mapping, describe, load_calibration
from kvwatch.plan.candidate import Candidate, CandidateError, candidate_from_mapping, engine_config
from kvwatch.plan.inputs import PlanInputError, read_workload
from kvwatch.plan.sources import SourceError, read_step_samples
from tests.hostile import hostile

GOOD = {
    "v": 1,
    "replica": "r0",
    "outcome": "completed",
    "started_at": 1.7e9,
    "prompt_tokens": 100,
    "output_tokens": 50,
    "max_tokens": 200,
    "e2e_seconds": 2.0,
    "ttft_seconds": 0.1,
}


def _ledger(tmp_path, lines):
    path = tmp_path / "ledger.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_a_ledger_line_without_a_required_field_names_the_line_and_key(tmp_path, capsys):
    broken = {k: v for k, v in GOOD.items() if k != "prompt_tokens"}
    path = _ledger(tmp_path, [GOOD, GOOD, broken])
    with pytest.raises(PlanInputError, match=r"line 3: missing 'prompt_tokens'"):
        read_workload([str(path)])
    assert main(["plan", "replay", str(path)]) == 1
    assert "line 3: missing 'prompt_tokens'" in capsys.readouterr().err


def test_a_count_too_large_for_a_float_names_the_line_and_key(tmp_path, capsys):
    """math.isfinite(10**400) raises OverflowError: `kvwatch plan replay` ended in a traceback."""
    path = _ledger(tmp_path, [GOOD, {**GOOD, "output_tokens": 10**400}])
    with pytest.raises(PlanInputError, match=r"line 2: 'output_tokens' is 1000.*, expected a number"):
        read_workload([str(path)])
    assert main(["plan", "replay", str(path)]) == 1
    assert "line 2: 'output_tokens'" in capsys.readouterr().err


def test_a_negative_count_names_the_line_and_key(tmp_path):
    with pytest.raises(PlanInputError, match=r"line 2: 'max_tokens' is -5, expected a whole token count"):
        read_workload([str(_ledger(tmp_path, [GOOD, {**GOOD, "outcome": "truncated", "max_tokens": -5}]))])


def test_an_aborted_line_without_its_e2e_cannot_be_replayed(tmp_path):
    aborted = {**GOOD, "outcome": "aborted"}
    del aborted["e2e_seconds"]
    with pytest.raises(PlanInputError, match=r"line 2: missing 'e2e_seconds' \(an aborted line needs"):
        read_workload([str(_ledger(tmp_path, [GOOD, aborted]))])


def test_error_and_rejected_lines_are_counted_not_replayed(tmp_path):
    w = read_workload(
        [
            str(
                _ledger(
                    tmp_path,
                    [GOOD, {**GOOD, "outcome": "error"}, {"v": 1, "replica": "r0", "outcome": "rejected"}],
                )
            )
        ]
    )
    assert len(w.requests) == 1 and sum(w.skipped.values()) == 2


def test_an_empty_trace_is_refused(tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(PlanInputError, match="empty"):
        read_workload([str(path)])
    assert main(["plan", "replay", str(path)]) == 1
    assert "empty" in capsys.readouterr().err


def test_a_rotated_ledger_whose_newest_file_is_empty_is_replayed(tmp_path):
    """Rotation leaves an empty ledger.jsonl next to ledger.jsonl.1: `plan replay` refused it as empty."""
    (tmp_path / "ledger.jsonl.1").write_text("".join(json.dumps(x) + "\n" for x in [GOOD, GOOD]))
    (tmp_path / "ledger.jsonl").write_text("")
    w = read_workload([str(tmp_path / "ledger.jsonl*")])
    assert w.kind == "ledger" and len(w.requests) == 2
    (tmp_path / "ledger.jsonl.1").write_text("")
    with pytest.raises(PlanInputError, match="every file is empty"):
        read_workload([str(tmp_path / "ledger.jsonl*")])


def test_an_slo_for_a_band_that_does_not_exist_names_the_key(tmp_path, capsys):
    slo = {
        "version": 1,
        "length_bands": [1000, 5000],
        "objectives": [
            {"name": "x", "sli": "ttft", "threshold": "2s", "objective": 0.99, "bands": ["9k-10k"]}
        ],
    }
    path = tmp_path / "slo.yaml"
    path.write_text(yaml.safe_dump(slo))
    with pytest.raises(ConfigError, match=r"objectives\[0\]\.bands.*9k-10k"):
        load_slo_file(path)
    ledger = _ledger(tmp_path, [GOOD])
    assert main(["plan", "compare", str(ledger), "--slo", str(path), "--gpus", "8"]) == 1
    assert "9k-10k" in capsys.readouterr().err


def test_a_candidate_whose_weights_do_not_fit_cannot_run(tmp_path, capsys):
    c = Candidate(name="big", model="llama-3.1-405b", gpu="h100", tp=2, dp=1)
    with pytest.raises(CandidateError, match=r"'big'.*cannot run.*weights per h100 GPU"):
        engine_config(c)
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"name": "big", "model": "llama-3.1-405b", "gpu": "h100", "tp": 2, "dp": 1})
    )
    assert main(["plan", "replay", str(_ledger(tmp_path, [GOOD])), "--candidate", str(path)]) == 1
    assert "cannot run" in capsys.readouterr().err


def test_a_candidate_file_with_an_unknown_or_mistyped_key_names_it():
    with pytest.raises(CandidateError, match=r"unknown key.*tensor_parallel"):
        candidate_from_mapping({"tensor_parallel": 2})
    with pytest.raises(CandidateError, match=r"candidate\.tp: expected int"):
        candidate_from_mapping({"tp": "two"})
    with pytest.raises(CandidateError, match="admission 'fifo' is not one of"):
        candidate_from_mapping({"admission": "fifo"})
    with pytest.raises(CandidateError, match=r"unknown key\(s\) 1, False"):  # YAML `1:` and `false:` keys
        candidate_from_mapping(yaml.safe_load("1: 2\nfalse: 3\ntp: 1\n"))


def test_a_calibration_file_with_a_missing_key_names_it(tmp_path):
    path = tmp_path / "cal.yaml"
    path.write_text(
        yaml.safe_dump({"kvwatch_calibration": 1, "source": "load", "step_cost": {"overhead_s": 0.1}})
    )
    with pytest.raises(CalibrationError, match=r"step_cost: missing key 'per_prefill_token_s'"):
        load_calibration(path)
    path.write_text("just: text\n")
    with pytest.raises(CalibrationError, match="not a kvwatch calibration file"):
        load_calibration(path)


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "1" + "0" * 400, "-1"])
def test_step_samples_with_a_number_no_step_has_name_the_line(tmp_path, bad):
    """NaN and infinity passed into the fit; 1 and 400 zeros raised OverflowError in float()."""
    path = tmp_path / "steps.jsonl"
    path.write_text(f"[10, 4, 1, 4, 12.5]\n[10, 4, 1, 4, {bad}]\n")
    with pytest.raises(SourceError, match=r"line 2: 'elapsed_ms' is .*, expected a number >= 0"):
        read_step_samples(path)


def test_step_samples_with_a_missing_field_name_the_line(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('[10, 4, 1, 4, 12.5]\n{"context_tokens": 0, "generation_tokens": 4}\n')
    with pytest.raises(SourceError, match=r"line 2: missing 'num_context_reqs'"):
        read_step_samples(path)


def test_bands_of_the_default_set_are_the_ones_an_slo_names():
    assert "1k-5k" in DEFAULT_BANDS.names


@pytest.mark.parametrize(
    "answer",
    [
        b'{"status": "success", "data": null}',
        b'{"status": "success", "data": {"result": [{"metric": {}, "values": [["x"]]}]}}',
        b'{"status": "success", "data": {"result": [5]}}',
        b"[1, 2]",
        b'{"status": "error", "errorType": "bad_data", "error": "parse error"}',
    ],
)
def test_a_prometheus_answer_of_another_shape_is_a_source_error(monkeypatch, answer):
    """A Thanos or Mimir in front of Prometheus, or a proxy, may answer in another shape: a KeyError or
    TypeError used to end `kvwatch plan calibrate --prometheus` with a traceback."""
    import httpx

    from kvwatch.plan import prometheus
    from kvwatch.plan.calibration import EngineShape

    monkeypatch.setattr(prometheus.httpx, "get", lambda url, **kw: httpx.Response(200, content=answer))
    with pytest.raises(SourceError, match=r"http://prom\.test"):
        prometheus.observations_from_prometheus(
            "http://prom.test",
            since="1h",
            until=1.7e9,
            window="1m",
            selector='job="vllm"',
            shape=EngineShape(),
        )


CANDIDATE = {"name": "tp2", "model": "qwen3-32b", "gpu": "h200", "tp": 2, "dp": 4, "max_num_seqs": 256}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile(CANDIDATE, changes=3))
def test_any_value_in_a_candidate_is_a_candidate_error_or_a_candidate_that_builds(data):
    """What `kvwatch plan` does with a candidate file's mapping: a CandidateError naming the key, or a
    candidate the simulator can run (before: `model: null` raised AttributeError, a 400-digit
    gpu_memory_utilization OverflowError)."""
    with contextlib.suppress(CandidateError):
        engine_config(candidate_from_mapping(data))


CALIBRATION = {
    "kvwatch_calibration": 1,
    "source": "step_samples",
    "created_at": "2026-12-06T14:42:21Z",
    "window": "file steps.jsonl",
    "engine": {"model_name": "tiny", "block_size": 16, "num_gpu_blocks": 2000, "tensor_parallel_size": 1},
    "step_cost": {
        "overhead_s": 0.01,
        "per_prefill_token_s": 2e-06,
        "per_decode_seq_s": 0.0001,
        "per_kv_token_s": 0.0,
    },
    "fit": {
        "observations": 400,
        "steps": 400.0,
        "r2": 1.0,
        "residual_p50": 0.0,
        "residual_p90": 0.0,
        "rmse_s": 0.0,
        "fitted_terms": ["overhead_s", "per_prefill_token_s", "per_decode_seq_s"],
        "unfitted_terms": ["per_kv_token_s"],
    },
    "notes": ["step samples carry no KV token counts: per_kv_token_s is not fitted"],
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile(CALIBRATION, changes=3))
def test_any_value_in_a_calibration_is_a_calibration_error_or_a_calibration_that_runs(data):
    """What `kvwatch plan --calibration` does with the file: a CalibrationError naming the key, or a
    calibration a candidate on its model can use (its description printed, its step cost timed)."""
    try:
        cal = calibration_from_mapping(data)
    except CalibrationError:
        return
    describe(cal)
    with contextlib.suppress(CandidateError):
        engine_config(Candidate(model="calibrated", step_model="calibrated"), cal)


@pytest.mark.parametrize("value", ["nan", "-1", "1e400", "inf", "x"])
def test_a_price_that_is_no_price_is_refused_by_name(value):
    """NaN, infinity and negative prices were taken: a cost column of nan or -inf per 1k tokens."""
    from kvwatch.plan.compare import parse_prices

    with pytest.raises(CandidateError, match=rf"--price 'h200={value}': '{value}' is not a price"):
        parse_prices(f"h200={value}")
    assert parse_prices("h200=2.5, h100=0") == {"h200": 2.5, "h100": 0.0}
