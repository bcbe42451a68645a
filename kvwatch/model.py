"""kvwatch's own records: what every source produces and every output consumes.

Frozen dataclasses only, no imports from the rest of kvwatch. A field an engine (or NVML) does
not expose is ``None``, never 0: "not measured" and "measured zero" are different facts.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from enum import StrEnum

# --------------------------------------------------------------------------------------------
# Identity vocabularies (bounded label values)
# --------------------------------------------------------------------------------------------

#: every engine an adapter reads (``engines/registry.ADAPTERS`` has exactly these keys)
BACKENDS = ("vllm", "sglang", "trtllm", "dynamo", "llamacpp", "tgi")

#: the largest token (or other) count kvwatch takes from outside: 2^31, well above any context window.
#: A larger one (1 followed by 400 zeros) is no count a request or a slot has, and Python's int would
#: carry it into float arithmetic that overflows; sources treat it as unknown.
MAX_COUNT = 2**31

#: KV tiers in plain words. Engines name them differently (KVBM "h2d" means host->disk when
#: offloading and host->device when onboarding); adapters translate into these.
TIERS = ("gpu", "host", "disk", "remote", "object")


class Outcome(StrEnum):
    """How a request ended, from the client's point of view (docs/metrics.md)."""

    COMPLETED = "completed"  # finish_reason stop (or tool_calls / eos)
    TRUNCATED = "truncated"  # finish_reason length: the token budget cut it
    ABORTED = "aborted"  # the client went away; upstream was cancelled at once
    ERROR = "error"  # upstream 5xx, refused connection, broken stream
    REJECTED = "rejected"  # 4xx: admission refused, bad request, body too large


OUTCOMES = tuple(o.value for o in Outcome)


# --------------------------------------------------------------------------------------------
# Length bands
# --------------------------------------------------------------------------------------------

MAX_BANDS = 12


def _fmt_tokens(n: int) -> str:
    if n and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


@dataclass(frozen=True, slots=True)
class LengthBands:
    """Output-length bands from ascending edges in tokens.

    Edges ``(1000, 5000, 10000, 20000)`` give ``0-1k, 1k-5k, 5k-10k, 10k-20k, 20k+``. A count equal
    to an edge belongs to the band above it (``[lo, hi)``), so a 1000-token output is ``1k-5k``.
    """

    edges: tuple[int, ...] = (1000, 5000, 10000, 20000)
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        edges = tuple(int(e) for e in self.edges)
        if not edges:
            raise ValueError("length bands need at least one edge")
        if any(e <= 0 for e in edges):
            raise ValueError(f"length band edges must be positive token counts, got {list(edges)}")
        if any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError(f"length band edges must be strictly ascending, got {list(edges)}")
        if len(edges) + 1 > MAX_BANDS:
            raise ValueError(f"at most {MAX_BANDS - 1} edges ({MAX_BANDS} bands) keep cardinality bounded")
        bounds = (0, *edges)
        names = [f"{_fmt_tokens(lo)}-{_fmt_tokens(hi)}" for lo, hi in zip(bounds, edges, strict=False)]
        names.append(f"{_fmt_tokens(edges[-1])}+")
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "names", tuple(names))

    def band_for(self, tokens: int | float | None) -> str:
        """Band name of a token count; ``unknown`` when the count is not known."""
        if tokens is None or (isinstance(tokens, float) and math.isnan(tokens)):
            return UNKNOWN_BAND
        return self.names[bisect.bisect_right(self.edges, tokens)]

    @property
    def all_names(self) -> tuple[str, ...]:
        """Every label value the band label can take, ``unknown`` included."""
        return (*self.names, UNKNOWN_BAND)


UNKNOWN_BAND = "unknown"
DEFAULT_BANDS = LengthBands()


