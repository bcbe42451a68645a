"""Records for derive tests: a vLLM-like replica sample with every field named, nothing hidden."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvwatch.model import GpuSample, HistogramSnapshot, InFlightRequest, ReplicaSample


def vllm(**fields: Any) -> ReplicaSample:
    """A vLLM replica, rank 0, 1001 blocks of 16 tokens (1000 usable), 10 s after the epoch."""
    base = ReplicaSample(
        replica="r0",
        backend="vllm",
        scraped_at=10.0,
        model_name="m",
        dp_rank="0",
        block_size=16,
        num_gpu_blocks=1001,
    )
    return replace(base, **fields)


def decoding(t: float, running: float = 2.0, tokens_per_s: float = 20.0, **fields: Any) -> ReplicaSample:
    """``vllm`` scraped at ``t``: half its KV in use, ``running`` sequences generating ``tokens_per_s``
    together since the epoch, nothing waiting, preempted or finished yet."""
    base = {
        "kv_usage_ratio": 0.5,
        "requests_running": running,
        "requests_waiting": 0.0,
        "preemptions_total": 0.0,
        "generation_tokens_total": tokens_per_s * t,
        "prompt_tokens_total": 0.0,
        "finished_requests_total": (("stop", 0.0),),
    }
    return vllm(scraped_at=t, **{**base, **fields})


def sglang(**fields: Any) -> ReplicaSample:
    """An SGLang replica with page size 1 and a 100k-token pool."""
    base = ReplicaSample(
        replica="s0",
        backend="sglang",
        scraped_at=10.0,
        model_name="m",
        dp_rank=None,
        block_size=1,
        kv_capacity_tokens=100_000.0,
    )
    return replace(base, **fields)


def request(
    started_at: float, prompt: int, generated: int = 0, max_tokens: int | None = None, replica: str = "r0"
) -> InFlightRequest:
    return InFlightRequest(
        replica=replica,
        model_name="m",
        admission_band="0-1k",
        prompt_tokens_estimate=prompt,
        generated_tokens=generated,
        started_at=started_at,
        max_tokens=max_tokens,
    )


def token_histogram(count: float, total: float) -> HistogramSnapshot:
    """A per-request token histogram reduced to what the derive code reads (count and sum)."""
    return HistogramSnapshot(bounds=(float("inf"),), cumulative_counts=(count,), sum=total, count=count)


def gpu(
    index: int = 0,
    at: float = 10.0,
    tx: float | None = 0.0,
    rx: float | None = 0.0,
    gen: int | None = 5,
    width: int | None = 16,
    gen_max: int | None = 5,
    width_max: int | None = 16,
    **fields: Any,
) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=f"GPU-{index}",
        sampled_at=at,
        pcie_tx_bytes_total=tx,
        pcie_rx_bytes_total=rx,
        pcie_link_gen_current=gen,
        pcie_link_width_current=width,
        pcie_link_gen_max=gen_max,
        pcie_link_width_max=width_max,
        **fields,
    )
