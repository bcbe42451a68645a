"""histogram_quantile follows Prometheus: known values, edge cases, and promtool itself."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from kvwatch.derive.quantiles import histogram_quantile
from tests.local import require_tool

BOUNDS = (0.1, 0.5, 1.0, 5.0)


@pytest.mark.parametrize(
    ("q", "bins", "expected"),
    [
        # cumulative 10, 20, 30, 40, 40 over bounds 0.1, 0.5, 1, 5, +Inf
        (0.5, (10, 10, 10, 10, 0), 0.5),  # rank 20 reaches bucket (0.1, 0.5] exactly at its end
        (0.25, (10, 10, 10, 10, 0), 0.1),  # rank 10: end of the first bucket
        (0.1, (10, 10, 10, 10, 0), 0.04),  # rank 4 in the first bucket, interpolated from 0
        (0.99, (10, 10, 10, 10, 0), 4.84),  # rank 39.6 in (1, 5]: 1 + 4 x 9.6/10
        (0.99, (0, 0, 0, 1, 9), 5.0),  # rank in the +Inf bucket: the highest finite bound
        (1.0, (1, 0, 0, 0, 0), 0.1),
        (0.0, (1, 1, 0, 0, 0), 0.0),
    ],
)
def test_known_values(q: float, bins: tuple[int, ...], expected: float) -> None:
    assert histogram_quantile(q, BOUNDS, bins) == pytest.approx(expected)


def test_undefined_cases_match_promql() -> None:
    assert math.isnan(histogram_quantile(0.5, BOUNDS, (0, 0, 0, 0, 0)))
    assert histogram_quantile(-0.1, BOUNDS, (1, 0, 0, 0, 0)) == -math.inf
    assert histogram_quantile(1.1, BOUNDS, (1, 0, 0, 0, 0)) == math.inf
    assert math.isnan(histogram_quantile(math.nan, BOUNDS, (1, 0, 0, 0, 0)))
    assert math.isnan(histogram_quantile(0.0, BOUNDS, (0, 1, 0, 0, 0)))  # Go's 0/0
    # negative bounds: interpolation inside (-1, 0]; a rank in a first bucket bounded <= 0 is its bound
    assert histogram_quantile(0.5, (-1.0, 0.0, 1.0), (1, 1, 1, 0)) == pytest.approx(-0.5)
    assert histogram_quantile(0.2, (-1.0, 0.0, 1.0), (1, 1, 1, 0)) == -1.0


def test_bins_must_match_bounds() -> None:
    with pytest.raises(ValueError, match="one bin per bound"):
        histogram_quantile(0.5, BOUNDS, (1, 2))


CASES = [
    (0.5, (10, 10, 10, 10, 0)),
    (0.99, (0, 0, 0, 1, 9)),
    (0.0, (1, 1, 0, 0, 0)),
    (0.5, (3, 5, 0, 2, 1)),
    (0.9, (3, 5, 0, 2, 1)),
    (0.99, (0, 7, 1, 0, 0)),
    (0.25, (1, 0, 0, 0, 3)),
    (0.75, (0, 0, 4, 4, 0)),
    (0.01, (5, 5, 5, 5, 5)),
]


@pytest.mark.prometheus
def test_same_results_as_promtool(tmp_path: Path) -> None:
    """Every case is evaluated by promtool's PromQL engine and must equal ours."""
    series, tests = [], []
    for i, (q, bins) in enumerate(CASES):
        running = 0
        for bound, count in zip((*BOUNDS, math.inf), bins, strict=True):
            running += count
            le = "+Inf" if math.isinf(bound) else repr(bound)
            series.append(
                f"      - series: 'h_bucket{{case=\"{i}\",le=\"{le}\"}}'\n        values: '{running}'"
            )
        ours = histogram_quantile(q, BOUNDS, bins)
        tests.append(
            f'      - expr: histogram_quantile({q}, h_bucket{{case="{i}"}})\n'
            f"        eval_time: 0m\n"
            f"        exp_samples:\n"
            f"          - labels: '{{case=\"{i}\"}}'\n"
            f"            value: {ours!r}"
        )
    (tmp_path / "rules.yml").write_text("groups: []\n")
    (tmp_path / "test.yml").write_text(
        "rule_files: [rules.yml]\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n"
        + "\n".join(series)
        + "\n    promql_expr_test:\n"
        + "\n".join(tests)
        + "\n"
    )
    promtool = require_tool("promtool")
    result = subprocess.run(
        [promtool, "test", "rules", "test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
