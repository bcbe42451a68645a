"""vLLM's ``/metrics`` for simulated engines: names, labels, buckets and HELP of vLLM 0.33 V1.

Every value is read from the engines' state at render time (nothing scripted). One exposition may
hold several DP ranks (``engine="0".."N-1"``: vLLM's internal load balancer behind one API server)
or one rank (one server per rank). Rendered by prometheus_client, the library vLLM itself uses, so
the text format quirks match (``_created`` families, ``le="1.0"``, ``le="1e+06"``, sorted labels).
Latencies are simulated seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample

from kvwatch.buckets import Histogram
from kvwatch.sim.engine import SimEngine
from kvwatch.sim.stats import FINISH_REASONS

_LABELS = ["engine", "model_name"]

# (family name, HELP, EngineStats attribute); vLLM 0.32/0.33 loggers.py wording
_HISTOGRAMS = (
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "h_prompt_tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", "h_generation_tokens"),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", "h_iteration_tokens"),
    (
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        "h_max_num_generation_tokens",
    ),
    ("vllm:request_params_n", "Histogram of the n request parameter.", "h_params_n"),
    (
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        "h_params_max_tokens",
    ),
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "h_ttft"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "h_itl"),
    (
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        "h_tpot",
    ),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "h_e2e"),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "h_queue"),
    (
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        "h_inference",
    ),
    (
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        "h_prefill",
    ),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", "h_decode"),
    (
        "vllm:request_num_preemptions",
        "Histogram of the number of times a request was preempted.",
        "h_num_preemptions",
    ),
    (
        "vllm:request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        "h_prefill_kv_computed",
    ),
)


class _Families:
    """The collector prometheus_client renders: yields const families built from the engines."""

    def __init__(self, engines: Sequence[SimEngine], model_name: str, created: float) -> None:
        self.engines = engines
        self.model_name = model_name
        self.created = created

    def collect(self) -> Iterator[Metric]:
        engines, model, created = self.engines, self.model_name, self.created
        per = [([e.name, model], e) for e in engines]

        def gauge(name: str, doc: str, value_of: Callable[[SimEngine], float]) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, doc, labels=_LABELS)
            for labels, e in per:
                fam.add_metric(labels, float(value_of(e)))
            return fam

        def counter(name: str, doc: str, value_of: Callable[[SimEngine], float]) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, doc, labels=_LABELS)
            for labels, e in per:
                fam.add_metric(labels, float(value_of(e)), created=created)
            return fam

        def counter_by(
            name: str,
            doc: str,
            value_of: Callable[[SimEngine, str], float],
            label: str,
            values: Sequence[str],
        ) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, doc, labels=[*_LABELS, label])
            for labels, e in per:
                for v in values:
                    fam.add_metric([*labels, v], float(value_of(e, v)), created=created)
            return fam

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            lambda e: e.num_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            lambda e: e.num_waiting,
        )
        fam = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
            "status). Sum of all reasons equals vllm:num_requests_waiting.",
            labels=[*_LABELS, "reason"],
        )
        for labels, e in per:
            fam.add_metric([*labels, "capacity"], float(e.num_waiting))
            fam.add_metric([*labels, "deferred"], 0.0)
        yield fam
        fam = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            labels=[*_LABELS, "sleep_state"],
        )
        for labels, _ in per:
            for state, value in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)):
                fam.add_metric([*labels, state], value)
        yield fam
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda e: e.kv_usage
        )

        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            lambda e: e.stats.prefix_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            lambda e: e.stats.prefix_hits,
        )
        yield counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
            "number of queried tokens.",
            lambda e: e.stats.external_queries,
        )
        yield counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number "
            "of cached tokens.",
            lambda e: e.stats.external_hits,
        )
        yield counter(
            "vllm:mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items.",
            lambda e: 0,
        )
        yield counter(
            "vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.", lambda e: 0
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            lambda e: e.stats.preemptions,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", lambda e: e.stats.prompt_tokens
        )
        yield counter_by(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            lambda e, src: {
                "local_compute": e.stats.prompt_tokens - e.stats.prompt_tokens_cached,
                "local_cache_hit": e.stats.prompt_tokens_cached,
            }.get(src, 0),
            "source",
            ("local_compute", "local_cache_hit", "external_kv_transfer"),
        )
        yield counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            lambda e: e.stats.prompt_tokens_cached,
        )
        yield counter_by(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
            "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            lambda e, src: {"device": e.stats.prefix_hits, "host": e.stats.external_hits}.get(src, 0),
            "source",
            ("device", "host", "disk", "p2p", "external_unspecified"),
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            lambda e: e.stats.generation_tokens,
        )
        yield counter_by(
            "vllm:request_success",
            "Count of successfully processed requests.",
            lambda e, reason: e.stats.success[reason],
            "finished_reason",
            FINISH_REASONS,
        )
        rejections = CounterMetricFamily(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            labels=["model_name", "reason"],
        )
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            rejections.add_metric([model, reason], 0.0, created=created)
        yield rejections

        for name, doc, attr in _HISTOGRAMS:
            yield _histogram(name, doc, [(labels, getattr(e.stats, attr)) for labels, e in per], created)

        yield _cache_config_info(engines)
        if any(e.host_capacity_blocks for e in engines):
            yield from _offload_families(per, created)


def _histogram(
    name: str,
    doc: str,
    rows: list[tuple[list[str], Histogram]],
    created: float,
    labelnames: list[str] = _LABELS,
) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=labelnames)
    for labels, h in rows:
        fam.add_metric(labels, h.cumulative(), h.sum)
        fam.samples.append(Sample(name + "_created", dict(zip(labelnames, labels, strict=True)), created))
    return fam


def _cache_config_info(engines: Sequence[SimEngine]) -> GaugeMetricFamily:
    """``vllm:cache_config_info``: every CacheConfig field as a label (vLLM 0.32's field set)."""
    rows = []
    for e in engines:
        c = e.config
        tokens = e.capacity_tokens
        labels = {
            "_block_size_resolved": "True",
            "block_size": str(c.block_size),
            "cache_dtype": c.kv_cache_dtype,
            "enable_prefix_caching": str(c.enable_prefix_caching),
            "engine": e.name,
            "gpu_memory_utilization": str(c.gpu_memory_utilization),
            "is_attention_free": "False",
            "kv_cache_max_concurrency": str(round(tokens / c.context_len, 2)),
            # as if started with --kv-cache-memory-bytes sized to whole blocks (the real 0.32 capture
            # carries the budget here): per GPU, every block including vLLM's null block
            "kv_cache_memory_bytes": str(round(tokens * e.memory_plan.kv_bytes_per_token_per_gpu)),
            "kv_cache_size_tokens": str(tokens),
            "kv_offloading_backend": "native",
            "kv_offloading_size": str(c.kv_offload_bytes / 2**30) if c.kv_offload_bytes else "None",
            "kv_sharing_fast_prefill": "False",
            "mamba_block_size": "None",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(e.capacity_blocks),
            "num_gpu_blocks_override": str(c.num_gpu_blocks_override),
            "prefix_caching_hash_algo": "sha256",
            "sliding_window": "None",
        }
        rows.append(labels)
    fam = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(rows[0])
    )
    for labels in rows:
        fam.add_metric(list(labels.values()), 1.0)
    return fam


