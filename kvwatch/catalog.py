"""Every metric family kvwatch exports: name, type, labels, help. The one contract.

Collectors build their families from these specs (``spec.gauge()``, ``spec.counter()``, ...), the
rule and dashboard generators refuse queries on names that are not here, and docs/metrics.md is
generated from this table (``kvwatch docs --check``). Add a family here before exporting it.
The ``process_*`` and ``python_info`` families are prometheus_client's own (its ProcessCollector and
PlatformCollector on the agent's registry): listed here with their standard names and help so that
the same checks, budgets and docs cover them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar, get_args

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

REPLICA = ("replica", "model_name", "backend", "dp_rank")
#: namespace, pod, container: who the kubelet allocated the GPU to (PodResources API; empty off Kubernetes)
GPU = ("gpu", "uuid", "namespace", "pod", "container")
REQUEST = ("replica", "model_name", "length_band", "source")

#: label values of kvwatch_target_scrape_errors_total{reason}: why a scrape of an engine failed
SCRAPE_ERROR_REASONS = (
    "timeout",
    "connect",
    "http_status",
    "too_large",
    "malformed",
    "not_metrics",
    "no_engine_metrics",
)
#: label values of kvwatch_target_samples_rejected_total{reason}: engine samples that cannot be true
#: (dropped), and label values over the per-page cap (folded into "other")
REJECTED_SAMPLE_REASONS = ("not_finite", "negative_counter", "duplicate", "label_values_cap")


#: a family's Prometheus type
Kind = Literal["gauge", "counter", "histogram", "info"]
#: which export collector renders the family (``kvwatch/export/``), and its section in docs/metrics.md
Area = Literal["self", "replica", "derived", "gpu", "request", "plugin"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # exposed name without _total / _bucket / _info suffixes
    kind: Kind
    labels: tuple[str, ...]
    help: str
    area: Area

    def __post_init__(self) -> None:
        """mypy checks the literals; this catches a value built at run time (a cast, a ``# type: ignore``)."""
        if self.kind not in get_args(Kind) or self.area not in get_args(Area):
            raise ValueError(
                f"{self.name}: kind {self.kind!r} or area {self.area!r} is not one of {Kind}, {Area}"
            )

    def gauge(self) -> GaugeMetricFamily:
        assert self.kind == "gauge", self.name
        return GaugeMetricFamily(self.name, self.help, labels=self.labels)

    def counter(self) -> CounterMetricFamily:
        assert self.kind == "counter", self.name
        return CounterMetricFamily(self.name, self.help, labels=self.labels)

    def histogram(self) -> HistogramMetricFamily:
        assert self.kind == "histogram", self.name
        return HistogramMetricFamily(self.name, self.help, labels=self.labels)

    def info(self) -> InfoMetricFamily:
        assert self.kind == "info", self.name
        return InfoMetricFamily(self.name, self.help, labels=self.labels)

    @property
    def series_names(self) -> tuple[str, ...]:
        """Names that appear on the wire for this family."""
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        if self.kind == "info":
            return (f"{self.name}_info",)
        return (self.name,)


def _m(name: str, kind: Kind, labels: tuple[str, ...], help_: str, area: Area) -> MetricSpec:
    return MetricSpec(name, kind, labels, help_, area)


CATALOG: tuple[MetricSpec, ...] = (
    # ---- kvwatch itself ---------------------------------------------------------------------
    _m(
        "kvwatch_build",
        "info",
        ("version", "python", "nvidia_ml_py", "node"),
        "kvwatch version and runtime.",
        "self",
    ),
    _m(
        "kvwatch_collector_success",
        "gauge",
        ("collector",),
        "1 if the collector's last run succeeded, 0 if it failed.",
        "self",
    ),
    _m(
        "kvwatch_collector_duration_seconds",
        "gauge",
        ("collector",),
        "Duration of the collector's last run.",
        "self",
    ),
    _m(
        "kvwatch_source_last_success_timestamp_seconds",
        "gauge",
        ("source",),
        "Unix time of the source's last successful poll or receive; staleness = time() - this.",
        "self",
    ),
    _m(
        "kvwatch_target_up",
        "gauge",
        ("replica", "backend"),
        "1 if the replica's last metrics scrape succeeded and parsed, else 0.",
        "self",
    ),
    _m(
        "kvwatch_target_scrape_duration_seconds",
        "gauge",
        ("replica",),
        "Duration of the last scrape of the replica's metrics endpoint.",
        "self",
    ),
    _m(
        "kvwatch_target_scrape_errors",
        "counter",
        ("replica", "reason"),
        f"Failed scrapes of a replica by reason ({', '.join(SCRAPE_ERROR_REASONS)}).",
        "self",
    ),
    _m(
        "kvwatch_target_samples_rejected",
        "counter",
        ("replica", "reason"),
        "Engine page samples kvwatch did not take as they were, by reason: dropped because no engine "
        "quantity can be that (not_finite: NaN or ±Inf; negative_counter; duplicate: a series repeated, "
        "never summed), or folded into the label value other (label_values_cap: over "
        "scrape.max_label_values / scrape.max_ranks distinct values).",
        "self",
    ),
    _m(
        "kvwatch_target_restarts",
        "counter",
        ("replica",),
        "Engine restarts detected (engine counters went backwards).",
        "self",
    ),
    _m(
        "kvwatch_proxy_accounting_errors",
        "counter",
        ("replica",),
        "Exceptions inside kvwatch's request accounting; the client's stream kept flowing.",
        "self",
    ),
    _m(
        "kvwatch_proxy_connections_timed_out",
        "counter",
        ("replica",),
        "Client connections closed because headers or body did not arrive in time.",
        "self",
    ),
    _m(
        "kvwatch_proxy_requests_shed",
        "counter",
        ("replica", "reason"),
        "Requests answered 503 by a proxy limit: buffer (proxy.max_buffered_bytes), connections "
        "(proxy.max_connections).",
        "self",
    ),
    _m(
        "kvwatch_proxy_accept_errors",
        "counter",
        ("replica",),
        "accept() failures on a proxy's listener (out of file descriptors); clients waited or were dropped.",
        "self",
    ),
    _m(
        "kvwatch_proxy_worker_restarts",
        "counter",
        (),
        "Relay worker processes (proxy.workers) that exited and were restarted.",
        "self",
    ),
    _m(
        "kvwatch_proxy_worker_records_lost",
        "counter",
        ("replica", "reason"),
        "Requests a relay worker relayed whose record never reached the agent: worker_died (it was in flight "
        "in a worker that exited), backlog (the worker's channel to the agent was full).",
        "self",
    ),
    _m(
        "kvwatch_proxy_worker_datagrams_refused",
        "counter",
        (),
        "Datagrams on a relay worker's accounting channel the agent refused as malformed (nothing of them "
        "applied).",
        "self",
    ),
    _m(
        "kvwatch_proxy_usage_injection_refused",
        "counter",
        ("replica",),
        "Streams whose engine refused the body with stream_options.include_usage and took the client's own "
        "(counted from chunks).",
        "self",
    ),
    _m(
        "kvwatch_proxy_requests_refused",
        "counter",
        ("replica", "status"),
        "Requests kvwatch answered itself while reading them, by the status it answered: 400 malformed, "
        "413 body over proxy.max_body_bytes, 431 head over 64 KiB, 503 buffer budget.",
        "self",
    ),
    _m(
        "kvwatch_proxy_refusals_undelivered",
        "counter",
        ("replica", "status"),
        "Of kvwatch_proxy_requests_refused_total: refusals whose client had already left, so nobody read "
        "the answer.",
        "self",
    ),
    _m(
        "kvwatch_otlp_spans",
        "counter",
        ("result",),
        "OTLP spans received, by result (request, ignored, malformed, unmapped: no configured replica).",
        "self",
    ),
    _m(
        "kvwatch_otlp_exports_refused",
        "counter",
        ("reason",),
        "OTLP exports refused: body_too_large (otlp.max_body_bytes, 413), inflated_too_large "
        "(otlp.max_decompressed_bytes, 413), undecodable (400), ledger_busy (503 with Retry-After: the "
        "request ledger had no room for the whole export; the sender sends it again).",
        "self",
    ),
    _m(
        "kvwatch_request_file_lines",
        "counter",
        ("replica", "result"),
        "SGLang request-metrics file lines read, by result (request, malformed).",
        "self",
    ),
    _m(
        "kvwatch_request_values_dropped",
        "counter",
        ("replica", "source", "reason"),
        "Counts a request source supplied out of range (over 2^31: usage tokens, max_tokens, preemptions, "
        "plugin step counts), left out as unknown while the request was still recorded; reason is "
        "<field>_out_of_range (output_tokens, prompt_tokens, max_tokens, preemptions, "
        "cached_prompt_tokens, step_<key>).",
        "self",
    ),
    _m(
        "kvwatch_ledger_write_errors",
        "counter",
        (),
        "Request ledger lines that could not be written (disk errors, or a full queue of one-at-a-time "
        "lines; OTLP exports are refused instead, never dropped).",
        "self",
    ),
    # ---- the agent process, by prometheus_client's own ProcessCollector and PlatformCollector -----
    # (standard names and help, as every client_python process exports them; Linux only, from /proc)
    _m("process_resident_memory_bytes", "gauge", (), "Resident memory size in bytes.", "self"),
    _m("process_virtual_memory_bytes", "gauge", (), "Virtual memory size in bytes.", "self"),
    _m("process_cpu_seconds", "counter", (), "Total user and system CPU time spent in seconds.", "self"),
    _m("process_open_fds", "gauge", (), "Number of open file descriptors.", "self"),
    _m("process_max_fds", "gauge", (), "Maximum number of open file descriptors.", "self"),
    _m(
        "process_start_time_seconds",
        "gauge",
        (),
        "Start time of the process since unix epoch in seconds.",
        "self",
    ),
    _m(
        "python_info",
        "gauge",
        ("implementation", "major", "minor", "patchlevel", "version"),
        "Python platform information",
        "self",
    ),
    _m(
        "kvwatch_config_last_reload_successful",
        "gauge",
        (),
        "1 if the last config reload (SIGHUP or a changed file) was valid and applied, 0 if it was refused "
        "and the running config kept.",
        "self",
    ),
    _m(
        "kvwatch_config_last_reload_success_timestamp_seconds",
        "gauge",
        (),
        "Unix time of the last successful config load (start or reload).",
        "self",
    ),
    _m(
        "kvwatch_discovery_stale",
        "gauge",
        (),
        "1 while the Kubernetes API cannot be reached and the last known pods are kept as replicas.",
        "self",
    ),
    _m(
        "kvwatch_discovery_replicas",
        "gauge",
        (),
        "Engine pods on this node discovered as replicas now (Kubernetes discovery).",
        "self",
    ),
    _m(
        "kvwatch_discovery_replica_ready",
        "gauge",
        ("replica",),
        "1 while a discovered replica's pod is Ready, 0 while it is Running but not Ready (failing its "
        "readiness probe): it stays a replica, its series kept, as Prometheus' pod discovery keeps the "
        "target.",
        "self",
    ),
    _m(
        "kvwatch_discovery_pod_annotation_errors",
        "gauge",
        ("namespace", "pod", "annotation"),
        "1 while a pod's kvwatch.io annotation is malformed; the pod is not scraped until it is fixed.",
        "self",
    ),
    _m(
        "kvwatch_discovery_watch_events",
        "counter",
        ("type",),
        "Pod watch events applied, by type (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR).",
        "self",
    ),
    _m(
        "kvwatch_discovery_watch_errors",
        "counter",
        ("reason",),
        "Pod list/watch failures by reason (unreachable, http_status, gone, too_large_resource_version, "
        "malformed, too_large, truncated, error_event, internal).",
        "self",
    ),
    _m(
        "kvwatch_discovery_relists",
        "counter",
        (),
        "Pod lists repeated because the resourceVersion was gone (410) or not yet in this API server's "
        "watch cache (504 too large resource version).",
        "self",
    ),
    _m(
        "kvwatch_vllm_plugin_datagrams",
        "counter",
        ("replica", "result"),
        "Datagrams received from the vLLM stat-logger plugin, by result (accepted; malformed, oversized, "
        "unknown_version: dropped).",
        "self",
    ),
    _m(
        "kvwatch_vllm_plugin_refused_requests",
        "counter",
        ("replica", "reason"),
        "Finished requests in accepted vLLM plugin datagrams that were refused one by one, by reason "
        "(negative_duration: an older plugin sent vLLM's negative time of a request that never got that "
        "far; malformed); the rest of their datagram is kept.",
        "self",
    ),
    _m(
        "kvwatch_vllm_plugin_dropped_datagrams",
        "counter",
        ("replica", "dp_rank"),
        "Datagrams the vLLM plugin could not send (no agent listening, or its queue full), as the "
        "engine reports it in the next datagram that gets through.",
        "plugin",
    ),
    _m(
        "kvwatch_vllm_plugin_dropped_steps",
        "counter",
        ("replica", "dp_rank"),
        "Timed engine steps (vLLM's --enable-logging-iteration-details) in the datagrams the vLLM plugin "
        "could not send: what kvwatch_engine_step_seconds misses of the engine's iterations since it "
        "started, as the next datagram that gets through says.",
        "plugin",
    ),
    # ---- engine replicas (as the engine reports them) -----------------------------------------
    _m(
        "kvwatch_replica",
        "info",
        (*REPLICA, "version_hint", "cache_dtype"),
        "Replica identity: one series per replica and data-parallel rank.",
        "replica",
    ),
    _m(
        "kvwatch_kv_capacity_tokens",
        "gauge",
        REPLICA,
        "KV cache capacity in tokens (num_gpu_blocks x block_size, or the engine's token count).",
        "replica",
    ),
    _m(
        "kvwatch_kv_capacity_bytes",
        "gauge",
        REPLICA,
        "KV cache capacity in bytes on each GPU of the replica (capacity tokens x KV bytes per token), "
        "where the KV bytes per token are known.",
        "replica",
    ),
    _m("kvwatch_kv_block_size_tokens", "gauge", REPLICA, "Tokens per KV block (page).", "replica"),
    _m(
        "kvwatch_kv_usage_ratio",
        "gauge",
        REPLICA,
        "KV occupancy as the engine reports it (vLLM: blocks held by live requests; SGLang: tokens).",
        "replica",
    ),
    _m("kvwatch_kv_used_blocks", "gauge", REPLICA, "KV blocks in use.", "replica"),
    _m(
        "kvwatch_kv_used_tokens",
        "gauge",
        REPLICA,
        "KV token slots in use, where the engine counts tokens exactly (SGLang).",
        "replica",
    ),
    _m(
        "kvwatch_kv_evictable_tokens",
        "gauge",
        REPLICA,
        "KV token slots held only by the prefix/radix cache (free on demand).",
        "replica",
    ),
    _m(
        "kvwatch_kv_free_tokens",
        "gauge",
        REPLICA,
        "KV token slots a request could still be given: the usable pool (vLLM never hands out its "
        "null block) minus the slots requests hold; evictable prefix-cache slots count as free.",
        "replica",
    ),
    _m("kvwatch_requests_running", "gauge", REPLICA, "Requests in the engine's running batch.", "replica"),
    _m("kvwatch_requests_waiting", "gauge", REPLICA, "Requests waiting in the engine's queue.", "replica"),
    _m(
        "kvwatch_preemptions",
        "counter",
        REPLICA,
        "Preemptions (vLLM) or retractions (SGLang) counted by the engine.",
        "replica",
    ),
    _m("kvwatch_prompt_tokens", "counter", REPLICA, "Prompt tokens processed by the engine.", "replica"),
    _m("kvwatch_generation_tokens", "counter", REPLICA, "Output tokens generated by the engine.", "replica"),
    _m(
        "kvwatch_prefix_cache_queried_tokens",
        "counter",
        REPLICA,
        "Prompt tokens looked up in the GPU prefix cache.",
        "replica",
    ),
    _m(
        "kvwatch_prefix_cache_hit_tokens",
        "counter",
        REPLICA,
        "Prompt tokens found in the GPU prefix cache.",
        "replica",
    ),
    _m(
        "kvwatch_engine_finished_requests",
        "counter",
        (*REPLICA, "finished_reason"),
        "Requests the engine finished, by the engine's finish reason.",
        "replica",
    ),
    _m(
        "kvwatch_kv_tier_transfer_bytes",
        "counter",
        (*REPLICA, "family", "src_tier", "dst_tier"),
        "KV bytes moved between tiers (gpu, host, disk, remote, object), per engine metric family.",
        "replica",
    ),
    _m(
        "kvwatch_kv_tier_transfer_tokens",
        "counter",
        (*REPLICA, "family", "src_tier", "dst_tier"),
        "KV tokens moved between tiers, where the engine counts tokens.",
        "replica",
    ),
    _m(
        "kvwatch_kv_tier_transfer_blocks",
        "counter",
        (*REPLICA, "family", "src_tier", "dst_tier"),
        "KV blocks moved between tiers, where the engine counts blocks (Dynamo KVBM).",
        "replica",
    ),
    _m(
        "kvwatch_kv_tier_transfer_seconds",
        "counter",
        (*REPLICA, "family", "src_tier", "dst_tier"),
        "Time spent moving KV between tiers, where the engine measures it.",
        "replica",
    ),
    _m(
        "kvwatch_replica_gpu",
        "info",
        ("replica", "dp_rank", "gpu", "uuid", "mapped_by"),
        "Which GPUs a replica runs on (mapped_by: config, pod_resources, pid, cuda_visible_devices).",
        "replica",
    ),
    # ---- derived KV signals --------------------------------------------------------------------
    _m(
        "kvwatch_kv_live_tokens",
        "gauge",
        (*REPLICA, "source"),
        "Tokens held by running requests; source=engine is measured, source=proxy_estimate is the "
        "proxy's in-flight accounting.",
        "derived",
    ),
    _m(
        "kvwatch_kv_fragmentation_ratio",
        "gauge",
        (*REPLICA, "source"),
        "Internal fragmentation: 1 - live tokens / (used blocks x block size).",
        "derived",
    ),
    _m(
        "kvwatch_kv_headroom_seconds",
        "gauge",
        REPLICA,
        "Seconds until the KV pool is full at the current net growth; +Inf when not growing.",
        "derived",
    ),
    _m(
        "kvwatch_kv_overcommitted_requests",
        "gauge",
        REPLICA,
        "Running requests whose max_tokens could not all fit if every request ran to its limit.",
        "derived",
    ),
    _m(
        "kvwatch_kv_stranded_tokens",
        "gauge",
        ("model_name",),
        "Free KV tokens on idle replicas of a model while another replica of it queues or preempts.",
        "derived",
    ),
    _m(
        "kvwatch_recomputed_tokens",
        "counter",
        (*REPLICA, "source"),
        "Tokens recomputed after preemption; source=engine is reported, source=vllm_plugin is exact "
        "(re-prefilled tokens of resumed requests, from vLLM's prefix-cache and KV connector stats), "
        "source=vllm_plugin_upper_bound is that figure from a vLLM before 0.27.0 (it counts every lookup "
        "of a resumed request, also those it could not be scheduled after), source=estimate is "
        "preemptions x mean live tokens per running request (kept beside an upper bound, and where "
        "vLLM cannot count: prefix caching off without a KV connector).",
        "derived",
    ),
    _m(
        "kvwatch_engine_step_seconds",
        "histogram",
        ("replica", "dp_rank", "batch_tokens"),
        "Engine step time by scheduled tokens in the step (vLLM plugin, --enable-logging-iteration-details).",
        "plugin",
    ),
    _m(
        "kvwatch_kv_block_lifetime_seconds",
        "histogram",
        ("replica", "dp_rank"),
        "Sampled KV blocks: allocation to eviction (vLLM plugin, --kv-cache-metrics).",
        "plugin",
    ),
    _m(
        "kvwatch_kv_block_idle_seconds",
        "histogram",
        ("replica", "dp_rank"),
        "Sampled KV blocks: last use to eviction (vLLM plugin, --kv-cache-metrics).",
        "plugin",
    ),
    _m(
        "kvwatch_kv_block_reuse_gap_seconds",
        "histogram",
        ("replica", "dp_rank"),
        "Sampled KV blocks: time between successive prefix-cache reuses (vLLM plugin, --kv-cache-metrics).",
        "plugin",
    ),
    _m(
        "kvwatch_kv_tier_link_utilization_ratio",
        "gauge",
        ("replica", "direction"),
        "KV tier traffic of the replica (offload: GPU to host/disk/remote; onload: back to GPU) over the "
        "theoretical PCIe bandwidth of its GPUs' links as currently trained, over the rate window.",
        "derived",
    ),
    _m(
        "kvwatch_kv_tier_link_condition",
        "gauge",
        ("replica", "direction", "condition"),
        "1 while the condition holds on the replica's GPU links: offload_pcie_bound (KV tier traffic "
        ">= 80% of link capacity), link_down_trained (narrower than max width, or below max generation "
        "while busy), foreign_bus_traffic (PCIe traffic far above what KV tiering explains).",
        "derived",
    ),
    _m(
        "kvwatch_kv_tier_recompute_avoided_tokens_per_byte",
        "gauge",
        ("replica",),
        "Recompute avoided per byte moved by the replica's KV tiers over the rate window: tokens loaded "
        "back to the GPU (instead of recomputed) per byte offloaded plus onloaded; 0 when KV moves and "
        "none comes back. From vLLM offload, LMCache or SGLang HiCache counters.",
        "derived",
    ),
    _m(
        "kvwatch_gpu_pcie_link_max_bytes_per_second",
        "gauge",
        GPU,
        "Theoretical one-direction PCIe bandwidth of the link as currently trained.",
        "derived",
    ),
    # ---- GPUs (NVML) ---------------------------------------------------------------------------
    _m("kvwatch_gpu", "info", (*GPU, "name", "pci_bus_id", "driver_version"), "GPU identity.", "gpu"),
    _m(
        "kvwatch_gpu_grants_unattributed",
        "gauge",
        ("reason",),
        "Devices the kubelet lists as allocated that name no GPU holder, by reason (terminal_pod, "
        "stale_duplicate, mig_unresolved, dra, unknown_device); with discovery.pod_resources only.",
        "self",
    ),
    _m("kvwatch_gpu_lost", "gauge", GPU, "1 if NVML reports the GPU lost (fallen off the bus).", "gpu"),
    _m("kvwatch_gpu_memory_total_bytes", "gauge", GPU, "GPU memory (FB) total.", "gpu"),
    _m("kvwatch_gpu_memory_used_bytes", "gauge", GPU, "GPU memory used by processes.", "gpu"),
    _m("kvwatch_gpu_memory_reserved_bytes", "gauge", GPU, "GPU memory reserved by driver/firmware.", "gpu"),
    _m("kvwatch_gpu_memory_free_bytes", "gauge", GPU, "GPU memory free.", "gpu"),
    _m(
        "kvwatch_gpu_utilization_ratio",
        "gauge",
        GPU,
        "Fraction of the last sample period in which a kernel ran (not SM occupancy).",
        "gpu",
    ),
    _m(
        "kvwatch_gpu_memory_utilization_ratio",
        "gauge",
        GPU,
        "Fraction of the last sample period in which device memory was read or written.",
        "gpu",
    ),
    _m(
        "kvwatch_gpu_pcie_tx_bytes",
        "counter",
        GPU,
        "PCIe bytes transmitted by the GPU (NVML field 197).",
        "gpu",
    ),
    _m(
        "kvwatch_gpu_pcie_rx_bytes", "counter", GPU, "PCIe bytes received by the GPU (NVML field 198).", "gpu"
    ),
    _m("kvwatch_gpu_pcie_replays", "counter", GPU, "PCIe replay counter.", "gpu"),
    _m("kvwatch_gpu_pcie_link_generation", "gauge", GPU, "PCIe link generation as currently trained.", "gpu"),
    _m("kvwatch_gpu_pcie_link_generation_max", "gauge", GPU, "Maximum PCIe link generation.", "gpu"),
    _m("kvwatch_gpu_pcie_link_width", "gauge", GPU, "PCIe link width (lanes) as currently trained.", "gpu"),
    _m("kvwatch_gpu_pcie_link_width_max", "gauge", GPU, "Maximum PCIe link width (lanes).", "gpu"),
    _m(
        "kvwatch_gpu_nvlink_tx_bytes",
        "counter",
        (*GPU, "link"),
        "NVLink data bytes transmitted per link.",
        "gpu",
    ),
    _m(
        "kvwatch_gpu_nvlink_rx_bytes",
        "counter",
        (*GPU, "link"),
        "NVLink data bytes received per link.",
        "gpu",
    ),
    _m("kvwatch_gpu_nvlink_active", "gauge", (*GPU, "link"), "1 if the NVLink link is active.", "gpu"),
    _m("kvwatch_gpu_power_watts", "gauge", GPU, "Power draw.", "gpu"),
    _m("kvwatch_gpu_power_limit_watts", "gauge", GPU, "Enforced power limit.", "gpu"),
    _m("kvwatch_gpu_energy_joules", "counter", GPU, "Energy consumed since the driver loaded.", "gpu"),
    _m(
        "kvwatch_gpu_temperature_celsius",
        "gauge",
        (*GPU, "sensor"),
        "Temperature (sensor: gpu, memory).",
        "gpu",
    ),
    _m("kvwatch_gpu_clock_hertz", "gauge", (*GPU, "clock"), "Current clock (clock: sm, memory).", "gpu"),
    _m(
        "kvwatch_gpu_clock_event_active",
        "gauge",
        (*GPU, "reason"),
        "1 while a clock-event (throttle) reason is active.",
        "gpu",
    ),
    _m(
        "kvwatch_gpu_ecc_errors",
        "counter",
        (*GPU, "type"),
        "Volatile ECC errors since the driver loaded (type: corrected, uncorrected).",
        "gpu",
    ),
    _m(
        "kvwatch_gpu_remapped_rows",
        "gauge",
        (*GPU, "type"),
        "HBM rows remapped (type: correctable, uncorrectable).",
        "gpu",
    ),
    _m("kvwatch_gpu_row_remap_pending", "gauge", GPU, "1 if a row remap is pending a GPU reset.", "gpu"),
    _m("kvwatch_gpu_row_remap_failure", "gauge", GPU, "1 if a row remap failed.", "gpu"),
    _m("kvwatch_gpu_xid_errors", "counter", (*GPU, "xid"), "XID events seen, per XID code.", "gpu"),
    _m(
        "kvwatch_gpu_process_memory_bytes",
        "gauge",
        (*GPU, "pid", "replica"),
        "GPU memory used per process; replica when the process is mapped to one.",
        "gpu",
    ),
    _m(
        "kvwatch_gpu_nvml_errors",
        "counter",
        ("call", "error"),
        "NVML calls that failed with an unexpected error (NOT_SUPPORTED and GPU_IS_LOST are not counted); "
        "the value they would have given is left out.",
        "gpu",
    ),
    # ---- requests --------------------------------------------------------------------------------
    _m(
        "kvwatch_request_ttft_seconds",
        "histogram",
        REQUEST,
        "Time to first token: request received -> first content-bearing chunk sent.",
        "request",
    ),
    _m(
        "kvwatch_request_tpot_seconds",
        "histogram",
        REQUEST,
        "Time per output token: (e2e - TTFT) / (output tokens - 1).",
        "request",
    ),
    _m(
        "kvwatch_request_inter_chunk_seconds",
        "histogram",
        REQUEST,
        "Gaps between successive content chunks (one observation per gap).",
        "request",
    ),
    _m(
        "kvwatch_request_duration_seconds",
        "histogram",
        REQUEST,
        "End to end: request received -> last byte sent.",
        "request",
    ),
    _m(
        "kvwatch_request_queue_seconds",
        "histogram",
        REQUEST,
        "Time in the engine's queue (engine-side sources only).",
        "request",
    ),
    _m("kvwatch_request_output_tokens", "histogram", REQUEST, "Output tokens per request.", "request"),
    _m(
        "kvwatch_request_prefill_seconds",
        "histogram",
        REQUEST,
        "Engine-side prefill: first scheduled -> first token, preemptions during prefill included "
        "(vLLM plugin).",
        "request",
    ),
    _m(
        "kvwatch_request_decode_seconds",
        "histogram",
        REQUEST,
        "Engine-side decode: first token -> last token (vLLM plugin, OTLP spans).",
        "request",
    ),
    _m(
        "kvwatch_request_preemptions",
        "histogram",
        REQUEST,
        "Times each finished request was preempted (vLLM plugin).",
        "request",
    ),
    _m(
        "kvwatch_request_output_limit_ratio",
        "histogram",
        REQUEST,
        "Output tokens / max_tokens per request: how far the length limit over-stated the answer.",
        "request",
    ),
    _m(
        "kvwatch_request_prefix_reuse_ratio",
        "histogram",
        REQUEST,
        "Prompt tokens served from the prefix cache / prompt tokens, per request (vLLM plugin).",
        "request",
    ),
    _m(
        "kvwatch_request_unused_max_tokens",
        "counter",
        REQUEST,
        "max_tokens minus output tokens of requests that stopped early (completed): KV a worst-case "
        "reservation would have held for nothing.",
        "request",
    ),
    _m(
        "kvwatch_requests",
        "counter",
        (*REQUEST, "outcome"),
        "Finished requests by outcome (completed, truncated, aborted, error, rejected) and length band.",
        "request",
    ),
    _m(
        "kvwatch_request_preemption_stalls",
        "counter",
        REQUEST,
        "Finished requests whose longest inter-chunk gap (> 1 s) overlapped a preemption on their "
        "replica (proxy only).",
        "request",
    ),
    _m(
        "kvwatch_request_output_tokens_estimated",
        "counter",
        REQUEST,
        "Requests whose output tokens were counted from chunks because no usage arrived.",
        "request",
    ),
    _m(
        "kvwatch_requests_in_flight",
        "gauge",
        ("replica", "model_name", "admission_band"),
        "Requests being relayed now, by admission band (from max_tokens).",
        "request",
    ),
    _m(
        "kvwatch_in_flight_tokens",
        "gauge",
        ("replica", "model_name", "admission_band"),
        "Estimated tokens held by in-flight requests (prompt + generated so far).",
        "request",
    ),
)

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOG}


def spec(name: str) -> MetricSpec:
    """The spec of a family; KeyError names the unknown family."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in kvwatch's metric catalog (kvwatch/catalog.py)") from None


def specs(*names: str) -> tuple[MetricSpec, ...]:
    """The specs of several families, in order; KeyError names the first unknown one."""
    return tuple(map(spec, names))


_Value = TypeVar("_Value")


def spec_rows(*rows: tuple[str, _Value]) -> tuple[tuple[MetricSpec, _Value], ...]:
    """A table of (family name, value) rows as (spec, value): called at import by the collectors that
    render from such tables, so that a misspelled family fails there rather than at scrape time."""
    return tuple((spec(name), value) for name, value in rows)
