"""The layout terms of the step time: TP all-reduces, pipeline stages, MoE expert routing."""

from __future__ import annotations

import pytest

from kvwatch.sim.engine import EngineConfig
from kvwatch.sim.memory import plan_replica
from kvwatch.sim.models import NVLINK4, gpu_preset, model_preset


def _layout(model: str, **kw):
    return EngineConfig(model=model_preset(model), **kw).step_model()


def test_tp1_dense_has_no_collective_term():
    s = _layout("llama-3.1-8b")
    assert s.is_trivial and s.comm_fixed == 0 and s.comm_per_token == 0


def test_tp_pays_two_all_reduces_per_layer_with_the_small_message_latency():
    s = _layout("llama-3.1-8b", tp=8)
    # 32 layers x 2 all-reduces, each at least the 8-rank latency (12.5 us from nccl-tests)
    assert s.comm_fixed == pytest.approx(64 * NVLINK4.all_reduce_seconds(0.0, 8))
    assert NVLINK4.all_reduce_seconds(0.0, 8) == pytest.approx(12.5e-6)
    one = s.seconds(0, 1, 1000, 1)
    assert one > s.overhead_s + s.t_dense_weights + 64 * 12e-6


def test_dp_beats_tp_per_gpu_for_a_small_model_at_a_large_batch():
    tp1, tp8 = _layout("llama-3.1-8b"), _layout("llama-3.1-8b", tp=8)
    per_gpu_tp1 = 512 / tp1.seconds(0, 512, 512 * 3000, 512)
    per_gpu_tp8 = 512 / tp8.seconds(0, 512, 512 * 3000, 512) / 8
    assert per_gpu_tp1 > per_gpu_tp8


def test_pipeline_stages_do_not_divide_the_weight_reads_of_a_step():
    tp8, pp8 = _layout("llama-3.1-405b", tp=8), _layout("llama-3.1-405b", pp=8)
    ratio = pp8.seconds(0, 8, 8000, 8) / tp8.seconds(0, 8, 8000, 8)
    assert 5 < ratio < 9
    # the bubble: with one sequence the stages cannot overlap, so compute is not divided either
    big = 8 * 8192
    assert pp8.seconds(big, 0, big, 1) > 4 * pp8.seconds(big, 0, big, 8)


def test_pipeline_splits_weights_and_kv_by_stage():
    m, g = model_preset("llama-3.1-405b"), gpu_preset("h200")
    tp8, pp8 = plan_replica(m, g, 8), plan_replica(m, g, 1, pp=8)
    assert pp8.weight_bytes_per_gpu == pytest.approx(tp8.weight_bytes_per_gpu)
    r1 = model_preset("deepseek-r1")
    # an MLA latent replicates over TP but splits over stages
    assert plan_replica(r1, g, 1, pp=8).capacity_tokens > 7 * plan_replica(r1, g, 8).capacity_tokens


def test_a_small_moe_batch_reads_few_experts():
    s = _layout("deepseek-r1", tp=8)
    assert s.touched_experts(1) == pytest.approx(8)
    assert 200 < s.touched_experts(512) <= 256
    assert s.seconds(0, 1, 1000, 1) < s.seconds(0, 256, 256000, 256) / 3


def test_expert_parallel_pays_imbalance_and_all_to_all():
    tp, ep = _layout("deepseek-r1", tp=8), _layout("deepseek-r1", tp=8, expert_parallel=True)
    assert ep.imbalance == 1.25 and tp.imbalance == 1.0
    assert ep.comm_fixed != tp.comm_fixed


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="expert_parallel needs a MoE model"):
        EngineConfig(model=model_preset("llama-3.1-8b"), tp=2, expert_parallel=True).validate()
    with pytest.raises(ValueError, match="expert_imbalance"):
        EngineConfig(model=model_preset("deepseek-r1"), tp=8, expert_imbalance=0.5).validate()
