"""Config: every problem named by key path and reason, all at once; env overrides; check-config CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvwatch.config import ConfigError, config_from_mapping, load_config, parse_duration, parse_size

GOOD = """
listen: 127.0.0.1:9500
length_bands: [128, 512, 2048, 8192]
intervals: {engine: 2s, gpu: 500ms}
replicas:
  - name: vllm-0
    metrics_url: http://127.0.0.1:8000/metrics
    api_url: http://127.0.0.1:8000/
    proxy_listen: 127.0.0.1:8100
    model_name: qwen3
    gpus: [0, 1]
"""


def problems(data) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        config_from_mapping(data)
    return dict(err.value.problems)


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    """``kvwatch check-config PATH`` as a user runs it: a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "kvwatch", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_good_file_loads_with_units_and_defaults(tmp_path):
    path = tmp_path / "kvwatch.yaml"
    path.write_text(GOOD)
    cfg = load_config(path, environ={})
    assert str(cfg.listen) == "127.0.0.1:9500"
    assert cfg.intervals.engine_s == 2.0 and cfg.intervals.gpu_s == 0.5
    assert cfg.length_bands.names == ("0-128", "128-512", "512-2048", "2048-8192", "8192+")
    (replica,) = cfg.replicas
    assert replica.api_url == "http://127.0.0.1:8000" and replica.gpus == ("0", "1")
    assert replica.backend == "auto" and cfg.known_models == {"qwen3"}


def test_every_problem_is_reported_with_its_key_path():
    found = problems(
        {
            "replicas": [
                {"name": "a b", "metrics_url": "localhost:8000"},
                {"metrics_url": "http://x/metrics", "backend": "vllmm", "proxy_listen": ":8100"},
            ],
            "intervals": {"engine": "fast"},
            "length_bands": [5000, 1000],
            "scrape": {"max_response_bytes": "lots"},
            "bogus": 1,
        }
    )
    assert "expected a short name" in found["replicas[0].name"]
    assert "http(s) URL" in found["replicas[0].metrics_url"]
    assert found["replicas[1].name"] == "required"
    assert "unknown backend 'vllmm'" in found["replicas[1].backend"]
    assert "needs api_url" in found["replicas[1].proxy_listen"]
    assert "duration" in found["intervals.engine"]
    assert "ascending" in found["length_bands"]
    assert "size" in found["scrape.max_response_bytes"]
    assert "unknown key" in found["bogus"]


def test_a_backend_is_valid_only_if_an_adapter_reads_it():
    # "sim" once passed validation and then failed every scrape as malformed: the demo's engines
    # speak vLLM's page, so they are backend vllm
    found = problems({"replicas": [{"name": "r", "metrics_url": "http://a/metrics", "backend": "sim"}]})
    assert "unknown backend 'sim'" in found["replicas[0].backend"]


def test_duplicate_names_and_proxy_ports_are_refused():
    rep = {"name": "r", "metrics_url": "http://a/metrics", "api_url": "http://a", "proxy_listen": ":9000"}
    found = problems({"replicas": [rep, dict(rep)]})
    assert "duplicate replica name" in found["replicas[1].name"]
    assert (
        found["replicas[1].proxy_listen"] == "port 9000 is already replicas[0].proxy_listen's (0.0.0.0:9000)"
    )


def test_every_listener_needs_its_own_port():
    rep = {"name": "r", "metrics_url": "http://a/metrics", "api_url": "http://a", "proxy_listen": ":9477"}
    found = problems({"listen": "0.0.0.0:9477", "replicas": [rep], "otlp": {"listen": "127.0.0.1:9477"}})
    assert found["otlp.listen"] == "port 9477 is already listen's (0.0.0.0:9477)"
    assert found["replicas[0].proxy_listen"] == "port 9477 is already listen's (0.0.0.0:9477)"


def test_one_port_on_two_distinct_addresses_or_port_0_twice_is_fine():
    reps = [
        {"name": f"r{i}", "metrics_url": "http://a/metrics", "api_url": "http://a", "proxy_listen": listen}
        for i, listen in enumerate(("127.0.0.1:8100", "10.0.0.5:8100", "127.0.0.1:0", "127.0.0.1:0"))
    ]
    config_from_mapping({"listen": "127.0.0.1:0", "replicas": reps})