# --------------------------------------------------------------------------------------------
# Engine replicas
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TierTraffic:
    """Cumulative KV traffic from one tier to another, as one engine family counts it.

    ``family`` names where the numbers came from (``vllm_offload``, ``vllm_offload_legacy``,
    ``vllm_tiering``, ``lmcache``, ``sglang_hicache``, ``sglang_storage``, ``kvbm``, ``trtllm``).
    Units the family does not count are ``None``.
    """

    family: str
    src_tier: str
    dst_tier: str
    bytes_total: float | None = None
    tokens_total: float | None = None
    blocks_total: float | None = None
    seconds_total: float | None = None


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A cumulative histogram as scraped: upper bounds (``inf`` last) with cumulative counts."""

    bounds: tuple[float, ...]
    cumulative_counts: tuple[float, ...]
    sum: float
    count: float


@dataclass(frozen=True, slots=True)
class ReplicaSample:
    """One engine replica (a data-parallel rank behind a scrape target) at one scrape."""

    replica: str  # configured target name
    backend: str  # one of BACKENDS
    scraped_at: float  # unix seconds
    model_name: str | None = None
    dp_rank: str | None = None  # vLLM `engine`, SGLang `dp_rank`; None when the engine has no ranks
    version_hint: str | None = None  # e.g. "vllm>=0.12 (kv_cache_usage_perc, no gpu_cache_usage_perc)"

    # capacity
    block_size: int | None = None  # tokens per KV block (page)
    num_gpu_blocks: int | None = None
    kv_capacity_tokens: float | None = None
    cache_dtype: str | None = None
    #: KV bytes one token slot takes on one GPU (worker) of the replica, as the engine sized its pool;
    #: with tensor or pipeline parallelism each GPU holds its share of every token
    kv_bytes_per_token: float | None = None

    # occupancy
    kv_usage_ratio: float | None = None  # the engine's own usage figure, 0..1
    kv_used_blocks: float | None = None
    kv_used_tokens: float | None = None  # token-exact slots in use, where the engine exports them
    kv_evictable_tokens: float | None = None  # cached-but-free (radix/prefix cache)
    live_tokens: float | None = None  # tokens held by running requests, measured by the engine

    # scheduling
    requests_running: float | None = None
    requests_waiting: float | None = None
    requests_swapped_or_paused: float | None = None

    # preemption / recompute (cumulative)
    preemptions_total: float | None = None
    recomputed_tokens_total: float | None = None  # engine-reported tokens of preempted requests

    # throughput and cache (cumulative)
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    #: the two token counters move when requests finish, not as tokens are made (SGLang's tokenizer
    #: counters): right for throughput over long windows, no measure of how fast the pool grows now
    token_counters_at_finish: bool = False
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    finished_requests_total: tuple[tuple[str, float], ...] = ()  # (finished_reason, count)

    tier_traffic: tuple[TierTraffic, ...] = ()
    # engine latency histograms kept for cross-checks (name -> snapshot), e.g. "ttft", "e2e", "itl",
    # "generation_tokens", "num_preemptions"
    histograms: tuple[tuple[str, HistogramSnapshot], ...] = ()

    def histogram(self, name: str) -> HistogramSnapshot | None:
        for key, snap in self.histograms:
            if key == name:
                return snap
        return None

    @property
    def key(self) -> tuple[str, str | None, str | None]:
        return (self.replica, self.model_name, self.dp_rank)


@dataclass(frozen=True, slots=True)
class SlotSample:
    """One llama.cpp slot (``/slots``): a sequence's context in use."""

    slot_id: int
    n_ctx: int | None
    tokens_in_use: int | None
    is_processing: bool


# --------------------------------------------------------------------------------------------
# GPUs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NvLinkSample:
    link: int
    active: bool | None = None
    tx_bytes_total: float | None = None
    rx_bytes_total: float | None = None


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """One process as /proc shows it to kvwatch.

    ``pid`` is the PID in kvwatch's own PID namespace (the host's with ``hostPID``). ``ns_pids`` is
    the ``NSpid`` chain from that namespace inwards, ``ns_pids[-1]`` being the PID the process
    sees itself (inside its container).
    """

    pid: int
    ppid: int | None = None
    ns_pids: tuple[int, ...] = ()
    children: tuple[int, ...] = ()
    cuda_visible_devices: str | None = None
    nvidia_visible_devices: str | None = None

    @property
    def all_pids(self) -> tuple[int, ...]:
        """Every number this process is known by (own namespace first)."""
        return tuple(dict.fromkeys((self.pid, *self.ns_pids)))


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    used_memory_bytes: float | None


