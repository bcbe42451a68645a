"""ReplicaCollector: golden exposition of a node with several engines, checked by real promtool."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvwatch.catalog import BY_NAME
from kvwatch.config import Config, ReplicaConfig
from kvwatch.derive.pool import free_tokens
from kvwatch.engines.llamacpp import apply_slots, parse_slots
from kvwatch.export.replicas import ReplicaCollector
from kvwatch.model import LengthBands
from kvwatch.state import NodeState
from tests.local import require_tool

from .helpers import LLAMACPP_TINY, only, page, samples

GOLDEN = Path(__file__).parent / "golden" / "replica_collector.prom"


def node() -> NodeState:
    state = NodeState("node-a", LengthBands())
    for name, backend, found in (
        ("r0", "vllm", samples("vllm_0_33_two_dp_ranks_offload.prom")),
        ("r1", "sglang", samples("sglang_0_5_20_two_dp_ranks_hicache.prom")),
        (
            "r2",
            "llamacpp",
            tuple(
                apply_slots(s, parse_slots(page("llamacpp_slots_2026_two_slots.json")))
                for s in samples(LLAMACPP_TINY)
            ),
        ),
    ):
        target = state.target(name)
        target.backend, target.up, target.scrape_duration_s = backend, True, 0.012
        target.samples = tuple(dataclasses.replace(s, replica=name) for s in found)
    down = state.target("r3")
    down.errors = Counter({"timeout": 2, "connect": 1})
    down.restarts = 1
    down.scrape_duration_s = 3.0
    down.samples = samples("vllm_0_12_old_names_gone.prom")  # left by a bug: must still not be served
    return state


def render(state: NodeState, config: Config | None = None) -> str:
    registry = CollectorRegistry()
    registry.register(ReplicaCollector(state, config or Config()))
    return generate_latest(registry).decode()


def test_output_matches_golden_file():
    text = render(node())
    if os.environ.get("KVWATCH_UPDATE_GOLDEN"):
        GOLDEN.write_text(text, encoding="utf-8")
    assert text == GOLDEN.read_text(encoding="utf-8")


@pytest.mark.prometheus
def test_promtool_check_metrics_passes():
    promtool = require_tool("promtool")
    proc = subprocess.run(
        [promtool, "check", "metrics"],
        input=render(node()),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_only_catalog_families_in_area_replica_or_target_health():
    allowed = {s.name for s in BY_NAME.values() if s.area == "replica"} | {
        "kvwatch_target_up",
        "kvwatch_target_scrape_duration_seconds",
        "kvwatch_target_scrape_errors",
        "kvwatch_target_restarts",
        "kvwatch_target_samples_rejected",
    }
    registry = CollectorRegistry()
    registry.register(ReplicaCollector(node(), Config()))
    assert {m.name for m in registry.collect()} <= allowed


def test_a_down_target_serves_no_replica_series():
    text = render(node())
    assert 'replica="r3"' in text  # health families
    replica_lines = [line for line in text.splitlines() if 'replica="r3"' in line]
    assert {line.split("{")[0] for line in replica_lines} == {
        "kvwatch_target_up",
        "kvwatch_target_scrape_duration_seconds",
        "kvwatch_target_scrape_errors_total",
        "kvwatch_target_restarts_total",
        "kvwatch_target_samples_rejected_total",
    }


def test_every_error_reason_is_exported_from_zero():
    text = render(node())
    assert 'kvwatch_target_scrape_errors_total{reason="too_large",replica="r0"} 0.0' in text
    assert 'kvwatch_target_scrape_errors_total{reason="timeout",replica="r3"} 2.0' in text


def test_dp_rank_is_empty_for_engines_without_ranks_and_none_fields_make_no_series():
    text = render(node())
    assert 'kvwatch_requests_running{backend="llamacpp",dp_rank="",model_name="",replica="r2"} 0.0' in text
    assert 'kvwatch_preemptions_total{backend="llamacpp"' not in text  # llama.cpp has no preemption count


def test_target_backend_before_the_first_good_scrape_comes_from_config():
    state = NodeState("n", LengthBands())
    state.target("r9")
    config = Config(replicas=(ReplicaConfig("r9", "http://h/metrics", backend="sglang"),))
    assert 'kvwatch_target_up{backend="sglang",replica="r9"} 0.0' in render(state, config)
    assert 'kvwatch_target_up{backend="unknown",replica="r9"} 0.0' in render(state)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # token-exact used, of whole pages: 7812 pages x 64 tokens (the 32 tokens past the last page of
        # max_total_num_tokens = 500000 can never be allocated)
        ("sglang_0_5_20_two_dp_ranks_hicache.prom", 7812 * 64 - 485000.0),
        ("trtllm_2026_kv_blocks.prom", 128000.0 - 3000 * 32),  # used blocks x block size
        ("tgi_3_3_router.prom", None),  # capacity without any usage figure
    ],
)
def test_free_tokens(name, expected):
    assert free_tokens(samples(name)[0]) == expected


def test_free_tokens_from_usage_ratio_only():
    s = only("llamacpp_2024_kv_cache_usage_ratio.prom")
    assert free_tokens(s) is None  # no capacity on /metrics alone


def _one_target(name: str, page_name: str) -> NodeState:
    state = NodeState("n", LengthBands())
    target = state.target(name)
    target.backend, target.up = "auto", True
    target.samples = tuple(dataclasses.replace(s, replica=name) for s in samples(page_name))
    return state


def test_capacity_bytes_from_the_engine_match_its_byte_budget():
    """Real vLLM 0.32 (--kv-cache-memory-bytes 20971520): 2560 tokens x 8192 bytes is the budget."""
    text = render(_one_target("r0", "vllm_0_32_cpu_idle.prom"))
    assert (
        'kvwatch_kv_capacity_bytes{backend="vllm",dp_rank="0",model_name="tiny",replica="r0"} 2.097152e+07'
    ) in text


def test_configured_kv_bytes_per_token_wins_and_fills_in_what_the_engine_does_not_say():
    config = Config(replicas=(ReplicaConfig("r0", "http://h/metrics", kv_bytes_per_token=4096.0),))
    engine_says = render(_one_target("r0", "vllm_0_32_cpu_idle.prom"), config)
    assert (
        'kvwatch_kv_capacity_bytes{backend="vllm",dp_rank="0",model_name="tiny",replica="r0"} '
        "1.048576e+07" in engine_says
    )  # 2560 x 4096, not 2560 x 8192
    silent = render(_one_target("r0", "vllm_0_12_old_names_gone.prom"), config)
    assert (
        'kvwatch_kv_capacity_bytes{backend="vllm",dp_rank="0",model_name="qwen3-32b",replica="r0"} '
        "5.24288e+08" in silent
    )  # 8000 blocks x 16 tokens x 4096 bytes
    assert "kvwatch_kv_capacity_bytes{" not in render(_one_target("r0", "vllm_0_12_old_names_gone.prom"))
