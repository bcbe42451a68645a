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
    hidden: int = 4096  # hidden size: the width of the activations a TP all-reduce sums per token
    # MoE (0 experts: dense). ``moe_layers`` of the ``layers`` route each token to ``experts_per_token``
    # of ``experts`` routed experts of ``expert_params`` parameters each; everything else (attention,
    # dense layers, shared experts, embeddings) is the dense part every token reads.
    moe_layers: int = 0
    experts: int = 0
    experts_per_token: int = 0
    expert_params: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def routed_expert_params(self) -> float:
        """Parameters of all routed experts (the part expert parallelism shards whole)."""
        return self.moe_layers * self.experts * self.expert_params

    @property
    def dense_params(self) -> float:
        """Parameters every token reads (for a dense model, all of them)."""
        return self.params - self.routed_expert_params

    @property
    def routed_active_params(self) -> float:
        """Routed-expert parameters one token multiplies through."""
        return self.moe_layers * self.experts_per_token * self.expert_params

    def kv_elements_per_token(self) -> int:
        """KV-cache elements per token for the whole model (one copy, unsharded)."""
        if self.mla:
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.layers * self.kv_heads * self.head_dim


def _dense(
    key: str, served: str, layers: int, kv_heads: int, params: float, max_len: int, hidden: int
) -> ModelSpec:
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
        hidden=hidden,
    )


MODELS: dict[str, ModelSpec] = {
    m.key: m
    for m in (
        _dense("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", 32, 8, 8.03e9, 131072, 4096),
        _dense("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", 80, 8, 70.55e9, 131072, 8192),
        _dense("llama-3.1-405b", "meta-llama/Llama-3.1-405B-Instruct", 126, 8, 405.85e9, 131072, 16384),
        _dense("qwen3-32b", "Qwen/Qwen3-32B", 64, 8, 32.8e9, 40960, 5120),
        # 671B main + 14B MTP ~ 685 GB in FP8 (the published FP8 checkpoint); 37B activated per token; the MLA
        # latent is 512 + 64 rope elements per layer, 61 layers (the MTP layer is not counted). config.json:
        # hidden_size 7168; the first 3 layers dense (first_k_dense_replace), 58 MoE layers of 256 routed
        # experts (n_routed_experts), 8 per token (num_experts_per_tok), each a SwiGLU of
        # moe_intermediate_size 2048: 3 x 7168 x 2048 = 44.0M parameters; the shared expert is dense.
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
            hidden=7168,
            moe_layers=58,
            experts=256,
            experts_per_token=8,
            expert_params=3 * 7168 * 2048,
        ),
    )
}


@dataclass(frozen=True, slots=True)
class Interconnect:
    """The GPU-to-GPU fabric a collective runs on, as nccl-tests measures it.

    ``bus_bandwidth`` is nccl-tests' busbw at large messages (bytes/s per GPU); a collective of ``n``
    ranks costs ``base_latency + hops x hop_latency`` before its bytes move (the term that dominates a
    small decode batch). Sources and the split of the latency are in docs/simulator.md.
    """

    name: str
    bus_bandwidth: float
    base_latency_s: float
    hop_latency_s: float

    def all_reduce_seconds(self, nbytes: float, ranks: int) -> float:
        """Ring all-reduce: 2(n-1) steps, each rank sends 2(n-1)/n of the message."""
        if ranks <= 1:
            return 0.0
        steps = 2 * (ranks - 1)
        return self.base_latency_s + steps * self.hop_latency_s + steps / ranks * nbytes / self.bus_bandwidth

    def all_to_all_seconds(self, nbytes_per_rank: float, ranks: int) -> float:
        """All-to-all: each rank keeps 1/n of what it holds and sends the rest, n-1 peers at once."""
        if ranks <= 1:
            return 0.0
        return (
            self.base_latency_s
            + (ranks - 1) * self.hop_latency_s
            + (ranks - 1) / ranks * nbytes_per_rank / self.bus_bandwidth
        )

    def send_seconds(self, nbytes: float) -> float:
        """One point-to-point transfer (a pipeline stage handing its activations on)."""
        return self.base_latency_s + self.hop_latency_s + nbytes / self.bus_bandwidth