def test_references_to_unknown_replicas_are_refused():
    found = problems(
        {
            "replicas": [{"name": "r", "metrics_url": "http://a/metrics"}],
            "otlp": {"listen": ":4318", "replica": "nope"},
            "sglang_request_files": [{"replica": "ghost", "directory": "/tmp"}],
        }
    )
    assert "no replica named 'nope'" in found["otlp.replica"]
    assert "no replica named 'ghost'" in found["sglang_request_files[0].replica"]


def test_otlp_size_limits_are_validated():
    replicas = [{"name": "r", "metrics_url": "http://a/metrics"}]
    found = problems(
        {"replicas": replicas, "otlp": {"max_body_bytes": "16MiB", "max_decompressed_bytes": "1MiB"}}
    )
    assert "must be at least otlp.max_body_bytes" in found["otlp.max_decompressed_bytes"]
    found = problems({"replicas": replicas, "otlp": {"max_decompressed_bytes": "lots"}})
    assert "expected a size" in found["otlp.max_decompressed_bytes"]
    assert config_from_mapping({"replicas": replicas}).otlp.max_decompressed_bytes == 64 * 1024 * 1024


def test_environment_overrides_nested_keys(tmp_path):
    path = tmp_path / "kvwatch.yaml"
    path.write_text(GOOD)
    cfg = load_config(
        path,
        environ={
            "KVWATCH_LISTEN": ":9999",
            "KVWATCH_INTERVALS__ENGINE": "7s",
            "KVWATCH_NVML__ENABLED": "false",
            "UNRELATED": "x",
        },
    )
    assert cfg.listen.port == 9999 and cfg.listen.host == "0.0.0.0"
    assert cfg.intervals.engine_s == 7.0 and cfg.nvml.enabled is False


def test_a_bad_environment_override_names_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(None, environ={"KVWATCH_INTERVALS__ENGINE": "soon"})
    assert dict(err.value.problems).keys() == {"KVWATCH_INTERVALS__ENGINE (intervals.engine)"}


def test_yaml_syntax_errors_name_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("replicas:\n  - name: [unclosed\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    ((where, reason),) = err.value.problems
    assert where.startswith("line ") and "YAML" in reason


def test_a_key_written_twice_is_refused_not_the_first_dropped(tmp_path):
    # PyYAML keeps the last: a second `replicas:` further down dropped every replica of the first
    path = tmp_path / "twice.yaml"
    path.write_text(
        'replicas: [{name: a, metrics_url: "http://h:1/metrics"}]\nscrape: {timeout: 1s}\n'
        'replicas: [{name: b, metrics_url: "http://h:2/metrics"}]\n'
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    ((where, reason),) = err.value.problems
    assert where == "line 3, column 1" and "duplicate key 'replicas' (first at line 1)" in reason
    merged = tmp_path / "merged.yaml"  # a merge's keys may be overridden: that is what `<<` is for
    merged.write_text('x: &r {name: a, metrics_url: "http://h:1/metrics"}\nreplicas: [{<<: *r, name: b}]\n')
    with pytest.raises(ConfigError, match="x: unknown key"):
        load_config(merged, environ={})  # read (the top-level x is not a setting), not refused as YAML


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"node: \xff\n", "not UTF-8 text (byte 6 is 0xff)"),
        (b"[]\n", "expected a mapping"),
        (b"0\n", "expected a mapping"),
    ],
)
def test_a_file_that_is_no_utf8_mapping_is_refused_by_name(tmp_path, content, problem):
    # a non-UTF-8 byte raised UnicodeDecodeError; `[]`, `false` or `0` loaded as an empty config
    path = tmp_path / "odd.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert problem in str(err.value)


@pytest.mark.parametrize("listen", ["http://127.0.0.1:9477", "foo bar:9477", "a/b:1"])
def test_a_listen_address_whose_host_is_no_host_is_named(listen):
    # they passed check-config, then kvwatch run failed to bind with no key named
    with pytest.raises(ConfigError, match=r"listen: expected HOST:PORT with a host name or IP address"):
        config_from_mapping({"listen": listen})


