"""The SLO file: what it accepts, and that every mistake is named by key path with what to do."""

from __future__ import annotations

import copy

import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from kvwatch import buckets
from kvwatch.cli import main as cli
from kvwatch.config import ConfigError
from kvwatch.mixin.slo import ANY_MODEL, load_slo_file, slo_from_mapping
from tests.hostile import hostile

from .helpers import ALERTS

VALID = {
    "version": 1,
    "period": "28d",
    "objectives": [
        {"name": "tpot-medium", "sli": "tpot", "threshold": "60ms", "objective": 0.99, "bands": ["5k-10k"]},
        {"name": "completion", "sli": "completion", "objective": 0.995, "bands": "*"},
    ],
}


def _with(**objective_changes) -> dict:
    data = copy.deepcopy(VALID)
    data["objectives"][0].update(objective_changes)
    return data


def _problems(data) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        slo_from_mapping(data)
    return dict(info.value.problems)


def test_shipped_default_slo_file_is_valid_with_per_band_objectives() -> None:
    slo = load_slo_file(ALERTS / "slo.yaml")
    by_name = {o.name: o for o in slo.objectives}
    assert by_name["tpot-medium"].threshold == 0.06
    assert by_name["tpot-medium"].bands == ("5k-10k",)
    assert by_name["ttft-short"].threshold < by_name["ttft-long"].threshold  # tighter for short answers
    assert by_name["completion"].bands == slo.bands.names
    assert slo.long_bands == ("10k-20k", "20k+") and slo.short_bands == ("0-1k", "1k-5k")


def test_threshold_as_duration_resolves_to_the_exact_bucket_boundary() -> None:
    slo = slo_from_mapping(VALID)
    tpot = slo.objectives[0]
    assert tpot.threshold in buckets.TPOT_SECONDS  # 60 * 0.001 is not 0.06 in floats; the boundary is
    assert tpot.error_budget == 0.01
    assert tpot.model == ANY_MODEL


def test_threshold_off_the_buckets_is_rejected_and_the_boundaries_are_listed() -> None:
    problems = _problems(_with(threshold=0.07))
    message = problems["objectives[0].threshold"]
    assert "0.07 s is not a bucket boundary of kvwatch_request_tpot_seconds" in message
    assert "nearest: 0.06, 0.075" in message
    assert "boundaries: " + ", ".join(buckets.le_label(b) for b in buckets.TPOT_SECONDS) in message


def test_an_objective_too_large_for_a_float_is_named() -> None:
    """10**400 raised OverflowError out of the SLO file's reader before."""
    assert "between 0 and 1" in _problems(_with(objective=10**400))["objectives[0].objective"]


def test_latency_objective_without_threshold_is_rejected() -> None:
    data = _with()
    del data["objectives"][0]["threshold"]
    assert _problems(data)["objectives[0].threshold"] == "required"


def test_each_missing_key_is_one_problem() -> None:
    with pytest.raises(ConfigError) as info:
        slo_from_mapping({"objectives": [{"bands": ["0-1k"]}]})
    assert sorted(info.value.problems) == [
        ("objectives[0].name", "required"),
        ("objectives[0].objective", "required"),
        ("objectives[0].sli", "required"),
    ]


def test_completion_objective_takes_no_threshold() -> None:
    data = copy.deepcopy(VALID)
    data["objectives"][1]["threshold"] = "1s"
    assert "no latency threshold" in _problems(data)["objectives[1].threshold"]


def test_unknown_band_lists_the_valid_bands() -> None:
    message = _problems(_with(bands=["5k-10k", "10k-50k"]))["objectives[0].bands"]
    assert "'10k-50k'" in message
    assert "valid: 0-1k, 1k-5k, 5k-10k, 10k-20k, 20k+, unknown" in message


def test_bands_follow_custom_length_band_edges() -> None:
    data = _with(bands=["0-2k"])
    data["length_bands"] = [2000, 8000]
    data["objectives"][1]["bands"] = ["8k+"]
    slo = slo_from_mapping(data)
    assert slo.bands.names == ("0-2k", "2k-8k", "8k+")
    assert slo.objectives[0].bands == ("0-2k",)


@pytest.mark.parametrize("objective", [0, 1, 1.5, -0.1, "high", True])
def test_objective_must_be_a_ratio_between_zero_and_one(objective) -> None:
    assert "objectives[0].objective" in _problems(_with(objective=objective))


def test_objective_as_percent_string() -> None:
    assert slo_from_mapping(_with(objective="99.9%")).objectives[0].objective == pytest.approx(0.999)


def test_objective_whose_page_could_never_fire_is_rejected() -> None:
    message = _problems(_with(objective=0.9))["objectives[0].objective"]
    assert "could never fire" in message and "above 0.9306" in message


@pytest.mark.parametrize("min_requests", [0, -3, 2.5, "many"])
def test_minimum_traffic_guard_must_be_a_positive_count(min_requests) -> None:
    assert "objectives[0].min_requests" in _problems(_with(min_requests=min_requests))


def test_outcomes_must_be_known_and_not_both_good_and_bad() -> None:
    data = copy.deepcopy(VALID)
    data["objectives"][1]["good_outcomes"] = ["completed", "error"]
    data["objectives"][1]["bad_outcomes"] = ["error", "timeout"]
    problems = _problems(data)
    assert "unknown outcome(s) 'timeout'" in problems["objectives[1].bad_outcomes"]
    data["objectives"][1]["bad_outcomes"] = ["error"]
    assert "error cannot be both good and bad" in _problems(data)["objectives[1].bad_outcomes"]