# nccl-tests all_reduce_perf, 8 GPUs: busbw at large messages 460-480 GB/s on 8x H100 SXM (NVLink 4,
# NVSwitch), 35-45 GB/s on 8x H100 PCIe without NVSwitch; out-of-place time 12.5 us at 4-8 B rising to
# 16.7 us at 4 KB on an 8x H20 (Hopper, NVLink 4) node. NVLink 5 (B200) doubles NVLink 4's per-GPU
# bandwidth (1.8 against 0.9 TB/s): its busbw is taken as twice NVLink 4's, an assumption, not a
# measurement. The 12.5 us of 8 ranks is split as 5.5 us fixed + 0.5 us per ring step (14 steps), an
# assumption that makes a 2-rank all-reduce cost 6.5 us.
NVLINK4 = Interconnect("NVLink 4", 460e9, 5.5e-6, 0.5e-6)
NVLINK5 = Interconnect("NVLink 5", 920e9, 5.5e-6, 0.5e-6)

#: Host <-> device copies over PCIe Gen5 x16 reach ~55 GB/s per direction of the 64 GB/s raw rate
#: (an nvbandwidth ``host_to_device_memcpy_ce`` run reports 55.63 GB/s; the example output quoted in
#: dev.smart-guide.co.kr's nvbandwidth tutorial after NVIDIA's "NVbandwidth" developer blog post;
#: pinned-memory cudaMemcpy on H100/H200 hosts is commonly measured at 50-55 GB/s). KV offload moves
#: large pinned blocks, so it gets this rate, not the datasheet's.
MEASURED_GEN5_HOST_BANDWIDTH = 55e9
PCIE_P2P = Interconnect("PCIe", 40e9, 8e-6, 2e-6)


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Datasheet figures the step-time model uses (dense tensor-core FLOPS, no sparsity)."""

    key: str
    name: str  # what NVML would call it
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float
    fp8_flops: float
    pcie_bandwidth: float  # bytes/s per direction (host <-> device), theoretical
    interconnect: Interconnect = PCIE_P2P  # GPU-to-GPU fabric for TP/EP/PP collectives
    #: measured host <-> device copy bandwidth per direction (what KV offload gets), bytes/s
    host_bandwidth: float = MEASURED_GEN5_HOST_BANDWIDTH
    #: GPUs sharing one PCIe switch uplink to the host (1: each GPU has its own x16 path)
    gpus_per_host_link: int = 1

    def flops(self, dtype: str) -> float:
        return self.fp8_flops if dtype == "fp8" else self.bf16_flops


GPUS: dict[str, GpuSpec] = {
    g.key: g
    for g in (
        # H200 SXM: 141 GB HBM3e at 4.8 TB/s (NVIDIA's H200 SXM datasheet), 989 TFLOPS dense bf16, 1979 fp8,
        # PCIe Gen5 x16 = 64 GB/s per direction before protocol overhead.
        GpuSpec("h200", "NVIDIA H200", 141 * GB, 4.8e12, 989e12, 1979e12, 64 * GB, interconnect=NVLINK4),
        # H100 SXM (NVIDIA H100 datasheet): 80 GB HBM3 at 3.35 TB/s, 989 TFLOPS dense bf16 (1,979 with
        # 2:4 sparsity), 1,979 fp8 dense, PCIe Gen5 x16.
        GpuSpec(
            "h100", "NVIDIA H100 80GB HBM3", 80 * GB, 3.35e12, 989e12, 1979e12, 64 * GB, interconnect=NVLINK4
        ),
        # B200 (HGX, 1,000 W; NVIDIA's Blackwell datasheet as tabulated at
        # glennklockwood.com/garden/processors/B200): 192 GB HBM3e at 8 TB/s, 2,250 TFLOPS dense bf16,
        # 4,500 fp8 dense (twice that with sparsity), PCIe Gen6 x16 = 128 GB/s per direction.
        GpuSpec(
            "b200",
            "NVIDIA B200",
            192 * GB,
            8.0e12,
            2250e12,
            4500e12,
            128 * GB,
            interconnect=NVLINK5,
            # the GPU speaks Gen6, but the host CPUs of HGX/DGX B200 systems (DGX B200: two Xeon
            # Platinum 8570) are PCIe Gen5: host copies get the Gen5 rate
            host_bandwidth=MEASURED_GEN5_HOST_BANDWIDTH,
        ),
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