def test_a_name_with_a_trailing_newline_is_no_short_name():
    # `$` matched before a final newline: a block scalar `name: |` gave replica "a\n", unlike "a"
    with pytest.raises(ConfigError, match=r"replicas\[0\].name: expected a short name"):
        config_from_mapping({"replicas": [{"name": "a\n", "metrics_url": "http://h:1/metrics"}]})


def test_a_section_that_is_no_mapping_is_named_even_when_a_variable_sets_a_key_under_it(tmp_path):
    # the environment override replaced the file's bad section with {}, and check-config said OK
    path = tmp_path / "bad-section.yaml"
    path.write_text("intervals: [engine, 5s]\n")
    with pytest.raises(ConfigError, match="intervals"):
        load_config(path, environ={"KVWATCH_INTERVALS__GPU": "2s"})


@pytest.mark.parametrize("value", [1.0e300, "100000000h"])
def test_a_duration_past_a_year_is_refused_before_the_scheduler_overflows(value):
    # intervals.engine: 1.0e+300 passed check-config, then run died in APScheduler's datetime maths
    with pytest.raises(ConfigError, match=r"intervals.engine: duration must be at most a year"):
        config_from_mapping({"intervals": {"engine": value}})


@pytest.mark.parametrize(("text", "seconds"), [("500ms", 0.5), ("5s", 5.0), ("2m", 120.0), (3, 3.0)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(("text", "size"), [("16MiB", 16 << 20), ("1KB", 1000), (4096, 4096)])
def test_sizes(text, size):
    assert parse_size(text) == size


HUGE = 10**400  # YAML reads it as an int; float() and math.isfinite() of it raise OverflowError


@pytest.mark.parametrize(
    ("data", "key", "fragment"),
    [
        ({"scrape": {"timeout": HUGE}}, "scrape.timeout", "positive and finite"),
        ({"scrape": {"max_response_bytes": HUGE}}, "scrape.max_response_bytes", "size"),
        ({"scrape": {"max_response_bytes": f"{HUGE}MiB"}}, "scrape.max_response_bytes", "size"),
        (
            {"replicas": [{"name": "r", "metrics_url": "http://x/metrics", "kv_bytes_per_token": HUGE}]},
            "replicas[0].kv_bytes_per_token",
            "positive number",
        ),
        ({"alerts": {"thresholds": {"storm_preemptions_per_finished": HUGE}}}, None, None),
    ],
    ids=["duration", "size", "size-string", "positive-number", "threshold"],
)
def test_a_number_too_large_for_a_float_is_a_problem_named_by_its_key(data, key, fragment):
    """Before, each of these ended `kvwatch check-config` and `kvwatch run` with an OverflowError."""
    if key is None:  # the alerts section is read by `kvwatch rules`, not the agent's config
        from kvwatch.mixin.thresholds import alert_config_from_mapping

        found: list[tuple[str, str]] = []
        alert_config_from_mapping(data["alerts"], "alerts", found)
        [(key, reason)] = found
        assert key == "alerts.thresholds.storm_preemptions_per_finished" and "non-negative number" in reason
        return
    assert fragment in problems(data)[key]


def test_check_config_cli_exit_status_and_messages(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD)
    bad.write_text("replicas:\n  - name: r\n    metrics_url: nope\n")
    ok = _check_config(good)
    assert ok.returncode == 0 and "OK (1 replica(s): vllm-0" in ok.stdout
    fail = _check_config(bad)
    assert fail.returncode == 1
    assert "replicas[0].metrics_url: expected an http(s) URL, got 'nope'" in fail.stderr


def test_proxy_limits_have_defaults_and_bad_values_name_their_key():
    proxy = config_from_mapping({}).proxy
    assert (proxy.max_buffered_bytes, proxy.max_connections, proxy.inject_usage) == (64 << 20, 1024, True)
    parsed = config_from_mapping(
        {"proxy": {"max_buffered_bytes": "128MiB", "max_connections": 10, "inject_usage": False}}
    ).proxy
    assert (parsed.max_buffered_bytes, parsed.max_connections, parsed.inject_usage) == (128 << 20, 10, False)
    with pytest.raises(ConfigError) as err:
        config_from_mapping(
            {
                "proxy": {
                    "max_connections": 0,
                    "inject_usage": "maybe",
                    "max_body_bytes": "16MiB",
                    "max_buffered_bytes": "8MiB",
                }
            }
        )
    text = str(err.value)
    for key in ("proxy.max_connections", "proxy.inject_usage", "proxy.max_buffered_bytes"):
        assert key in text


def test_env_empty_listen_is_unset_not_all_interfaces(tmp_path):
    from kvwatch.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("listen: 127.0.0.1:9477\n")
    assert load_config(path, {"KVWATCH_LISTEN": ""}).listen.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("KVWATCH_LOG_LEVEL", "{a: [", "not a valid YAML value"),
        ("KVWATCH_REPLICAS__0__NAME", "x", "cannot be set from the environment"),
    ],
)
def test_env_errors_name_the_variable(name, value, fragment):
    from kvwatch.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, {name: value})
    assert f"{name}: " in str(err.value) and fragment in str(err.value)