def test_latency_objective_cannot_count_outcomes() -> None:
    problems = _problems(_with(bad_outcomes=["error"]))
    assert "only completion objectives" in problems["objectives[0].bad_outcomes"]


def test_matchers_only_on_labels_the_sli_family_has() -> None:
    objective = slo_from_mapping(_with(matchers={"source": "proxy"})).objectives[0]
    assert objective.matchers == (("source", "proxy"),)
    message = _problems(_with(matchers={"length_band": "20k+"}))["objectives[0].matchers"]
    assert "cannot be matched" in message and "allowed: replica, source" in message


def test_duplicate_names_unknown_keys_and_bad_period_are_all_reported_at_once() -> None:
    data = _with(name="completion", thresold="1s")
    data["period"] = "1d"
    problems = _problems(data)
    assert "duplicate objective name 'completion'" in problems["objectives[1].name"]
    assert "unknown key" in problems["objectives[0].thresold"]
    assert "at least 3d" in problems["period"]
    assert len(problems) >= 3


def test_unknown_sli_lists_the_slis() -> None:
    assert "one of ttft, tpot, e2e, completion" in _problems(_with(sli="itl"))["objectives[0].sli"]


def test_unsupported_version_and_empty_objectives() -> None:
    problems = _problems({"version": 2, "objectives": []})
    assert "unsupported version" in problems["version"]
    assert "non-empty list" in problems["objectives"]


def test_a_band_cannot_be_both_long_and_short() -> None:
    data = copy.deepcopy(VALID)
    data["long_bands"] = ["20k+", "5k-10k"]
    data["short_bands"] = ["0-1k", "5k-10k"]
    assert "5k-10k cannot be both" in _problems(data)["short_bands"]


def test_yaml_syntax_error_names_the_line(tmp_path) -> None:
    path = tmp_path / "slo.yaml"
    path.write_text("version: 1\nobjectives:\n  - name: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_slo_file(path)
    assert info.value.problems[0][0].startswith("line ")


def test_rules_command_reports_every_problem_by_key_path_and_writes_nothing(tmp_path, capsys) -> None:
    path = tmp_path / "slo.yaml"
    path.write_text(yaml.safe_dump(_with(threshold=0.07, bands=["nope"])))
    out = tmp_path / "out"
    assert cli(["rules", "--slo", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "objectives[0].threshold: 0.07 s is not a bucket boundary" in err
    assert "objectives[0].bands: unknown length band(s) 'nope'" in err
    assert not out.exists()


def test_alert_knobs_default_to_the_shipped_values_and_can_be_set() -> None:
    from kvwatch.mixin.thresholds import DEFAULT_FOR, AlertConfig

    assert slo_from_mapping(VALID).alerts == AlertConfig()
    data = {
        **VALID,
        "alerts": {
            "thresholds": {"kv_pressure_usage": 0.9, "headroom_seconds": 600},
            "for": {"KVWatchGPUThrottled": "30m", "KVWatchGPULost": "0s"},
        },
    }
    knobs = slo_from_mapping(data).alerts
    assert (knobs.kv_pressure_usage, knobs.headroom_seconds, knobs.stranded_ratio) == (0.9, 600, 0.2)
    assert knobs.for_of("KVWatchGPUThrottled") == "30m" and knobs.for_of("KVWatchGPULost") is None
    assert knobs.for_of("KVWatchDown") == DEFAULT_FOR["KVWatchDown"] == "5m"


def test_bad_alert_knobs_are_named_by_key_path() -> None:
    found = _problems(
        {
            **VALID,
            "alerts": {
                "thresholds": {
                    "kv_pressure_usage": 1.5,
                    "headroom_seconds": -1,
                    "kv_presure_usage": 0.9,
                    "starving_min_requests": 2.5,
                },
                "for": {"KVWatchDown": "five minutes", "KVWatchNope": "5m"},
                "selector": "x",
            },
        }
    )
    assert "from 0 to 1" in found["alerts.thresholds.kv_pressure_usage"]
    assert "non-negative" in found["alerts.thresholds.headroom_seconds"]
    assert "unknown threshold" in found["alerts.thresholds.kv_presure_usage"]
    assert "whole number" in found["alerts.thresholds.starving_min_requests"]
    assert "Prometheus duration" in found["alerts.for.KVWatchDown"]
    assert "unknown alert" in found["alerts.for.KVWatchNope"]
    assert "unknown key" in found["alerts.selector"]


def test_every_alert_kvwatch_ships_has_a_for_knob() -> None:
    from kvwatch.mixin.rulefile import alert_names
    from kvwatch.mixin.rules import FLEET_FILE, NODE_FILE, rule_files
    from kvwatch.mixin.thresholds import DEFAULT_FOR

    files = [
        f for f in rule_files(load_slo_file(ALERTS / "slo.yaml")) if f.filename in (NODE_FILE, FLEET_FILE)
    ]
    assert set(alert_names(files)) == set(DEFAULT_FOR)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile(VALID, changes=3))
def test_any_value_anywhere_in_the_slo_file_is_read_or_named(data) -> None:
    """Whatever value replaces whatever field: an SLO, or a ConfigError with its problems, nothing else."""
    try:
        slo_from_mapping(data)
    except ConfigError as exc:
        assert exc.problems and all(key and reason for key, reason in exc.problems)
