"""The CPU tier in the twin costs PCIe bandwidth: replay reports what it moved, what it bought
(recompute avoided per byte moved) and how long steps waited for shared uplinks; compare reports
the ratio and the extra work admitted against the same candidate without the tier."""

import dataclasses

import pytest

from kvwatch.model import DEFAULT_BANDS
from kvwatch.plan.candidate import Candidate, CandidateError, candidate_from_mapping
from kvwatch.plan.compare import Evaluated, tier_report
from kvwatch.plan.inputs import Workload
from kvwatch.plan.render import tier_lines
from kvwatch.plan.replay import replay
from kvwatch.sim.workload import Patience, WorkloadSpec, generate

BASE = Candidate(name="small-cache", model="llama-3.1-8b", dp=8, num_gpu_blocks=4000, max_model_len=40000)


@pytest.fixture(scope="module")
def workload() -> Workload:
    spec = WorkloadSpec.profile("reasoning", rate=4.0, patience=Patience(first_token_s=None), seed=5)
    return Workload("test", ("reasoning",), tuple(generate(spec, count=300)), {}, None)


def test_the_tier_reports_recompute_avoided_per_byte_and_its_pcie_cost(workload):
    without = replay(workload, BASE, bands=DEFAULT_BANDS).node
    tier = replay(workload, dataclasses.replace(BASE, cpu_offload_gb=100.0), bands=DEFAULT_BANDS).node
    assert without.offload_bytes == 0 and without.recompute_avoided_per_byte is None
    assert without.recomputed_tokens > 0 and tier.recomputed_tokens < without.recomputed_tokens
    assert tier.offload_tokens_loaded > 0 and tier.offload_bytes > 0
    assert tier.recompute_avoided_per_byte == tier.offload_tokens_loaded / tier.offload_bytes
    # every loaded token was stored once and loaded once: about 1 / (2 x KV bytes per token) at best
    kv_bytes_per_token = 32 * 8 * 128 * 2 * 2  # Llama-3.1-8B bf16
    assert tier.recompute_avoided_per_byte <= 1 / (2 * kv_bytes_per_token) * 1.01
    assert tier.offload_transfer_seconds == pytest.approx(tier.offload_bytes / 55e9, rel=0.01)
    [line] = tier_lines(tier)
    assert f"{tier.offload_tokens_loaded:,} tokens loaded back" in line and "tokens per MB moved" in line


def test_gpus_behind_one_switch_wait_for_each_other(workload):
    tier = dataclasses.replace(BASE, cpu_offload_gb=100.0)
    own = replay(workload, tier, bands=DEFAULT_BANDS).node
    shared = replay(workload, dataclasses.replace(tier, gpus_per_pcie_switch=8), bands=DEFAULT_BANDS).node
    assert own.offload_queue_seconds < 1e-9  # each GPU its own uplink: no wait beyond its transfer
    assert shared.offload_queue_seconds > 0.0
    assert shared.offload_bytes == pytest.approx(own.offload_bytes, rel=0.2)


def test_gpus_per_pcie_switch_is_a_candidate_key_and_must_be_positive():
    c = candidate_from_mapping({"gpus_per_pcie_switch": 2, "cpu_offload_gb": 50})
    assert c.gpus_per_pcie_switch == 2 and "2 GPUs per PCIe switch" in c.label()
    with pytest.raises(CandidateError, match="gpus_per_pcie_switch"):
        candidate_from_mapping({"gpus_per_pcie_switch": 0})


def test_compare_reports_the_ratio_and_the_extra_work_against_the_same_candidate_without_the_tier():
    base = Evaluated(BASE, None, (), 448.4, 660)
    tier = Evaluated(
        dataclasses.replace(BASE, name="small-cache-offload200", cpu_offload_gb=200.0),
        None,
        (),
        555.5,
        236,
        offload_bytes=156e9,
        recompute_avoided_per_byte=3.8e-6,
        offload_queue_seconds=0.4,
    )
    [line] = tier_report([base, tier])
    assert "156.0 GB over PCIe" in line and "3.80 tokens loaded back per MB moved" in line
    assert "extra work admitted: +107.1 completed/GPU-h" in line and "preemptions 660 -> 236" in line
    assert "(without the tier: small-cache)" in line
    assert tier_report([base]) == []
    unused = dataclasses.replace(tier, offload_bytes=0.0, recompute_avoided_per_byte=None)
    assert tier_report([base, unused]) == [
        "- small-cache-offload200: never used (nothing was preempted, so nothing was kept)"
    ]


def test_cpu_offload_gb_is_gib_as_vllms_kv_offloading_size_is():
    # it was multiplied by 1e9: the twin's tier was 7% smaller than the flag it mirrors
    from kvwatch.plan.candidate import engine_config

    config = engine_config(Candidate(model="llama-3.1-8b", dp=1, cpu_offload_gb=200.0))
    assert config.kv_offload_bytes == 200 * 2**30