BILLION_LAUGHS = (
    "a: &a [x,x,x,x,x,x,x,x,x]\n"
    + "".join(
        f"{n}: &{n} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
        for p, n in zip("abcdefgh", "bcdefghi", strict=True)
    )
    + "listen: *i\n"
)


def test_a_yaml_alias_bomb_fails_fast_with_a_short_message(tmp_path):
    import time

    assert len(BILLION_LAUGHS) < 400
    path = tmp_path / "bomb.yaml"
    path.write_text(BILLION_LAUGHS)
    started = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert time.perf_counter() - started < 0.5
    assert str(err.value).endswith("not valid YAML: aliases expand to more than 100000 values")
    assert len(str(err.value)) < 400
    with pytest.raises(ConfigError) as env_err:  # the same bound holds for an environment value
        load_config(None, {"KVWATCH_NODE": BILLION_LAUGHS})
    assert "KVWATCH_NODE" in str(env_err.value) and len(str(env_err.value)) < 400


def test_anchors_within_the_bound_still_load_and_recursion_is_refused(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("x-bands: &bands [128, 512]\nlength_bands: *bands\n")
    with pytest.raises(ConfigError) as err:  # x-bands is not a key, but the alias itself loaded
        load_config(path, environ={})
    assert set(dict(err.value.problems)) == {"x-bands"}
    path.write_text("listen: &r [1, *r]\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert "recursive alias" in str(err.value)


def test_errors_quote_long_values_cut_short():
    huge = "h" * 1_000_000
    found = problems({"listen": huge, "intervals": {"engine": [huge] * 50}, huge: 1})
    assert all(len(path) < 200 and len(reason) < 400 for path, reason in found.items())
    assert "…" in found["listen"] and "…" in found["intervals.engine"]


def test_check_config_reports_every_bad_key_of_every_replica_at_once(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "replicas:\n"
        "  - {metrics_url: nope, slots_url: nope, pid: -1, scrape_timeout: soon, gpus: 3}\n"
        "  - {name: 'a b', kv_bytes_per_token: 0, model_name: m, pid_file: /p, bogus: 1}\n"
    )
    fail = _check_config(bad)
    assert fail.returncode == 1
    for key in (
        "replicas[0].name",
        "replicas[0].metrics_url",
        "replicas[0].slots_url",
        "replicas[0].pid",
        "replicas[0].scrape_timeout",
        "replicas[0].gpus",
        "replicas[1].name",
        "replicas[1].metrics_url",
        "replicas[1].kv_bytes_per_token",
        "replicas[1].bogus",
    ):
        assert f"  {key}: " in fail.stderr, key
    assert "10 problem(s)" in fail.stderr


@pytest.mark.parametrize("edge", [1000.9, float("inf"), True, "1e3", None])
def test_a_band_edge_is_a_whole_token_count(edge) -> None:
    # int() cut 1000.9 to 1000 and read true as 1, silently; .inf raised OverflowError out of check-config
    assert "whole token counts" in problems({"length_bands": [edge, 5000]})["length_bands"]


def test_band_edges_written_as_floats_or_strings_read_whole() -> None:
    assert config_from_mapping({"length_bands": [1000.0, "5000"]}).length_bands.edges == (1000, 5000)
