"""How much KV cache one replica gets: weights, runtime reserve and KV pool per GPU.

The capacity formula (the one the simulator and its tests use)::

    kv_pool_per_gpu   = gpu_memory x gpu_memory_utilization - runtime_reserve - weight_bytes / tp
    kv_bytes_per_gpu  = per-token KV bytes one GPU stores
                        GQA/MHA: 2 x layers x max(1, kv_heads / tp) x head_dim x dtype_bytes
                        MLA:     layers x (kv_lora_rank + qk_rope_head_dim) x dtype_bytes (every rank)
    capacity_tokens   = floor(kv_pool_per_gpu / kv_bytes_per_gpu)

Equivalently ``(gpu_memory x util x tp - tp x reserve - weights) / kv_bytes_per_token_per_replica``
with ``kv_bytes_per_token_per_replica = tp x kv_bytes_per_gpu``: TP divides the weights and (GQA
only) the KV heads; an MLA latent has no head axis, so every rank holds the whole cache and capacity
does not grow with TP.

Pipeline parallelism (``pp`` stages of ``tp`` GPUs each) splits the layers: each GPU holds
``weight_bytes / (tp x pp)`` and the KV of ``layers / pp`` layers, so both the weights per GPU and
the KV bytes per token per GPU shrink by ``pp`` (MLA included: its latent is per layer).

``runtime_reserve`` stands for what vLLM's profiling run subtracts besides weights: peak activations,
CUDA graphs, NCCL buffers. It is an assumption (6 GB by default), chosen so the reference's two
capacity estimates come out within 10 %: Llama-3.1-8B on one H200 at util 0.9 -> ~800k tokens
(reference: "about 760k"), DeepSeek-R1 FP8 at TP=8 -> ~502k tokens (reference: "450-500k").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvwatch.sim.models import GpuSpec, ModelSpec

DTYPE_BYTES = {"auto": 2, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
DEFAULT_RUNTIME_RESERVE_BYTES = 6e9


def kv_dtype_bytes(kv_cache_dtype: str) -> int:
    try:
        return DTYPE_BYTES[kv_cache_dtype]
    except KeyError:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected one of {sorted(DTYPE_BYTES)}"
        ) from None


def kv_bytes_per_token(model: ModelSpec, kv_cache_dtype: str = "auto") -> int:
    """KV bytes per token of the whole model, one unsharded copy."""
    return model.kv_elements_per_token() * kv_dtype_bytes(kv_cache_dtype)


def kv_bytes_per_token_per_gpu(model: ModelSpec, tp: int, kv_cache_dtype: str = "auto", pp: int = 1) -> float:
    """Per-token KV bytes one rank stores (GQA heads shard over TP, MLA latents replicate; PP splits
    the layers)."""
    dtype = kv_dtype_bytes(kv_cache_dtype)
    if model.mla:
        return model.kv_elements_per_token() * dtype / pp
    heads_per_rank = max(1.0, model.kv_heads / tp)
    return 2 * model.layers * heads_per_rank * model.head_dim * dtype / pp


@dataclass(frozen=True, slots=True)
class ReplicaMemory:
    """The memory plan of one replica (``tp x pp`` GPUs); per-GPU figures are what NVML would see."""

    tp: int
    gpu_memory_bytes: float
    gpu_memory_utilization: float
    weight_bytes_per_gpu: float
    runtime_reserve_bytes: float
    kv_pool_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    capacity_tokens: int
    pp: int = 1

    @property
    def kv_bytes_per_token_per_replica(self) -> float:
        return self.kv_bytes_per_token_per_gpu * self.tp * self.pp

    @property
    def used_bytes_per_gpu(self) -> float:
        """What NVML reports as used: vLLM allocates the whole KV pool at start-up."""
        return self.weight_bytes_per_gpu + self.runtime_reserve_bytes + self.kv_pool_bytes_per_gpu

    def num_blocks(self, block_size: int) -> int:
        return self.capacity_tokens // block_size


def plan_replica(
    model: ModelSpec,
    gpu: GpuSpec,
    tp: int = 1,
    gpu_memory_utilization: float = 0.9,
    *,
    kv_cache_dtype: str = "auto",
    runtime_reserve_bytes: float = DEFAULT_RUNTIME_RESERVE_BYTES,
    pp: int = 1,
) -> ReplicaMemory:
    """Apply the capacity formula (module docstring); raise when the weights do not fit."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
    if pp > model.layers:
        raise ValueError(f"pp={pp} exceeds {model.key}'s {model.layers} layers")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    weights = model.weight_bytes / (tp * pp)
    pool = gpu.memory_bytes * gpu_memory_utilization - runtime_reserve_bytes - weights
    if pool <= 0:
        need = (weights + runtime_reserve_bytes) / gpu.memory_bytes
        raise ValueError(
            f"{model.key} at tp={tp}{f' pp={pp}' if pp > 1 else ''} needs {weights / 1e9:.1f} GB of weights "
            f"per {gpu.key} GPU; at "
            f"gpu_memory_utilization={gpu_memory_utilization} nothing is left for KV cache "
            f"(raise tp or utilization above {need:.2f}, or add pipeline stages)"
        )
    per_token = kv_bytes_per_token_per_gpu(model, tp, kv_cache_dtype, pp)
    return ReplicaMemory(
        pp=pp,
        tp=tp,
        gpu_memory_bytes=gpu.memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes_per_gpu=weights,
        runtime_reserve_bytes=runtime_reserve_bytes,
        kv_pool_bytes_per_gpu=pool,
        kv_bytes_per_token_per_gpu=per_token,
        capacity_tokens=math.floor(pool / per_token),
    )