def _offload_families(per: list[tuple[list[str], SimEngine]], created: float) -> Iterator[Metric]:
    """Native CPU offloading (``OffloadingConnector``): flat 0.24+ names plus the legacy
    ``transfer_type`` form vLLM 0.33 still emits for the CPU spec."""
    pairs = (
        (
            "load",
            "offload_load",
            "h_offload_load_size",
            "CPU_to_GPU",
            "loaded from offload storage to GPU",
            "load time from offload storage to GPU",
        ),
        (
            "store",
            "offload_store",
            "h_offload_store_size",
            "GPU_to_CPU",
            "stored from GPU to offload storage",
            "store time from GPU to offload storage",
        ),
    )
    legacy_bytes = CounterMetricFamily(
        "vllm:kv_offload_total_bytes",
        "Number of bytes offloaded by KV connector",
        labels=[*_LABELS, "transfer_type"],
    )
    legacy_time = CounterMetricFamily(
        "vllm:kv_offload_total_time",
        "Total time measured by all KV offloading operations",
        labels=[*_LABELS, "transfer_type"],
    )
    legacy_rows = []
    for direction, attr, hist, transfer_type, what, what_time in pairs:
        nbytes = CounterMetricFamily(
            f"vllm:kv_offload_{direction}_bytes", f"Total bytes {what}.", labels=_LABELS
        )
        seconds = CounterMetricFamily(
            f"vllm:kv_offload_{direction}_time", f"Total {what_time}, in seconds.", labels=_LABELS
        )
        for labels, e in per:
            b = getattr(e.stats, attr + "_bytes")
            s = getattr(e.stats, attr + "_seconds")
            nbytes.add_metric(labels, b, created=created)
            seconds.add_metric(labels, s, created=created)
            legacy_bytes.add_metric([*labels, transfer_type], b, created=created)
            legacy_time.add_metric([*labels, transfer_type], s, created=created)
            legacy_rows.append(([*labels, transfer_type], getattr(e.stats, hist)))
        yield nbytes
        yield seconds
        yield _histogram(
            f"vllm:kv_offload_{direction}_size",
            f"Histogram of KV offload {direction} operation size, in bytes.",
            [(labels, getattr(e.stats, hist)) for labels, e in per],
            created,
        )
    yield legacy_bytes
    yield legacy_time
    yield _histogram(
        "vllm:kv_offload_size",
        "Histogram of KV offload transfer size, in bytes.",
        legacy_rows,
        created,
        [*_LABELS, "transfer_type"],
    )
    info = GaugeMetricFamily(
        "vllm:kv_offload_config_info",
        "KV offloading configuration",
        labels=[*_LABELS, "cpu_kv_cache_size_bytes", "cpu_kv_cache_size_tokens"],
    )
    for labels, e in per:
        blocks = e.host_capacity_blocks
        info.add_metric([*labels, str(int(blocks * e.block_bytes)), str(blocks * e.config.block_size)], 1.0)
    yield info


def render_vllm_metrics(engines: Sequence[SimEngine], model_name: str, created: float) -> bytes:
    """The text exposition (format 0.0.4) of these DP ranks, as one vLLM API server serves it.
    ``created`` is the unix time the server started (the ``_created`` samples)."""
    return generate_latest(_Families(engines, model_name, created))
