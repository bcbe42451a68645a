"""What a replica's layout costs per step: TP collectives, pipeline stages and expert routing.

Pure arithmetic on presets (no I/O). One replica is ``pp`` pipeline stages of ``tp`` GPUs each; a MoE
model's routed experts are either sharded inside every expert across the stage's ``tp`` GPUs (dense
TP) or spread whole over them (expert parallelism, vLLM ``--enable-expert-parallel``: EP degree =
``tp``, attention stays TP). Per step of ``N`` tokens (prefill + decode) and ``m`` micro-batches::

    m          = min(pp, sequences in the step)              (1 without PP)
    stage mem  = dense weights/(tp x pp) + touched experts' bytes on the busiest GPU
                 + KV tokens read x KV bytes per token per GPU / m        (all / HBM bw x mem_eff)
    stage flop = 2 x (dense active + routed active x imbalance) x N/m / (tp x pp x FLOPS x eff)
    stage comm = per layer of the stage: TP all-reduces (2 per dense layer; 1 per MoE layer under EP,
                 which adds an all-to-all dispatch and combine) over N/m tokens' activations
    step       = overhead + pp x (max(stage mem, stage flop) + stage comm)
                 + (pp - 1) x send(N/m tokens' activations)

* A micro-batch goes through the ``pp`` stages one after the other, so one step (every sequence one
  token further) lasts ``pp`` stage times however many micro-batches fill the pipe: the bubble. Each
  stage reads its weights once per micro-batch, so PP never divides the weight reads of one token's
  path the way TP does; it divides memory, and (with ``m = pp``) compute.
* Touched experts: ``N`` tokens each routed to ``k`` of ``E`` experts touch
  ``E x (1 - (1 - k/E)^N)`` of them per MoE layer (uniform routing), so a small batch reads a few
  experts, not all of them. Under EP the busiest GPU holds ``imbalance x`` its fair share of the
  touched experts and tokens (``expert_imbalance``, default 1.25: an assumption, see
  docs/simulator.md); dense TP splits every expert evenly and has no imbalance.
* Collectives use the GPU's ``Interconnect`` (``models.py``): ring all-reduce
  ``base + 2(n-1) x hop + 2(n-1)/n x bytes / busbw``; activations are bf16 (2 bytes x hidden).

With ``tp = pp = 1`` and a dense model every collective term is 0 and the step is the plain roofline.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.sim.models import GpuSpec, ModelSpec

ACTIVATION_BYTES = 2  # bf16 activations on the wire
DEFAULT_EXPERT_IMBALANCE = 1.25


@dataclass(frozen=True, slots=True)
class ParallelStep:
    """Precomputed per-step constants of one layout; ``seconds`` is the step model above."""

    tp: int
    pp: int
    expert_parallel: bool
    overhead_s: float
    t_dense_weights: float  # per micro-batch per stage, per GPU
    t_expert: float  # one touched expert's bytes on one GPU, per MoE layer of a stage
    moe_layers_per_stage: float
    experts: int
    experts_per_token: int
    imbalance: float
    t_kv_per_token: float  # per GPU
    t_flops_per_token: float  # per stage, per GPU (routed part already x imbalance)
    comm_fixed: float  # per stage per micro-batch
    comm_per_token: float
    send_fixed: float
    send_per_token: float

    @property
    def is_trivial(self) -> bool:
        """A dense model on one stage: ``seconds`` is affine in tokens (the engine inlines it)."""
        return self.pp == 1 and self.experts == 0

    def touched_experts(self, tokens: float) -> float:
        """Distinct routed experts ``tokens`` tokens touch in one MoE layer (uniform routing)."""
        if self.experts == 0 or tokens <= 0:
            return 0.0
        e = self.experts
        return e * (1.0 - (1.0 - self.experts_per_token / e) ** tokens)

    def seconds(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int, sequences: int) -> float:
        tokens = prefill_tokens + decode_seqs
        m = min(self.pp, max(1, sequences))
        per_micro = tokens / m
        t_mem = self.t_dense_weights + kv_tokens * self.t_kv_per_token / m
        if self.experts:
            touched = self.touched_experts(per_micro)
            if self.expert_parallel:
                per_gpu = min(self.experts / self.tp, touched / self.tp * self.imbalance)
            else:
                per_gpu = touched  # each GPU reads 1/tp of every touched expert: t_expert has the /tp
            t_mem += self.moe_layers_per_stage * per_gpu * self.t_expert
        t_cmp = per_micro * self.t_flops_per_token
        stage = (t_mem if t_mem > t_cmp else t_cmp) + self.comm_fixed + self.comm_per_token * per_micro
        send = (self.pp - 1) * (self.send_fixed + self.send_per_token * per_micro) if self.pp > 1 else 0.0
        return self.overhead_s + self.pp * stage + send


def parallel_step(
    model: ModelSpec,
    gpu: GpuSpec,
    *,
    tp: int,
    pp: int,
    weight_bytes_per_gpu: float,
    kv_bytes_per_token_per_gpu: float,
    mem_efficiency: float,
    compute_efficiency: float,
    overhead_s: float,
    expert_parallel: bool = False,
    expert_imbalance: float = DEFAULT_EXPERT_IMBALANCE,
) -> ParallelStep:
    """The constants of ``ParallelStep`` for one replica layout."""
    if expert_parallel and not model.is_moe:
        raise ValueError(f"expert_parallel needs a MoE model; {model.key} is dense")
    if not expert_imbalance >= 1:
        raise ValueError(f"expert_imbalance must be >= 1 (busiest / mean), got {expert_imbalance!r}")
    bw = gpu.hbm_bandwidth * mem_efficiency
    flops = gpu.flops(model.weight_dtype) * compute_efficiency
    bytes_per_param = model.weight_bytes / model.params
    imbalance = expert_imbalance if expert_parallel and tp > 1 else 1.0
    if model.is_moe:
        dense_bytes_per_gpu = model.dense_params * bytes_per_param / (tp * pp)
        expert_bytes = model.expert_params * bytes_per_param / (1 if expert_parallel else tp)
        active = model.dense_params + model.routed_active_params * imbalance
    else:
        dense_bytes_per_gpu = weight_bytes_per_gpu
        expert_bytes = 0.0
        active = model.active_params
    link = gpu.interconnect
    act = model.hidden * ACTIVATION_BYTES  # bytes of one token's activations
    moe_per_stage = model.moe_layers / pp
    dense_per_stage = (model.layers - model.moe_layers) / pp
    # TP all-reduces: 2 per dense layer; a MoE layer has 2 under dense TP, 1 (attention) under EP
    all_reduces = 2 * dense_per_stage + (1 if expert_parallel else 2) * moe_per_stage
    comm_fixed = comm_tok = 0.0
    if tp > 1:
        comm_fixed = all_reduces * link.all_reduce_seconds(0.0, tp)
        comm_tok = all_reduces * (link.all_reduce_seconds(act, tp) - link.all_reduce_seconds(0.0, tp))
        if expert_parallel:
            # dispatch + combine: each rank sends its 1/tp share of the tokens' k routed copies
            a2a = 2 * moe_per_stage
            per_token = act * model.experts_per_token / tp
            comm_fixed += a2a * link.all_to_all_seconds(0.0, tp)
            comm_tok += a2a * (link.all_to_all_seconds(per_token, tp) - link.all_to_all_seconds(0.0, tp))
    send_fixed = link.send_seconds(0.0) if pp > 1 else 0.0
    send_tok = act / tp / link.bus_bandwidth if pp > 1 else 0.0  # each TP rank sends its slice
    return ParallelStep(
        tp=tp,
        pp=pp,
        expert_parallel=expert_parallel,
        overhead_s=overhead_s,
        t_dense_weights=dense_bytes_per_gpu / bw,
        t_expert=expert_bytes / bw,
        moe_layers_per_stage=moe_per_stage,
        experts=model.experts,
        experts_per_token=model.experts_per_token,
        imbalance=imbalance,
        t_kv_per_token=kv_bytes_per_token_per_gpu / bw,
        t_flops_per_token=2 * active / (tp * pp * flops),
        comm_fixed=comm_fixed,
        comm_per_token=comm_tok,
        send_fixed=send_fixed,
        send_per_token=send_tok,
    )
