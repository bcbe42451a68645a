"""Small engine configurations for simulator tests (tiny KV caches make preemption easy to reach)."""

from __future__ import annotations

from dataclasses import replace

from kvwatch.sim.engine import EngineConfig
from kvwatch.sim.models import model_preset

LLAMA_8B = model_preset("llama-3.1-8b")


def small_config(**overrides) -> EngineConfig:
    """Llama-3.1-8B timing on one H200, but a cache of ``num_gpu_blocks_override`` blocks."""
    base = EngineConfig(
        model=LLAMA_8B,
        block_size=4,
        num_gpu_blocks_override=64,
        max_model_len=200,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    return replace(base, **overrides)