@dataclass(frozen=True, slots=True)
class GpuGrant:
    """One device the kubelet allocated to a container (PodResources API): who holds which GPU.

    ``device_id`` is what the device plugin reported: a GPU UUID (NVIDIA's default), an index
    (``--device-id-strategy=index``), ``UUID::N`` for time-sliced replicas, ``nvidiaN`` on GKE,
    ``MIG-<uuid>`` for a MIG device (``nvidia.com/mig-*`` resources). ``dra``: a Dynamic Resource
    Allocation claim's device instead (``resource_name`` the DRA driver, ``device_id`` pool/device).
    """

    namespace: str
    pod: str
    container: str
    resource_name: str
    device_id: str
    dra: bool = False


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one poll. ``lost`` means NVML answered GPU_IS_LOST (fell off the bus)."""

    index: int
    uuid: str
    name: str | None = None
    pci_bus_id: str | None = None
    sampled_at: float = 0.0
    lost: bool = False

    memory_total_bytes: float | None = None
    memory_used_bytes: float | None = None
    memory_reserved_bytes: float | None = None
    memory_free_bytes: float | None = None

    utilization_gpu_ratio: float | None = None
    utilization_memory_ratio: float | None = None

    pcie_tx_bytes_total: float | None = None
    pcie_rx_bytes_total: float | None = None
    pcie_replay_total: float | None = None
    pcie_link_gen_current: int | None = None
    pcie_link_gen_max: int | None = None
    pcie_link_width_current: int | None = None
    pcie_link_width_max: int | None = None

    nvlinks: tuple[NvLinkSample, ...] = ()

    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules_total: float | None = None
    temperature_gpu_celsius: float | None = None
    temperature_memory_celsius: float | None = None
    sm_clock_hz: float | None = None
    memory_clock_hz: float | None = None

    #: (reason, active) for each clock-event reason NVML reports
    clock_event_reasons: tuple[tuple[str, bool], ...] = ()

    ecc_corrected_volatile_total: float | None = None
    ecc_uncorrected_volatile_total: float | None = None
    remapped_rows_correctable: float | None = None
    remapped_rows_uncorrectable: float | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None

    processes: tuple[GpuProcess, ...] = ()


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


#: the ``v`` of a request-ledger line: ``requests/ledger.py`` writes it, ``report/`` reads it
LEDGER_VERSION = 1


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request, from whichever source saw it (proxy, OTLP span, SGLang file).

    Times are seconds. ``gap_counts`` are this request's inter-chunk gaps binned on the bounds the
    source was given (``gap_bounds``, cumulative=False, last bin is +Inf), so per-chunk work stays a
    counter increment and records merge into histograms once.
    """

    replica: str
    model_name: str
    source: str  # proxy | otlp | sglang_file
    outcome: Outcome
    started_at: float  # unix seconds, request received
    endpoint: str | None = None  # chat | completions
    streaming: bool | None = None
    status_code: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    output_tokens_estimated: bool = False  # counted chunks instead of usage.completion_tokens
    max_tokens: int | None = None
    ttft_seconds: float | None = None
    e2e_seconds: float | None = None
    queue_seconds: float | None = None  # only engine-side sources know this
    decode_seconds: float | None = None  # engine-side first token -> last token
    chunks: int | None = None
    gap_bounds: tuple[float, ...] = ()
    gap_counts: tuple[int, ...] = ()
    gap_sum: float = 0.0
    max_gap_seconds: float | None = None  # the longest inter-chunk gap (proxy streams)
    max_gap_ended_at: float | None = None  # when it ended, in started_at's time base
    preemptions: int | None = None  # times the engine preempted it (vLLM plugin)
    prefill_seconds: float | None = None  # engine-side first scheduled -> first token (vLLM plugin)
    cached_prompt_tokens: int | None = None  # prompt tokens served from the prefix cache (vLLM plugin)
    #: fields whose value the source gave out of range (a count over 2^31): recorded as None
    dropped_values: tuple[str, ...] = ()
    #: the proxy's estimate of the prompt from the request body's size, where no usage came (a
    #: stream its client left): never mixed into ``prompt_tokens``, which only the engine's count fills
    prompt_tokens_estimate: int | None = None
    #: sequences the request ran (``n``, times a completions batch's prompts); ``output_tokens`` is
    #: a sequence's (the mean), so the request generated ``output_tokens x choices`` in all
    choices: int = 1

    @property
    def tpot_seconds(self) -> float | None:
        """TPOT, vLLM/OpenTelemetry definition: (e2e − TTFT) / (output_tokens − 1).

        The one place TPOT is computed (docs/metrics.md quotes this rule). Undefined (None) with
        fewer than two output tokens or without both times. Engine-side sources that report the
        decode span directly (``decode_seconds``) use it in place of e2e − TTFT.
        """
        if self.output_tokens is None or self.output_tokens < 2:
            return None
        if self.decode_seconds is not None:
            span = self.decode_seconds
        elif self.e2e_seconds is not None and self.ttft_seconds is not None:
            span = self.e2e_seconds - self.ttft_seconds
        else:
            return None
        return max(span, 0.0) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class InFlightRequest:
    """A request the proxy is relaying now (for live-token estimates and admission bands)."""

    replica: str
    model_name: str
    admission_band: str
    prompt_tokens_estimate: int
    generated_tokens: int
    started_at: float
    max_tokens: int | None = None


