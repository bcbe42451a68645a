"""The exposition parser: every quirk of real engine pages, and line-numbered errors."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwatch.engines.exposition_parser import ExpositionError, parse_text

from .helpers import SGLANG_DYNAMO, VLLM_DYNAMO_LMCACHE, page


def test_created_samples_and_families_are_dropped():
    expo = parse_text(page("vllm_0_32_cpu_idle.prom"))
    assert not [n for n in expo.names() if n.endswith("_created")]
    assert not [f.name for f in expo if f.name.endswith("_created")]
    assert expo.series("vllm:num_preemptions_total") == [({"engine": "0", "model_name": "tiny"}, 0.0)]


def test_counter_names_are_kept_as_exposed_without_total_suffix():
    expo = parse_text(
        "# TYPE kvbm_offload_blocks_d2h counter\nkvbm_offload_blocks_d2h 5\n"
        "# TYPE llamacpp:n_tokens_max counter\nllamacpp:n_tokens_max 61\n"
    )
    assert expo.series("kvbm_offload_blocks_d2h") == [({}, 5.0)]
    assert expo.series("llamacpp:n_tokens_max") == [({}, 61.0)]
    assert not expo.has("kvbm_offload_blocks_d2h_total")
    assert expo.type_of("llamacpp:n_tokens_max") == "counter"


def test_multiprocess_histogram_with_sum_before_buckets_groups_into_one_family():
    expo = parse_text(page("vllm_0_32_multiprocess_api_servers.prom"))
    fam = expo.families["vllm:time_to_first_token_seconds"]
    assert fam.type == "histogram"
    assert [name for name, _, _ in fam.samples][:2] == [
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count",
    ]
    assert len(expo.series("vllm:time_to_first_token_seconds_bucket")) == 3


def test_help_and_type_without_samples_is_an_empty_family():
    expo = parse_text(page("vllm_0_32_multiprocess_api_servers.prom"))
    assert expo.families["vllm:engine_sleep_state"].samples == []
    assert expo.type_of("vllm:e2e_request_latency_seconds") == "histogram"
    assert not expo.has("vllm:e2e_request_latency_seconds_bucket")


def test_pid_label_from_multiprocess_gauges_is_kept():
    expo = parse_text(page(SGLANG_DYNAMO))
    ((labels, _),) = expo.series("sglang:num_retracted_reqs")
    assert labels["pid"] == "697544"


def test_timestamps_crlf_and_non_finite_values_dropped_and_counted():
    """NaN and ±Inf parse (they are valid text) but no engine quantity can be one: dropped, counted."""
    expo = parse_text('a NaN\r\nb{x="1"} +Inf 1700000000000\r\nc -Inf\nd 1e3\ne{x="1"} 2 -5\n')
    assert expo.series("a") == expo.series("b") == expo.series("c") == []
    assert expo.dropped["not_finite"] == 3
    assert expo.series("d")[0][1] == 1000.0
    assert expo.series("e") == [({"x": "1"}, 2.0)]


def test_escaped_label_values_and_braces_inside_quotes():
    expo = parse_text('m{a="x\\"y",b="line\\nbreak",c="back\\\\slash",d="}{ ,="} 1\n')
    # an escaped newline is a control character in a label value: written as a visible escape
    assert expo.series("m")[0][0] == {"a": 'x"y', "b": "line\\x0abreak", "c": "back\\slash", "d": "}{ ,="}


def test_rust_le_strings_and_label_order():
    expo = parse_text('h_bucket{model="m",le="1"} 2\nh_bucket{le="+Inf",model="m"} 3\n')
    assert [lab["le"] for lab, _ in expo.series("h_bucket")] == ["1", "+Inf"]


def test_openmetrics_eof_and_trailing_comma_are_accepted():
    expo = parse_text('m{a="1",} 1\n# EOF')
    assert expo.series("m") == [({"a": "1"}, 1.0)]


def test_empty_body_parses_to_nothing():
    assert len(parse_text("")) == 0


def test_real_vllm_dynamo_capture_parses_every_family():
    expo = parse_text(page(VLLM_DYNAMO_LMCACHE))
    assert expo.type_of("vllm:cache_config_info") == "gauge"
    assert expo.families["lmcache:chunk_statistics_file_count"].samples == []
    assert len(expo.series("vllm:time_to_first_token_seconds_bucket")) > 10


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ('ok 1\nbad{a="1" 2\n', 2, "malformed label set"),
        ('ok 1\nbad{a="1"} 2 3 4\n', 2, "not a sample line"),
        ("ok 1\nbad 2 1.5\n", 2, "not a sample line"),
        ("x 1_000\n", 1, "is not a number"),
        ('x{a="1",,} 1\n', 1, "malformed label set"),
        ("ok 1\nx notanumber\n", 2, "is not a number"),
        ("x{a=unquoted} 1\n", 1, "malformed label set"),
        ("# TYPE x flobber\nx 1\n", 1, "unknown metric type 'flobber'"),
        ("# TYPE 9bad gauge\n", 1, "invalid metric name"),
        ("# HELP\n", 1, "HELP without a metric name"),
        ("<!DOCTYPE html>\n<html></html>\n", 1, "not a sample line"),
    ],
)
def test_malformed_text_names_the_line_and_what_is_wrong(text, line, fragment):
    with pytest.raises(ExpositionError) as err:
        parse_text(text)
    assert err.value.line == line
    assert fragment in str(err.value)
    assert str(err.value).startswith(f"line {line}: ")


def test_body_cut_in_the_middle_of_a_sample_line_is_an_error_not_a_shorter_value():
    full = page("vllm_0_32_cpu_preempting.prom")
    cut = full[: full.index('vllm:num_preemptions_total{engine="0",model_name="tiny"} 8.0') + 58]
    assert cut.endswith(" 8")  # "8.0" cut to "8": parseable, and wrong if served
    with pytest.raises(ExpositionError, match="truncated"):
        parse_text(cut)


def test_body_cut_at_a_line_boundary_parses_what_arrived():
    """Text alone cannot tell; the HTTP layer (Content-Length, chunk terminator) catches that case."""
    full = page("vllm_0_12_old_names_gone.prom")
    head = full[: full.index("# TYPE vllm:prefix_cache_queries_total")]
    assert parse_text(head).has("vllm:kv_cache_usage_perc")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('ab_:{}=",# \n\\0123.eE+-NaInf')), max_size=200))
def test_arbitrary_text_either_parses_or_raises_exposition_error(text):
    with contextlib.suppress(ExpositionError):
        parse_text(text)
