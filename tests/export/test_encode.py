"""The fast text encoder is byte-identical to prometheus_client.generate_latest on a full node."""

from __future__ import annotations

import subprocess

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from kvwatch.export.encode import HistogramRows, TextEncoder
from tests.local import require_tool

from .frozen import Frozen
from .node import full_node_registry


def test_full_node_exposition_is_byte_identical_to_generate_latest():
    frozen = Frozen(full_node_registry().collect())
    ours = TextEncoder().encode(frozen)
    assert ours == generate_latest(frozen)
    assert ours.count(b"\n") > 3000  # a busy node: the comparison covered thousands of series


def test_second_render_uses_the_caches_and_stays_identical():
    frozen = Frozen(full_node_registry().collect())
    encoder = TextEncoder()
    first = encoder.encode(frozen)
    assert encoder.encode(frozen) == first == generate_latest(frozen)


def test_escaping_of_label_values_and_help_matches():
    gauge = GaugeMetricFamily("x_gauge", "help with \\ and\nnewline", labels=["model_name"])
    gauge.add_metric(['quote " back \\ nl \n'], 1.5)
    gauge.add_metric(["plain"], float("inf"))
    gauge.add_metric(["nan"], float("nan"))
    gauge.add_metric(["big"], 12345678.0)
    counter = CounterMetricFamily("x_events", "events", labels=["a"])
    counter.add_metric(["1"], 3)
    info = InfoMetricFamily("x_build", "build", value={"version": "1"})
    hist = HistogramRows("x_latency_seconds", "latency", ("replica",))
    hist.add_row(("r0",), ("0.1", "1.0", "+Inf"), [1.0, 2.0, 3.0], 1.25)
    hist.add_row(('we"ird',), ("0.1", "1.0", "+Inf"), [0.0, 0.0, 2_000_000.0], 3e6)
    frozen = Frozen([gauge, counter, info, hist])
    assert TextEncoder().encode(frozen) == generate_latest(frozen)


def test_histogram_rows_lint_clean_with_promtool(tmp_path):
    body = TextEncoder().encode(full_node_registry())
    result = subprocess.run(
        [require_tool("promtool"), "check", "metrics"],
        input=body,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
