"""The KV pool of one replica (DP rank) in tokens: usable, allocated, free.

Engines count the pool in different units (vLLM blocks and a usage ratio, SGLang token slots,
TRT-LLM blocks); these functions turn a ``ReplicaSample`` into token counts, once, for every derived
signal. ``None`` means the engine did not give enough to say.

vLLM detail (its v1 BlockPool): the block pool keeps block 0 as a *null block* that is never free,
and ``kv_cache_usage_perc = 1 - free / (num_gpu_blocks - 1)``. So blocks in use are
``usage x (num_gpu_blocks - 1)`` and the pool a request can use is ``num_gpu_blocks - 1`` blocks.
Blocks the prefix cache holds but no request references count as free (evictable on demand).
"""

from __future__ import annotations

from kvwatch.model import ReplicaSample

#: blocks an engine's pool reserves and never hands to a request, by backend
RESERVED_BLOCKS: dict[str, int] = {"vllm": 1}


def usable_blocks(sample: ReplicaSample) -> int | None:
    """Blocks requests can hold: ``num_gpu_blocks`` minus the engine's reserved blocks."""
    if sample.num_gpu_blocks is None:
        return None
    return max(int(sample.num_gpu_blocks) - RESERVED_BLOCKS.get(sample.backend, 0), 0)


def used_blocks(sample: ReplicaSample) -> float | None:
    """Blocks held by requests: the engine's count, else usage ratio x usable blocks (whole blocks)."""
    if sample.kv_used_blocks is not None:
        return float(sample.kv_used_blocks)
    usable = usable_blocks(sample)
    if sample.kv_usage_ratio is None or usable is None:
        return None
    return float(round(sample.kv_usage_ratio * usable))


def tokens_per_block(sample: ReplicaSample) -> float | None:
    """Token slots one block serves: the engine's token capacity over its blocks where it reports both,
    else ``block_size``. They differ on hybrid models (sliding-window or Mamba layers beside full
    attention): the KV groups share one block pool, so vLLM's ``kv_cache_size_tokens`` is not
    ``num_gpu_blocks x block_size`` (less with two attention groups; far more with Mamba, whose
    attention pages are sized to the state), and counting ``block_size`` a block let free tokens
    exceed the pool's capacity. A difference under one block is the cut into whole blocks (SGLang's
    partial last page, which no request gets): ``block_size`` then."""
    capacity, blocks, size = sample.kv_capacity_tokens, sample.num_gpu_blocks, sample.block_size
    if capacity and blocks and (not size or abs(capacity - blocks * size) >= size):
        return capacity / blocks
    return float(size) if size else None


def usable_tokens(sample: ReplicaSample) -> float | None:
    """Token slots requests can hold (usable blocks x tokens a block, else the engine's token capacity)."""
    usable, per_block = usable_blocks(sample), tokens_per_block(sample)
    if usable is not None and per_block:
        return usable * per_block
    return sample.kv_capacity_tokens


def allocated_tokens(sample: ReplicaSample) -> float | None:
    """Token slots held by requests, counting every slot of a partly filled block.

    Token-exact engines (SGLang ``num_used_tokens``) give it directly; block engines give used blocks
    x block size; failing both, usage ratio x token capacity.
    """
    if sample.kv_used_tokens is not None:
        return float(sample.kv_used_tokens)
    blocks, per_block = used_blocks(sample), tokens_per_block(sample)
    if blocks is not None and per_block:
        return blocks * per_block
    if sample.kv_usage_ratio is not None and sample.kv_capacity_tokens is not None:
        return sample.kv_usage_ratio * sample.kv_capacity_tokens
    return None


def free_tokens(sample: ReplicaSample) -> float | None:
    """Token slots a request could still be given (evictable prefix-cache slots count as free)."""
    usable = usable_tokens(sample)
    allocated = allocated_tokens(sample)
    if usable is None or allocated is None:
        return None
    return max(usable - allocated, 0.0)