# --------------------------------------------------------------------------------------------
# Engine steps (the vLLM stat-logger plugin)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EvictionSample:
    """One sampled KV block eviction: how long the block lived, sat idle, and its reuse gaps."""

    lifetime_seconds: float | None
    idle_seconds: float | None
    reuse_gaps_seconds: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineStep:
    """One engine step of one DP rank, as vLLM reported it to its stat loggers.

    The batch shape and ``elapsed_ms`` exist only with vLLM's ``--enable-logging-iteration-details``;
    ``resumed_*`` are the prefix-cache lookups of previously preempted requests scheduled again.
    """

    replica: str
    dp_rank: str
    at: float  # unix seconds, the engine's clock
    running: int | None = None
    waiting: int | None = None
    kv_usage_ratio: float | None = None
    ctx_requests: int | None = None
    ctx_tokens: int | None = None
    gen_requests: int | None = None
    gen_tokens: int | None = None
    elapsed_ms: float | None = None
    preempted: int | None = None  # preemption events in this step
    resumed_requests: int | None = None
    resumed_queried_tokens: int | None = None  # None: vLLM did not count (prefix caching off)
    resumed_hit_tokens: int | None = None
    #: a KV connector's lookups for resumed requests: the tokens the local cache lacked, and what the
    #: connector loaded of them (OffloadingConnector, LMCache); None without a connector
    connector_resumed_queried_tokens: int | None = None
    connector_resumed_hit_tokens: int | None = None
    evictions: tuple[EvictionSample, ...] = ()
    evictions_left_out: int = 0

    @property
    def recomputed_tokens(self) -> int | None:
        """Tokens re-prefilled for resumed requests: looked up minus found, in the local prefix cache
        and then in the KV connector. With a connector its own lookup is the one that counts (it asks
        for what the local cache lacked, and with prefix caching off for everything); a local miss the
        connector loads is not recomputed. None where the engine did not count."""
        queried, hit = self.connector_resumed_queried_tokens, self.connector_resumed_hit_tokens
        if queried is not None and hit is not None:
            return max(0, queried - hit)
        if self.resumed_queried_tokens is None or self.resumed_hit_tokens is None:
            return None
        return max(0, self.resumed_queried_tokens - self.resumed_hit_tokens)

    @property
    def batch_tokens(self) -> int | None:
        if self.ctx_tokens is None or self.gen_tokens is None:
            return None
        return self.ctx_tokens + self.gen_tokens


@dataclass(frozen=True, slots=True)
class PluginLink:
    """Header facts of one plugin datagram: who sent it and what the sender dropped so far."""

    replica: str
    dp_rank: str
    pid: int | None
    seq: int | None
    dropped: int | None  # datagrams this engine process could not send so far
    dropped_steps: int | None = None  # the engine steps in them (None: a plugin that does not say)
    #: True: vLLM records prefix-cache lookups once per admission (0.27.0 on), so the recompute is
    #: exact; False: once per lookup (older vLLM), an upper bound; None: the plugin does not say
    per_admission: bool | None = None
