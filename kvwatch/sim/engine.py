"""A continuous-batching engine with a paged KV cache, stepping on a virtual clock.

Pure: no I/O, no wall clock, no randomness (callers pass every number), so a run is a function of
its inputs. Scheduling follows vLLM V1 (``vllm/v1/core/sched/scheduler.py``):

* each step first schedules the running requests in admission order: every decoding sequence grows
  by one token (a new block whenever its token count crosses a multiple of ``block_size``), partial
  prefills continue within the token budget;
* when a block cannot be allocated, the most recently admitted running request is preempted: its
  blocks are freed, it goes back to the FRONT of the waiting queue, and when it resumes its prompt
  plus the tokens generated so far are prefilled again (recompute), unless the optional CPU tier
  kept a copy, which is then loaded back over PCIe;
* only if nothing was preempted in this step are waiting requests admitted, first come first
  served, while ``max_num_seqs``, the token budget ``max_num_batched_tokens`` and free blocks allow
  (chunked prefill: a prompt larger than the remaining budget is split over steps).

Token accounting: a sequence holds ``prompt + generated`` tokens of KV (the slot of a sampled token is
allocated in the step that samples it), so at every step boundary the pool's used blocks equal
``sum(ceil(tokens / block_size))`` over running sequences (minus shared prefix blocks counted once).

The decode loop is the hot path and does no per-sequence work: every decoding sequence grows by one
token per step, so a sequence is stored as ``tokens = base + step_index``; the blocks needed in a
step are the count of sequences whose ``base`` sits in the phase ``-step_index mod block_size``, and
completions are indexed by the step in which they happen. A step costs O(1) plus O(requests that
start, finish, are preempted or are in prefill).

Step time (roofline, one fused forward pass as in vLLM V1)::

    memory  = (weights/tp + live KV tokens x KV bytes per token per GPU) / (HBM bandwidth x mem_eff)
    compute = 2 x active_params x (prefill tokens + decode tokens) / (tp x FLOPS x compute_eff)
    step    = host transfer wait + overhead + max(memory, compute) + TP all-reduces

The host transfer wait is for the KV this step stores (a preempted request kept in the CPU tier) or
loads back (a resumed one) over the replica's PCIe uplinks (``hostlink.py``) at the GPU type's
measured host bandwidth; uplinks shared with other replicas behind one switch make it longer when
they move KV at the same time (saturation delays the step that waits for it).

TP all-reduces, pipeline stages and MoE expert routing are ``parallel.py``'s model; with ``tp = pp = 1``
and a dense model they cost nothing and the step is the plain roofline.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwatch.sim.hostlink import ReplicaHostPath, node_host_paths
from kvwatch.sim.memory import DEFAULT_RUNTIME_RESERVE_BYTES, ReplicaMemory, plan_replica
from kvwatch.sim.models import GpuSpec, ModelSpec, gpu_preset
from kvwatch.sim.parallel import DEFAULT_EXPERT_IMBALANCE, ParallelStep, parallel_step
from kvwatch.sim.stats import EngineStats
from kvwatch.sim.steptime import StepCost

ADMISSION_POLICIES = ("none", "reserve_max_tokens", "quantile_budget")

# request states
WAITING, PREFILL, DECODE, FINISHED, ABORTED = range(5)
_STATE_NAMES = ("waiting", "prefill", "decode", "finished", "aborted")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One replica (one DP rank): model, hardware share and vLLM scheduler knobs.

    Defaults follow vLLM's OpenAI server on H100/H200 (``max_num_seqs`` 1024,
    ``max_num_batched_tokens`` 8192, ``block_size`` 16, chunked prefill on). ``num_gpu_blocks_override``
    replaces the memory plan's block count (vLLM has the same flag), for small test caches.
    ``kv_offload_bytes`` > 0 turns on the CPU tier (vLLM ``--kv-offloading-size``).
    """

    model: ModelSpec
    gpu: GpuSpec = field(default_factory=lambda: gpu_preset("h200"))
    tp: int = 1
    pp: int = 1  # pipeline stages of ``tp`` GPUs each
    expert_parallel: bool = False  # MoE: routed experts spread whole over the tp GPUs (EP = tp)
    expert_imbalance: float = DEFAULT_EXPERT_IMBALANCE  # EP: busiest GPU's expert load / the mean
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's native context length
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    kv_offload_bytes: float = 0.0
    gpus_per_pcie_switch: int | None = None  # GPUs sharing one host uplink; None: the GPU preset's
    num_gpu_blocks_override: int | None = None
    runtime_reserve_bytes: float = DEFAULT_RUNTIME_RESERVE_BYTES
    mem_efficiency: float = 0.8  # achieved / peak HBM bandwidth
    compute_efficiency: float = 0.5  # achieved / peak dense FLOPS (MFU)
    step_overhead_s: float = 0.0015  # scheduler, sampling, launch: per step
    step_cost: StepCost | None = None  # a fitted step-time model replacing the roofline (kvwatch plan)
    # admission control in front of the scheduler (kvwatch plan's policies; vLLM has none):
    # reserve_max_tokens admits while prompt + max_tokens of the admitted fit the pool;
    # quantile_budget reserves prompt + min(max_tokens, admission_output_budget) and keeps
    # admission_headroom of the pool as shared emergency room for requests that outgrow it
    admission: str = "none"
    admission_output_budget: int = 0
    admission_headroom: float = 0.0
    step_histograms: bool = True  # per-step iteration-token and ITL histograms (/metrics); off: faster

    def memory(self) -> ReplicaMemory:
        return plan_replica(
            self.model,
            self.gpu,
            self.tp,
            self.gpu_memory_utilization,
            kv_cache_dtype=self.kv_cache_dtype,
            runtime_reserve_bytes=self.runtime_reserve_bytes,
            pp=self.pp,
        )

    @property
    def gpus(self) -> int:
        """GPUs one replica occupies."""
        return self.tp * self.pp

    def step_model(self) -> ParallelStep:
        """The layout's step-time constants (``parallel.py``)."""
        mem = self.memory()
        return parallel_step(
            self.model,
            self.gpu,
            tp=self.tp,
            pp=self.pp,
            weight_bytes_per_gpu=mem.weight_bytes_per_gpu,
            kv_bytes_per_token_per_gpu=mem.kv_bytes_per_token_per_gpu,
            mem_efficiency=self.mem_efficiency,
            compute_efficiency=self.compute_efficiency,
            overhead_s=self.step_overhead_s,
            expert_parallel=self.expert_parallel,
            expert_imbalance=self.expert_imbalance,
        )

    @property
    def switch_gpus(self) -> int:
        """GPUs behind one PCIe switch uplink (the candidate's, else the GPU preset's)."""
        return self.gpus_per_pcie_switch or self.gpu.gpus_per_host_link

    @property
    def context_len(self) -> int:
        return self.max_model_len or self.model.max_model_len

    @property
    def num_gpu_blocks(self) -> int:
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        return self.memory().num_blocks(self.block_size)

    @property
    def block_bytes(self) -> float:
        """Bytes of one block across the replica's GPUs."""
        return self.memory().kv_bytes_per_token_per_replica * self.block_size

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}), as vLLM requires"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.context_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.context_len})"
            )
        heads = self.model.kv_heads
        if not self.model.mla and heads % self.tp and self.tp % heads:
            # vLLM's QKVParallelLinear shards the KV heads over the TP ranks, or replicates each on
            # tp / heads ranks: one must divide the other (a rank cannot hold 8/3 of a head)
            raise ValueError(
                f"tp={self.tp} cannot split the model's {heads} KV heads: vLLM needs tp to divide them "
                "or them to divide tp"
            )
        self.step_model()  # refuses a bad layout (EP on a dense model, imbalance < 1)
        capacity = self.num_gpu_blocks * self.block_size
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(f"admission {self.admission!r} is not one of {', '.join(ADMISSION_POLICIES)}")
        if self.admission == "quantile_budget" and self.admission_output_budget < 1:
            raise ValueError("admission quantile_budget needs admission_output_budget >= 1 token")
        if not 0 <= self.admission_headroom < 1:
            raise ValueError(f"admission_headroom must be within [0, 1), got {self.admission_headroom}")
        if capacity < self.context_len + 1:
            raise ValueError(
                f"the KV cache holds {capacity} tokens but max_model_len is {self.context_len}: one "
                "request could never fit; lower max_model_len or give the cache more blocks"
            )


