"""``replicas[].kv_bytes_per_token``: validated, and it wins over what the engine reports."""

from __future__ import annotations

import math

import pytest

from kvwatch.config import ConfigError, config_from_mapping
from kvwatch.model import ReplicaSample


def replica(**extra) -> dict:
    return {"replicas": [{"name": "r0", "metrics_url": "http://127.0.0.1:8000/metrics", **extra}]}


@pytest.mark.parametrize(("value", "expected"), [(65536, 65536.0), (8192.5, 8192.5), (None, None)])
def test_a_positive_number_is_read_as_bytes_per_token_on_one_gpu(value, expected):
    config = config_from_mapping(replica(kv_bytes_per_token=value))
    assert config.replicas[0].kv_bytes_per_token == expected


@pytest.mark.parametrize("value", [0, -1, "64KiB", True, math.nan, math.inf, [65536]])
def test_anything_else_is_named_by_key_path(value):
    with pytest.raises(ConfigError) as err:
        config_from_mapping(replica(kv_bytes_per_token=value))
    assert dict(err.value.problems)["replicas[0].kv_bytes_per_token"].startswith("expected a positive number")


def sample(name: str, measured: float | None) -> ReplicaSample:
    return ReplicaSample(replica=name, backend="vllm", scraped_at=0.0, kv_bytes_per_token=measured)


def test_the_configured_value_wins_else_the_engines():
    config = config_from_mapping(
        {
            "replicas": [
                {"name": "set", "metrics_url": "http://h:1/metrics", "kv_bytes_per_token": 4096},
                {"name": "unset", "metrics_url": "http://h:2/metrics"},
            ]
        }
    )
    assert config.kv_bytes_per_token(sample("set", 8192.0)) == 4096.0
    assert config.kv_bytes_per_token(sample("set", None)) == 4096.0
    assert config.kv_bytes_per_token(sample("unset", 8192.0)) == 8192.0
    assert config.kv_bytes_per_token(sample("unset", None)) is None
    assert config.kv_bytes_per_token(sample("not-configured", 8192.0)) == 8192.0
