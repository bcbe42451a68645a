"""``vllm_plugin_sockets``: one socket per replica, each problem named by its key path."""

import pytest

from kvwatch.config import ConfigError, VllmPluginSocketConfig, config_from_mapping

REPLICAS = [
    {"name": "r0", "metrics_url": "http://127.0.0.1:8000/metrics"},
    {"name": "r1", "metrics_url": "http://127.0.0.1:8001/metrics"},
]


def test_sockets_map_to_replicas():
    cfg = config_from_mapping(
        {
            "replicas": REPLICAS,
            "vllm_plugin_sockets": [
                {"replica": "r0", "path": "/run/kvwatch/r0.sock"},
                {"replica": "r1", "path": "/run/kvwatch/r1.sock"},
            ],
        }
    )
    assert cfg.vllm_plugin_sockets == (
        VllmPluginSocketConfig("r0", "/run/kvwatch/r0.sock"),
        VllmPluginSocketConfig("r1", "/run/kvwatch/r1.sock"),
    )


def test_every_problem_is_named():
    with pytest.raises(ConfigError) as err:
        config_from_mapping(
            {
                "replicas": REPLICAS,
                "vllm_plugin_sockets": [
                    {"replica": "r0", "path": "relative.sock"},
                    {"replica": "nope", "path": "/run/a.sock"},
                    {"replica": "r1", "path": "/run/a.sock"},
                    {"replica": "r1", "path": "/run/" + "x" * 120},
                    {"path": "/run/b.sock", "extra": 1},
                ],
            }
        )
    found = dict(err.value.problems)
    assert "absolute path" in found["vllm_plugin_sockets[0].path"]
    assert "no replica named 'nope'" in found["vllm_plugin_sockets[1].replica"]
    assert "already another replica's socket" in found["vllm_plugin_sockets[2].path"]
    assert "107 bytes" in found["vllm_plugin_sockets[3].path"]
    assert found["vllm_plugin_sockets[4].replica"] == "required"
    assert "unknown key" in found["vllm_plugin_sockets[4].extra"]
