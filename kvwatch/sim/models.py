"""Model and GPU presets for the simulator: the shapes that decide KV size, weight bytes and speed.

Shapes are the models' config.json values (as published on the Hugging Face Hub); parameter counts
are the published totals. Only what the simulator needs is here: KV geometry, weight bytes, the
parameters one token touches (for FLOPs), and the native context length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

GB = 1e9


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model's shape as the simulator sees it.

    ``kv_heads``/``head_dim`` describe a GQA/MHA cache; an MLA model (DeepSeek-V3/R1) instead caches one
    latent of ``kv_lora_rank + qk_rope_head_dim`` elements per token per layer, replicated on every TP
    rank. ``active_params`` is what one token multiplies through (MoE: the routed experts only).
    """

    key: str  # short preset key, e.g. "llama-3.1-8b"
    served_name: str  # the HF id vLLM serves it as (``model_name`` label)
    layers: int
    kv_heads: int
    head_dim: int
    params: float  # total parameters
    active_params: float  # parameters per token (dense: == params)
    weight_bytes: float  # checkpoint bytes as loaded (bf16: 2 x params)
    weight_dtype: str = "bf16"  # "bf16" | "fp8": also picks the GPU's FLOPS figure
    max_model_len: int = 131072
    mla: bool = False
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def kv_elements_per_token(self) -> int:
        """KV-cache elements per token for the whole model (one copy, unsharded)."""
        if self.mla:
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.layers * self.kv_heads * self.head_dim


def _dense(key: str, served: str, layers: int, kv_heads: int, params: float, max_len: int) -> ModelSpec:
    return ModelSpec(
        key=key,
        served_name=served,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=128,
        params=params,
        active_params=params,
        weight_bytes=2 * params,
        max_model_len=max_len,
    )


MODELS: dict[str, ModelSpec] = {
    m.key: m
    for m in (
        _dense("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", 32, 8, 8.03e9, 131072),
        _dense("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", 80, 8, 70.55e9, 131072),
        _dense("llama-3.1-405b", "meta-llama/Llama-3.1-405B-Instruct", 126, 8, 405.85e9, 131072),
        _dense("qwen3-32b", "Qwen/Qwen3-32B", 64, 8, 32.8e9, 40960),
        # 671B main + 14B MTP ~ 685 GB in FP8 (the published FP8 checkpoint); 37B activated per token; the MLA
        # latent is 512 + 64 rope elements per layer, 61 layers (the MTP layer is not counted).
        ModelSpec(
            key="deepseek-r1",
            served_name="deepseek-ai/DeepSeek-R1",
            layers=61,
            kv_heads=128,
            head_dim=128,
            params=671e9,
            active_params=37e9,
            weight_bytes=685e9,
            weight_dtype="fp8",
            max_model_len=163840,
            mla=True,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
        ),
    )
}


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Datasheet figures the step-time model uses (dense tensor-core FLOPS, no sparsity)."""

    key: str
    name: str  # what NVML would call it
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float
    fp8_flops: float
    pcie_bandwidth: float  # bytes/s per direction (host <-> device)
    pcie_gen: int = 5
    pcie_width: int = 16

    def flops(self, dtype: str) -> float:
        return self.fp8_flops if dtype == "fp8" else self.bf16_flops


GPUS: dict[str, GpuSpec] = {
    g.key: g
    for g in (
        # H200 SXM: 141 GB HBM3e at 4.8 TB/s (NVIDIA's H200 SXM datasheet), 989 TFLOPS dense bf16, 1979 fp8,
        # PCIe Gen5 x16 = 64 GB/s per direction before protocol overhead.
        GpuSpec("h200", "NVIDIA H200", 141 * GB, 4.8e12, 989e12, 1979e12, 64 * GB),
        # H100 SXM (NVIDIA H100 datasheet): 80 GB HBM3 at 3.35 TB/s, 989 TFLOPS dense bf16 (1,979 with
        # 2:4 sparsity), 1,979 fp8 dense, PCIe Gen5 x16.
        GpuSpec("h100", "NVIDIA H100 80GB HBM3", 80 * GB, 3.35e12, 989e12, 1979e12, 64 * GB),
        # B200 (HGX, 1,000 W; NVIDIA's Blackwell datasheet as tabulated at
        # glennklockwood.com/garden/processors/B200): 192 GB HBM3e at 8 TB/s, 2,250 TFLOPS dense bf16,
        # 4,500 fp8 dense (twice that with sparsity), PCIe Gen6 x16 = 128 GB/s per direction.
        GpuSpec("b200", "NVIDIA B200", 192 * GB, 8.0e12, 2250e12, 4500e12, 128 * GB, pcie_gen=6),
    )
}


_Spec = TypeVar("_Spec")


def _lookup(table: dict[str, _Spec], name: str, what: str, extra_names: Callable[[_Spec], str]) -> _Spec:
    wanted = name.strip().lower()
    for key, spec in table.items():
        if wanted == key or wanted == extra_names(spec).lower():
            return spec
    known = ", ".join(sorted(table))
    raise ValueError(f"unknown {what} {name!r}; known presets: {known}")


def model_preset(name: str) -> ModelSpec:
    """A model preset by key (``llama-3.1-8b``) or served name (``meta-llama/Llama-3.1-8B-Instruct``)."""
    return _lookup(MODELS, name, "model", lambda m: m.served_name)


def gpu_preset(name: str) -> GpuSpec:
    return _lookup(GPUS, name, "GPU", lambda g: g.name)
