"""KV pool in tokens from what each engine reports (vLLM keeps block 0 as a null block no request gets)."""

import pytest

from kvwatch.derive import pool

from .factories import sglang, vllm


def test_vllm_usage_is_relative_to_num_gpu_blocks_minus_the_null_block():
    # vLLM: usage = 1 - free / (num_gpu_blocks - 1); 1001 blocks, 250 free -> usage 0.75, 750 used
    sample = vllm(kv_usage_ratio=1 - 250 / 1000)
    assert pool.usable_blocks(sample) == 1000
    assert pool.used_blocks(sample) == 750
    assert pool.allocated_tokens(sample) == 750 * 16
    assert pool.free_tokens(sample) == 250 * 16


@pytest.mark.parametrize("capacity", [8008.0, 1001 * 16 * 181.0])  # two attention groups; a Mamba hybrid
def test_hybrid_models_count_the_tokens_a_block_serves_not_block_size(capacity):
    """vLLM's kv_cache_size_tokens is what the pool serves; on hybrid models it is not
    num_gpu_blocks x block_size, and free tokens counted by block_size exceeded the capacity."""
    sample = vllm(kv_capacity_tokens=capacity, kv_usage_ratio=0.5)  # 500 of 1000 usable blocks
    per_block = capacity / 1001
    assert pool.allocated_tokens(sample) == pytest.approx(500 * per_block)
    assert pool.free_tokens(sample) == pytest.approx(500 * per_block)
    assert pool.free_tokens(sample) < capacity


def test_vllm_full_pool_has_no_free_tokens():
    assert pool.free_tokens(vllm(kv_usage_ratio=1.0)) == 0.0


def test_used_blocks_round_away_float_noise():
    sample = vllm(kv_usage_ratio=0.1 + 0.2)  # 0.30000000000000004 x 1000
    assert pool.used_blocks(sample) == 300.0


def test_engine_block_count_wins_over_the_usage_ratio():
    assert pool.used_blocks(vllm(kv_used_blocks=12, kv_usage_ratio=0.5)) == 12.0


def test_engines_without_a_null_block_use_every_block():
    sample = vllm(backend="trtllm", kv_used_blocks=100)
    assert pool.usable_blocks(sample) == 1001
    assert pool.free_tokens(sample) == 901 * 16


def test_sglang_counts_token_slots_exactly():
    sample = sglang(kv_used_tokens=40_000.0, kv_evictable_tokens=5_000.0)
    assert pool.allocated_tokens(sample) == 40_000.0
    assert pool.free_tokens(sample) == 60_000.0  # evictable radix-cache slots are free on demand


def test_usage_ratio_and_token_capacity_are_the_last_resort():
    sample = sglang(block_size=None, kv_usage_ratio=0.25)
    assert pool.allocated_tokens(sample) == 25_000.0


@pytest.mark.parametrize(
    "sample",
    [
        vllm(),  # no usage at all
        vllm(num_gpu_blocks=None, kv_usage_ratio=0.5),  # no capacity
        sglang(kv_capacity_tokens=None, kv_used_tokens=5.0),
    ],
)
def test_missing_inputs_give_unknown_free_tokens(sample):
    assert pool.free_tokens(sample) is None