@dataclass(frozen=True, slots=True)
class RequestView:
    """Ground truth about one request at one moment (times are simulated seconds)."""

    request_id: str
    state: str  # waiting | prefill | decode | finished | aborted
    prompt_tokens: int
    generated_tokens: int
    kv_tokens: int  # tokens whose KV is held on the GPU now
    kv_blocks: int  # ceil(kv_tokens / block_size), shared prefix blocks included
    max_tokens: int
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float | None
    finish_reason: str | None  # stop | length | abort
    preemptions: int
    recomputed_tokens: int
    cached_tokens: int  # prefix-cache hit tokens at first admission
    offloaded_tokens: int  # tokens held in the CPU tier now
    token_times: tuple[float, ...] | None  # every token's time, only for traced requests

    @property
    def running(self) -> bool:
        return self.state in ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What a subscriber learns after each ``advance_to``: totals, not per-token objects."""

    request_id: str
    generated_tokens: int  # total so far
    new_tokens: int  # since the previous event
    last_token_time: float | None
    finish_reason: str | None  # set once, on the final event


class StepInfo:
    """The last step, overwritten in place (no allocation per step); for tests and benchmarks."""

    __slots__ = (
        "admitted",
        "available_before",
        "decode_block_demand",
        "decode_tokens",
        "duration",
        "preempted",
        "prefill_tokens",
        "start",
    )

    def __init__(self) -> None:
        self.start = 0.0
        self.duration = 0.0
        self.decode_tokens = 0
        self.prefill_tokens = 0
        self.preempted = 0
        self.admitted = 0
        self.available_before = 0  # blocks allocatable when the step began
        self.decode_block_demand = 0  # new blocks the decode batch needed before any preemption


class _Req:
    __slots__ = (
        "anchor",
        "arrival",
        "base",
        "cached",
        "computed",
        "finish_reason",
        "finish_step",
        "g0",
        "generated",
        "goal",
        "high_water",
        "host_tokens",
        "max_tokens",
        "max_tokens_param",
        "own_blocks",
        "preemptions",
        "prefix_blocks",
        "prefix_id",
        "prompt",
        "recomputed",
        "reserved",
        "rid",
        "state",
        "stop_reason",
        "t_finished",
        "t_first_token",
        "t_last_token",
        "t_scheduled",
        "target",
        "token_times",
    )
    # set by submit(); the rest by __init__
    rid: str
    arrival: float
    prompt: int
    max_tokens: int  # the budget: the max_tokens parameter, or up to max_model_len
    max_tokens_param: int | None  # as the client sent it
    target: int
    stop_reason: str  # stop | length: what ends the request if nobody aborts it
    prefix_id: str | None  # set exactly when the request shares prefix blocks (prefix_blocks > 0)
    prefix_blocks: int

    def __init__(self) -> None:
        self.state = WAITING
        self.generated = 0  # exact when not decoding; while decoding see _gen()
        self.g0 = 0
        self.anchor = 0
        self.base = 0
        self.computed = 0  # KV tokens computed so far (prefill progress)
        self.goal = 0  # KV tokens the current prefill must reach (prompt + generated)
        self.own_blocks = 0  # blocks held outside the shared prefix (exact in PREFILL)
        self.high_water = 0  # most KV tokens ever held: recompute below it is re-work
        self.host_tokens = 0  # tokens kept in the CPU tier while preempted
        self.finish_step = -1
        self.t_scheduled: float | None = None
        self.t_first_token: float | None = None
        self.t_last_token: float | None = None
        self.t_finished: float | None = None
        self.finish_reason: str | None = None
        self.preemptions = 0
        self.recomputed = 0
        self.reserved = 0  # tokens promised by admission control while admitted
        self.cached = 0
        self.token_times: list[float] | None = None


class _Subscription:
    """Who to tell about a request's new tokens, and how many it had at the last notice."""

    __slots__ = ("callback", "last_generated", "req")

    def __init__(self, callback: Callable[[TokenEvent], None], req: _Req) -> None:
        self.callback = callback
        self.req = req
        self.last_generated = 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class SimEngine:
    """One simulated engine core (one vLLM DP rank). See the module docstring for the model."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        name: str = "0",
        start_time: float = 0.0,
        keep_finished: int = 10_000,
        host_path: ReplicaHostPath | None = None,
    ) -> None:
        """``host_path``: this replica's share of the node's PCIe uplinks (``hostlink.node_host_paths``);
        None: uplinks of its own, shared with no other replica."""
        config.validate()
        self.config = config
        self.name = name
        self.now = start_time
        self.busy_until = start_time  # when its last step ended (``now`` also moves on while idle)
        self.stats = EngineStats(config.context_len)
        self.last_step = StepInfo()
        # called once per ended request, from inside a step: it must not call back into the engine
        self.on_finish: Callable[[RequestView], None] | None = None

        mem = config.memory()
        self.memory_plan = mem
        self._B = config.block_size
        self._cap = config.num_gpu_blocks
        self._max_seqs = config.max_num_seqs
        self._budget = config.max_num_batched_tokens
        self._chunked = config.enable_chunked_prefill
        self._prefix_caching = config.enable_prefix_caching
        self._block_bytes = mem.kv_bytes_per_token_per_replica * self._B
        self._host_cap = int(config.kv_offload_bytes // self._block_bytes) if config.kv_offload_bytes else 0
        self._keep_finished = keep_finished

        # step-time constants: a dense one-stage layout is inlined in step() (affine in tokens: the
        # hot path), anything else goes through ParallelStep.seconds
        layout = config.step_model()
        self._layout: ParallelStep | None = None if layout.is_trivial else layout
        self._t_weights = layout.t_dense_weights
        self._t_per_kv_token = layout.t_kv_per_token
        self._t_per_token_flops = layout.t_flops_per_token
        self._comm_fixed = layout.comm_fixed
        self._comm_per_token = layout.comm_per_token
        self._host = (
            host_path or node_host_paths(1, config.gpus, config.switch_gpus, config.gpu.host_bandwidth)[0]
        )
        self._t_per_xfer_byte = self._host.alone_s_per_byte
        self._overhead = config.step_overhead_s
        self._cost = config.step_cost
        self._step_histograms = config.step_histograms
        self._admission = config.admission
        self._output_budget = config.admission_output_budget
        self._reserve_limit = self._cap * self._B * (1.0 - config.admission_headroom)
        self._reserved = 0

        self._s = 0  # index of the next step
        self._last_step_s = 0.0  # how long the last step took (``advance_to``)
        self._grown = 0  # 1 once this step's decode growth is allocated
        self._used = 0  # blocks held by live requests (shared prefixes once)
        self._evictable = 0  # cached prefix blocks nobody references (count as free)
        self._host_used = 0
        self._last_load_bytes = 0.0
        self._reqs: dict[str, _Req] = {}
        self._running: dict[str, _Req] = {}  # admission order; popitem() = newest
        self._prefilling: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._n_waiting = 0
        self._n_dec = 0
        self._dec_base_sum = 0
        self._prefill_kv = 0  # KV tokens held by requests in PREFILL
        self._phase = [0] * self._B
        self._finishing: dict[int, list[_Req]] = {}
        self._prefixes: dict[str, list[int]] = {}  # prefix id -> [refcount, blocks]
        self._lru: OrderedDict[str, int] = OrderedDict()  # evictable prefixes
        self._traced: dict[str, list[float]] = {}  # rid -> token times of a traced decoding request
        self._subs: dict[str, _Subscription] = {}
        self._finished: OrderedDict[str, RequestView] = OrderedDict()
        self.arrived = 0
        self.completed = 0  # finish_reason stop
        self.truncated = 0  # finish_reason length
        self.aborted = 0

    # ------------------------------------------------------------------ requests in

    def submit(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int | None,
        output_tokens: int,
        *,
        arrival: float | None = None,
        ignore_eos: bool = False,
        prefix_id: str | None = None,
        prefix_tokens: int = 0,
        trace: bool = False,
    ) -> None:
        """Queue a request. ``output_tokens`` is what the model would generate before EOS;
        ``max_tokens`` (None: up to ``max_model_len``) cuts it with finish_reason ``length``.
        ``prefix_id``/``prefix_tokens`` name a shared prompt prefix (system prompt) for prefix caching.
        ``trace`` keeps every token's time for this request (tests; costs one append per token)."""
        if request_id in self._reqs:
            raise ValueError(f"request id {request_id!r} is already in this engine")
        limit = self.config.context_len
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        if max_tokens is None:
            budget = limit - prompt_tokens
        elif max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        else:
            budget = max_tokens
        if budget < 1 or prompt_tokens + budget > limit:
            raise ValueError(
                f"prompt ({prompt_tokens}) + max_tokens ({budget}) exceeds max_model_len ({limit})"
            )
        if output_tokens < 1 and not ignore_eos:
            raise ValueError(f"output_tokens must be >= 1, got {output_tokens}")
        if not 0 <= prefix_tokens <= prompt_tokens:
            raise ValueError(f"prefix_tokens ({prefix_tokens}) must be within the prompt ({prompt_tokens})")
        r = _Req()
        r.rid = request_id
        r.arrival = self.now if arrival is None else arrival
        r.prompt = prompt_tokens
        r.max_tokens = budget
        r.max_tokens_param = max_tokens
        if ignore_eos or output_tokens > budget:
            r.target, r.stop_reason = budget, "length"
        else:
            r.target, r.stop_reason = output_tokens, "stop"
        r.prefix_blocks = prefix_tokens // self._B if (self._prefix_caching and prefix_id is not None) else 0
        r.prefix_id = prefix_id if r.prefix_blocks else None
        r.goal = prompt_tokens
        if trace:
            r.token_times = []
        self._reqs[request_id] = r
        self._waiting.append(r)
        self._n_waiting += 1
        self.arrived += 1

    def abort(self, request_id: str) -> bool:
        """The client went away: free the request's KV now. False if it is not in the engine."""
        r = self._reqs.get(request_id)
        if r is None:
            return False
        if r.state == WAITING:
            self._n_waiting -= 1  # left in the deque, skipped when reached
            self._host_used -= _ceil_div(r.host_tokens, self._B)
            r.host_tokens = 0
        elif r.state == PREFILL:
            self._unreserve(r)
            self._free(r.own_blocks)
            self._release_prefix(r)
            self._prefill_kv -= r.computed
            del self._prefilling[request_id]
            del self._running[request_id]
        else:  # DECODE, between steps
            self._unreserve(r)
            r.generated = self._leave_decode(r, self._s)
            self._free(self._own(r.base + self._s, r.prefix_blocks))
            self._release_prefix(r)
            del self._running[request_id]
        r.state = ABORTED
        r.finish_reason = "abort"
        r.t_finished = self.now
        self.aborted += 1
        self.stats.aborted += 1
        self._retire(r)
        return True

    def subscribe(self, request_id: str, callback: Callable[[TokenEvent], None]) -> None:
        """Call ``callback`` after every ``advance_to`` in which the request gained tokens or ended."""
        r = self._reqs.get(request_id)
        if r is None:
            raise KeyError(f"request id {request_id!r} is not in this engine")
        self._subs[request_id] = _Subscription(callback, r)

    def unsubscribe(self, request_id: str) -> None:
        self._subs.pop(request_id, None)

    # ------------------------------------------------------------------ clock

    def advance_to(self, t: float) -> None:
        """Run steps until the clock reaches ``t`` (the last step may end after ``t``), and tell
        subscribers what the steps that ended by ``t`` made. An idle engine jumps to the next
        arrival or to ``t``.

        A step's tokens reach a client after the step ends, as a real engine's do: subscribers
        hear before the step that would end past ``t`` (guessed from the last step's length: a
        longer step than guessed holds its predecessors' tokens to the next call, never shows
        its own early)."""
        while self.now < t:
            if not self._running:
                head = self._head()
                if head is None or head.arrival >= t:
                    self.now = t
                    break
                self.now = max(self.now, head.arrival)
            if self._subs and self.now + self._last_step_s > t:
                self._notify()
            if not self.step():
                head = self._head()  # nothing schedulable (future arrivals only)
                self.now = t if head is None else min(t, max(head.arrival, self.now))
        if self._subs and self.now <= t:
            self._notify()

    def run_until_idle(self, max_steps: int = 10_000_000) -> None:
        """Step until nothing is running or waiting (headless drains)."""
        for _ in range(max_steps):
            if not self._running:
                head = self._head()
                if head is None:
                    break
                self.now = max(self.now, head.arrival)
            self.step()
        if self._subs:
            self._notify()

    def _head(self) -> _Req | None:
        w = self._waiting
        while w and w[0].state == ABORTED:
            w.popleft()
        return w[0] if w else None

    # ------------------------------------------------------------------ one step

    def step(self) -> bool:
        """Schedule and run one engine step. False if nothing could be scheduled."""
        si = self._s
        bs = self._B
        budget = self._budget
        info = self.last_step
        info.start = self.now
        info.available_before = self._cap - self._used
        preempted = 0
        xfer_bytes = 0.0  # stored to the CPU tier by this step's preemptions
        load_bytes = 0.0  # loaded back for the requests it resumes
        self._grown = 0

        # 1. decode growth: one token per decoding sequence, a block when it crosses a boundary
        need = 0
        if self._n_dec:
            idx = -si % bs
            need = self._phase[idx]
            info.decode_block_demand = need
            while need > self._cap - self._used:
                xfer_bytes += self._preempt_tail(si)
                preempted += 1
                need = self._phase[idx]
            self._take(need)
            self._grown = 1
            budget -= self._n_dec
        else:
            info.decode_block_demand = 0

        # 2. partial prefills continue, in admission order
        prefill_tokens = 0
        completing: list[_Req] = []
        if self._prefilling:
            for r in list(self._prefilling.values()):
                if budget <= 0:
                    break
                if r.state != PREFILL:
                    continue  # preempted for an earlier request's chunk in this loop
                chunk = min(r.goal - r.computed, budget)
                after = r.computed + chunk
                blocks_after = self._own(after + (after == r.goal), r.prefix_blocks)
                new = blocks_after - r.own_blocks
                while new > self._cap - self._used and r.state == PREFILL:
                    xfer_bytes += self._preempt_tail(si)
                    preempted += 1
                if r.state != PREFILL:
                    break  # it was the newest left; everything after it is preempted too
                self._take(new)
                r.own_blocks = blocks_after
                self._compute(r, chunk)
                budget -= chunk
                prefill_tokens += chunk
                if after == r.goal:
                    completing.append(r)

        # 3. admit waiting requests (FCFS), only if nothing was preempted in this step
        admitted = 0
        onloaded: list[_Req] = []
        if not preempted:
            waiting = self._waiting
            now = self.now
            while waiting and budget > 0 and len(self._running) < self._max_seqs:
                r = waiting[0]
                if r.state == ABORTED:
                    waiting.popleft()
                    continue
                if r.arrival > now:
                    break
                used = self._admit(r, budget, si)
                if used < 0:
                    break
                waiting.popleft()
                admitted += 1
                budget -= used
                load_bytes += self._last_load_bytes  # 0 unless the CPU tier held some of its KV
                if r.state == DECODE:
                    onloaded.append(r)
                else:
                    prefill_tokens += used
                    if r.computed == r.goal:
                        completing.append(r)

        n_dec = self._n_dec
        if not n_dec and not prefill_tokens:
            self._grown = 0
            info.duration = 0.0
            info.decode_tokens = info.prefill_tokens = 0
            info.preempted, info.admitted = preempted, admitted
            return False

        # 4. run it: duration from the roofline, then results land at the step's end
        wait = 0.0
        if xfer_bytes or load_bytes:
            wait = self._host.move(self.now, xfer_bytes, load_bytes) - self.now
            alone = max(xfer_bytes, load_bytes) * self._t_per_xfer_byte
            self.stats.offload_queue_seconds += max(0.0, wait - alone)
        live = self._dec_base_sum + n_dec * si + self._prefill_kv
        t_mem = self._t_weights + live * self._t_per_kv_token
        t_cmp = (prefill_tokens + n_dec) * self._t_per_token_flops
        if self._cost is not None:
            d = self._cost.seconds(prefill_tokens, n_dec, live) + wait
        elif self._layout is None:
            d = self._overhead + (t_mem if t_mem > t_cmp else t_cmp) + wait
            if self._comm_fixed:  # TP all-reduces (0 at tp=1, so that path is the plain roofline)
                d += self._comm_fixed + (prefill_tokens + n_dec) * self._comm_per_token
        else:
            seqs = n_dec + len(self._prefilling)
            d = self._layout.seconds(prefill_tokens, n_dec, live, seqs) + wait
        t = self.now + d
        self.now = t
        self.busy_until = t
        self._s = si + 1
        self._grown = 0
        st = self.stats
        st.steps += 1
        st.busy_seconds += d
        self._last_step_s = d
        st.generation_tokens += n_dec + len(completing)
        if self._step_histograms:
            st.h_iteration_tokens.observe(prefill_tokens + n_dec)
            steady = n_dec - len(onloaded)
            if steady:
                st.h_itl.observe(d, steady)
            for r in onloaded:
                # loaded back from the CPU tier whole: it was preempted while decoding, so it has a last token
                assert r.t_last_token is not None
                st.h_itl.observe(t - r.t_last_token)
        if self._traced:
            for times in self._traced.values():
                times.append(t)

        done = self._finishing.pop(si, None)
        if done:
            for r in done:
                if r.state == DECODE and r.finish_step == si:
                    self._finish_decoding(r, si, t)
        for r in completing:
            self._prefill_done(r, t)

        info.duration = d
        info.decode_tokens = n_dec
        info.prefill_tokens = prefill_tokens
        info.preempted = preempted
        info.admitted = admitted
        return True

    # ------------------------------------------------------------------ block pool

    def _own(self, kv_tokens: int, prefix_blocks: int) -> int:
        """Blocks a sequence holds outside its shared prefix."""
        own = -(-kv_tokens // self._B) - prefix_blocks
        return own if own > 0 else 0

    def _take(self, n: int) -> None:
        self._used += n
        over = self._used + self._evictable - self._cap
        if over > 0:
            self._evict(over)

    def _free(self, n: int) -> None:
        self._used -= n

    def _evict(self, blocks: int) -> None:
        lru = self._lru
        while blocks > 0 and lru:
            pid, n = lru.popitem(last=False)
            del self._prefixes[pid]
            self._evictable -= n
            blocks -= n

    def _acquire_prefix(self, pid: str, n: int) -> int:
        """Reference the shared prefix ``pid`` of ``n`` blocks; return the cache-hit blocks."""
        entry = self._prefixes.get(pid)
        if entry is None:
            self._prefixes[pid] = [1, n]
            self._take(n)
            return 0
        if entry[0] == 0:
            del self._lru[pid]
            self._evictable -= n
            self._used += n
        entry[0] += 1
        return n

    def _release_prefix(self, r: _Req) -> None:
        pid = r.prefix_id
        if pid is None:
            return
        entry = self._prefixes[pid]
        entry[0] -= 1
        if entry[0] == 0:
            n = entry[1]
            self._used -= n
            self._evictable += n
            self._lru[pid] = n

    def _prefix_cost(self, r: _Req) -> int:
        """Blocks the prefix takes out of the allocatable pool if admitted now."""
        if r.prefix_id is None:
            return 0
        entry = self._prefixes.get(r.prefix_id)
        return r.prefix_blocks if entry is None or entry[0] == 0 else 0

    # ------------------------------------------------------------------ transitions

    def _admit(self, r: _Req, budget: int, si: int) -> int:
        """Try to start (or resume) the waiting request at the queue head. Returns the token
        budget it uses, or -1 if it does not fit (blocks, or budget without chunked prefill)."""
        bs = self._B
        pb, pid = r.prefix_blocks, r.prefix_id
        hit = 0
        if pid is not None and pid in self._prefixes:
            hit = pb * bs
        if r.host_tokens == r.goal:  # the CPU tier holds the whole sequence: load it, decode now
            start = r.goal
            chunk = 0
            blocks_after = self._own(r.goal + 1, pb)
            cost = 1
        else:
            # a fully cached prompt still computes its last token (as vLLM does)
            start = min(max(hit, r.host_tokens), r.goal - 1)
            remaining = r.goal - start
            chunk = remaining if remaining <= budget else (budget if self._chunked else -1)
            if chunk < 0:
                return -1
            after = start + chunk
            blocks_after = self._own(after + (after == r.goal), pb)
            cost = chunk
        if blocks_after + self._prefix_cost(r) > self._cap - self._used:
            return -1
        if self._admission != "none":
            want = r.prompt + (
                r.max_tokens
                if self._admission == "reserve_max_tokens"
                else min(r.max_tokens, self._output_budget)
            )
            if self._reserved and self._reserved + want > self._reserve_limit:
                return -1
            r.reserved = want
            self._reserved += want

        first = r.t_scheduled is None
        if pid is not None:
            self._acquire_prefix(pid, pb)
        self._take(blocks_after)
        r.own_blocks = blocks_after
        self._n_waiting -= 1
        self._running[r.rid] = r
        if first:
            r.t_scheduled = self.now
            r.cached = min(hit, r.prompt)
            if self._prefix_caching:
                self.stats.prefix_queries += r.prompt
                self.stats.prefix_hits += r.cached
        self._last_load_bytes = 0.0
        if r.host_tokens:
            loaded_blocks = max(0, _ceil_div(r.host_tokens, bs) - hit // bs)
            self._last_load_bytes = self._offload_transfer(loaded_blocks, load=True)
            self.stats.external_queries += r.goal
            self.stats.external_hits += r.host_tokens
            self._host_used -= _ceil_div(r.host_tokens, bs)
            r.host_tokens = 0
        r.computed = start
        if chunk == 0:
            r.own_blocks = 0
            self._join_decode(r, si)
            return cost
        r.state = PREFILL
        self._prefilling[r.rid] = r
        self._prefill_kv += start
        self._compute(r, chunk)
        return cost

    def _compute(self, r: _Req, chunk: int) -> None:
        """Prefill ``chunk`` tokens; the part below the request's high-water mark is recompute."""
        before = r.computed
        redo = min(before + chunk, r.high_water) - before
        if redo > 0:
            r.recomputed += redo
            self.stats.recomputed_tokens += redo
        r.computed = before + chunk
        self._prefill_kv += chunk

    def _prefill_done(self, r: _Req, t: float) -> None:
        del self._prefilling[r.rid]
        self._prefill_kv -= r.computed
        r.generated += 1
        st = self.stats
        last = r.t_last_token  # None until the first token (set together with t_first_token)
        if last is None:
            r.t_first_token = t
            st.prompt_tokens += r.prompt
            st.prompt_tokens_cached += r.cached
        else:
            st.h_itl.observe(t - last)
        r.t_last_token = t
        if r.token_times is not None:
            r.token_times.append(t)
        if r.generated >= r.target:
            self._end(r, r.own_blocks, t)
        else:
            r.own_blocks = 0
            self._join_decode(r, self._s)

    def _join_decode(self, r: _Req, anchor: int) -> None:
        """From ``anchor`` on, the sequence grows one token per step: tokens = base + step."""
        r.state = DECODE
        r.g0 = r.generated
        r.anchor = anchor
        base = r.prompt + r.generated - anchor
        r.base = base
        self._n_dec += 1
        self._dec_base_sum += base
        self._phase[base % self._B] += 1
        fs = anchor + r.target - r.generated - 1
        r.finish_step = fs
        lst = self._finishing.get(fs)
        if lst is None:
            self._finishing[fs] = [r]
        else:
            lst.append(r)
        if r.token_times is not None:
            self._traced[r.rid] = r.token_times

    def _leave_decode(self, r: _Req, si: int) -> int:
        """Take a sequence out of the decode batch; return its generated count before step si."""
        self._n_dec -= 1
        self._dec_base_sum -= r.base
        self._phase[r.base % self._B] -= 1
        r.finish_step = -1
        if r.token_times is not None:
            self._traced.pop(r.rid, None)
        return r.g0 + si - r.anchor

    def _finish_decoding(self, r: _Req, si: int, t: float) -> None:
        r.generated = self._leave_decode(r, si + 1)
        self._end(r, self._own(r.base + si + 1, r.prefix_blocks), t)

    def _unreserve(self, r: _Req) -> None:
        self._reserved -= r.reserved
        r.reserved = 0

    def _end(self, r: _Req, own_blocks: int, t: float) -> None:
        self._unreserve(r)
        self._free(own_blocks)
        self._release_prefix(r)
        del self._running[r.rid]
        r.state = FINISHED
        r.t_last_token = t
        r.t_finished = t
        r.finish_reason = r.stop_reason
        if r.stop_reason == "stop":
            self.completed += 1
        else:
            self.truncated += 1
        self._record_finished(r)
        self._retire(r)

    def _preempt_tail(self, si: int) -> float:
        """Preempt the most recently admitted running request; return offload bytes stored."""
        _, v = self._running.popitem()
        self._unreserve(v)
        bs = self._B
        if v.state == DECODE:
            v.generated = self._leave_decode(v, si)
            kv = v.prompt + v.generated
            own = self._own(kv + self._grown, v.prefix_blocks)
            v.t_last_token = self.now
        else:
            kv = v.computed
            own = v.own_blocks
            del self._prefilling[v.rid]
            self._prefill_kv -= kv
        self._free(own)
        self._release_prefix(v)
        v.high_water = max(v.high_water, kv)
        v.preemptions += 1
        self.stats.preemptions += 1
        v.state = WAITING
        v.goal = v.prompt + v.generated
        v.own_blocks = 0
        v.computed = 0
        stored = 0.0
        if self._host_cap and kv:
            blocks = _ceil_div(kv, bs)
            if self._host_used + blocks <= self._host_cap:
                self._host_used += blocks
                v.host_tokens = kv
                stored = self._offload_transfer(blocks, load=False)
        self._waiting.appendleft(v)
        self._n_waiting += 1
        return stored

    def _offload_transfer(self, blocks: int, *, load: bool) -> float:
        nbytes = blocks * self._block_bytes
        seconds = nbytes * self._t_per_xfer_byte
        st = self.stats
        if load:
            st.offload_load_bytes += nbytes
            st.offload_load_seconds += seconds
            st.h_offload_load_size.observe(nbytes)
        else:
            st.offload_store_bytes += nbytes
            st.offload_store_seconds += seconds
            st.h_offload_store_size.observe(nbytes)
        return nbytes

    def _record_finished(self, r: _Req) -> None:
        st = self.stats
        first, last, scheduled, finished = r.t_first_token, r.t_last_token, r.t_scheduled, r.t_finished
        # a request that ended by stop or length was scheduled and sampled at least one token
        assert first is not None and last is not None and scheduled is not None and finished is not None
        st.success[r.stop_reason] += 1
        st.h_prompt_tokens.observe(r.prompt)
        st.h_generation_tokens.observe(r.generated)
        st.h_max_num_generation_tokens.observe(r.max_tokens)
        if r.max_tokens_param is not None:
            st.h_params_max_tokens.observe(r.max_tokens_param)
        st.h_params_n.observe(1)
        st.h_prefill_kv_computed.observe(r.prompt - r.cached)
        st.h_num_preemptions.observe(r.preemptions)
        st.h_ttft.observe(first - r.arrival)
        st.h_e2e.observe(finished - r.arrival)
        st.h_queue.observe(scheduled - r.arrival)
        st.h_prefill.observe(first - scheduled)
        decode = last - first
        st.h_decode.observe(decode)
        st.h_inference.observe(last - scheduled)
        st.h_tpot.observe(decode / (r.generated - 1) if r.generated > 1 else 0.0)

    def _retire(self, r: _Req) -> None:
        del self._reqs[r.rid]
        view = self._view(r)
        if self._keep_finished:
            self._finished[r.rid] = view
            if len(self._finished) > self._keep_finished:
                self._finished.popitem(last=False)
        if self.on_finish is not None:
            self.on_finish(view)

    def _notify(self) -> None:
        ended = []
        for rid, sub in self._subs.items():
            r, last = sub.req, sub.last_generated
            gen = self._gen(r)
            if gen != last or r.state >= FINISHED:
                sub.last_generated = gen
                last_t = self.now if r.state == DECODE else r.t_last_token
                reason = r.finish_reason if r.state >= FINISHED else None
                sub.callback(TokenEvent(rid, gen, gen - last, last_t, reason))
                if reason is not None:
                    ended.append(rid)
        for rid in ended:
            del self._subs[rid]

    # ------------------------------------------------------------------ ground truth

    def _gen(self, r: _Req) -> int:
        return r.g0 + self._s - r.anchor if r.state == DECODE else r.generated

    def _kv_tokens(self, r: _Req) -> int:
        if r.state == DECODE:
            return r.base + self._s
        if r.state == PREFILL:
            return r.computed
        return 0

    def _view(self, r: _Req) -> RequestView:
        kv = self._kv_tokens(r)
        return RequestView(
            request_id=r.rid,
            state=_STATE_NAMES[r.state],
            prompt_tokens=r.prompt,
            generated_tokens=self._gen(r),
            kv_tokens=kv,
            kv_blocks=_ceil_div(kv, self._B),
            max_tokens=r.max_tokens,
            arrival=r.arrival,
            first_scheduled=r.t_scheduled,
            first_token=r.t_first_token,
            last_token=self.now if r.state == DECODE else r.t_last_token,
            finished=r.t_finished,
            finish_reason=r.finish_reason,
            preemptions=r.preemptions,
            recomputed_tokens=r.recomputed,
            cached_tokens=r.cached,
            offloaded_tokens=r.host_tokens,
            token_times=tuple(r.token_times) if r.token_times is not None else None,
        )

    def request(self, request_id: str) -> RequestView:
        """A live or recently finished request (the last ``keep_finished``)."""
        r = self._reqs.get(request_id)
        if r is not None:
            return self._view(r)
        try:
            return self._finished[request_id]
        except KeyError:
            raise KeyError(f"request id {request_id!r} is unknown to engine {self.name}") from None

    def first_token_at(self, request_id: str) -> float | bool | None:
        """First-token time of a live request (None: not yet); False if it is not in the system.
        Cheap (no snapshot): drivers poll it for patience deadlines."""
        r = self._reqs.get(request_id)
        return False if r is None else r.t_first_token

    def requests(self) -> list[RequestView]:
        """Every request in the system now (waiting and running)."""
        return [self._view(r) for r in self._reqs.values()]

    def running_ids(self) -> list[str]:
        return list(self._running)

    def waiting_ids(self) -> list[str]:
        """Queue order, preempted requests included (they sit at the front)."""
        return [r.rid for r in self._waiting if r.state == WAITING]

    def preempted_ids(self) -> list[str]:
        """Waiting requests that ran before and were preempted."""
        return [r.rid for r in self._waiting if r.state == WAITING and r.preemptions]

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._n_waiting

    @property
    def in_system(self) -> int:
        return len(self._reqs)

    @property
    def capacity_blocks(self) -> int:
        return self._cap

    @property
    def capacity_tokens(self) -> int:
        return self._cap * self._B

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def free_blocks(self) -> int:
        """Allocatable blocks: never-used plus cached-but-unreferenced prefix blocks (as vLLM)."""
        return self._cap - self._used

    @property
    def evictable_blocks(self) -> int:
        return self._evictable

    @property
    def kv_usage(self) -> float:
        """Used blocks / capacity: ``vllm:kv_cache_usage_perc`` (vLLM also excludes 1 null block)."""
        return self._used / self._cap

    @property
    def live_tokens(self) -> int:
        """Sum of KV tokens of running sequences."""
        return self._dec_base_sum + self._n_dec * self._s + self._prefill_kv

    @property
    def block_bytes(self) -> float:
        """Bytes of one block across the replica's GPUs."""
        return self._block_bytes

    @property
    def kv_bytes_in_use(self) -> float:
        return self._used * self._block_bytes

    @property
    def host_blocks_used(self) -> int:
        return self._host_used

    @property
    def host_capacity_blocks(self) -> int:
        return self._host_cap

    @property
    def preemptions_total(self) -> int:
        return self.stats.preemptions

    @property
    def recomputed_tokens_total(self) -> int:
        return self.stats.recomputed_tokens

    @property
    def steps(self) -> int:
        return self._s

    def has_work(self) -> bool:
        return bool(self._running) or self._n_waiting > 0

    def check_invariants(self) -> None:
        """Recount everything from the requests and compare with the aggregates (tests)."""
        bs = self._B
        own = 0
        for r in self._running.values():
            own += self._own(self._kv_tokens(r), r.prefix_blocks)
        shared = sum(n for ref, n in self._prefixes.values() if ref > 0)
        assert self._used == own + shared, (self._used, own, shared)
        assert 0 <= self._used <= self._cap
        assert self._evictable == sum(self._lru.values())
        assert self._used + self._evictable <= self._cap
        assert self.live_tokens == sum(self._kv_tokens(r) for r in self._running.values())
        assert self._n_waiting == len(self.waiting_ids())
        assert self._n_dec == sum(1 for r in self._running.values() if r.state == DECODE)
        assert len(self._running) <= self._max_seqs
        assert self._host_used == sum(_ceil_div(r.host_tokens, bs) for r in self._reqs.values())
