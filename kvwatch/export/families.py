"""The catalog families the export collectors render one by one, bound at import: a misspelled
name fails when the first collector is imported (and in every test that renders), not as a failed
export area at scrape time. The families a collector renders from a table (one per
``ReplicaSample`` or ``GpuSample`` attribute, say) are bound in that table, in its module
(``spec_rows``, ``specs``)."""

from __future__ import annotations

from kvwatch.catalog import spec

# ---- kvwatch itself (self_metrics.py)
BUILD = spec("kvwatch_build")
COLLECTOR_SUCCESS = spec("kvwatch_collector_success")
COLLECTOR_DURATION_SECONDS = spec("kvwatch_collector_duration_seconds")
SOURCE_LAST_SUCCESS_TIMESTAMP_SECONDS = spec("kvwatch_source_last_success_timestamp_seconds")
CONFIG_LAST_RELOAD_SUCCESSFUL = spec("kvwatch_config_last_reload_successful")
CONFIG_LAST_RELOAD_SUCCESS_TIMESTAMP_SECONDS = spec("kvwatch_config_last_reload_success_timestamp_seconds")
GPU_GRANTS_UNATTRIBUTED = spec("kvwatch_gpu_grants_unattributed")
DISCOVERY_STALE = spec("kvwatch_discovery_stale")
DISCOVERY_REPLICAS = spec("kvwatch_discovery_replicas")
DISCOVERY_REPLICA_READY = spec("kvwatch_discovery_replica_ready")
DISCOVERY_POD_ANNOTATION_ERRORS = spec("kvwatch_discovery_pod_annotation_errors")

# ---- engine replicas and their scrape targets (replicas.py)
KV_FREE_TOKENS = spec("kvwatch_kv_free_tokens")
KV_CAPACITY_BYTES = spec("kvwatch_kv_capacity_bytes")
REPLICA_INFO = spec("kvwatch_replica")
ENGINE_FINISHED_REQUESTS = spec("kvwatch_engine_finished_requests")
TARGET_UP = spec("kvwatch_target_up")
TARGET_SCRAPE_DURATION_SECONDS = spec("kvwatch_target_scrape_duration_seconds")
TARGET_SCRAPE_ERRORS = spec("kvwatch_target_scrape_errors")
TARGET_RESTARTS = spec("kvwatch_target_restarts")
TARGET_SAMPLES_REJECTED = spec("kvwatch_target_samples_rejected")

# ---- GPUs (gpus.py)
GPU_INFO = spec("kvwatch_gpu")
GPU_LOST = spec("kvwatch_gpu_lost")
GPU_XID_ERRORS = spec("kvwatch_gpu_xid_errors")
GPU_NVML_ERRORS = spec("kvwatch_gpu_nvml_errors")
REPLICA_GPU = spec("kvwatch_replica_gpu")
GPU_PCIE_LINK_MAX_BYTES_PER_SECOND = spec("kvwatch_gpu_pcie_link_max_bytes_per_second")
GPU_NVLINK_ACTIVE = spec("kvwatch_gpu_nvlink_active")
GPU_NVLINK_TX_BYTES = spec("kvwatch_gpu_nvlink_tx_bytes")
GPU_NVLINK_RX_BYTES = spec("kvwatch_gpu_nvlink_rx_bytes")
GPU_CLOCK_EVENT_ACTIVE = spec("kvwatch_gpu_clock_event_active")
GPU_PROCESS_MEMORY_BYTES = spec("kvwatch_gpu_process_memory_bytes")

# ---- requests (requests.py)
REQUEST_UNUSED_MAX_TOKENS = spec("kvwatch_request_unused_max_tokens")
REQUESTS = spec("kvwatch_requests")
REQUEST_OUTPUT_TOKENS_ESTIMATED = spec("kvwatch_request_output_tokens_estimated")
REQUEST_PREEMPTION_STALLS = spec("kvwatch_request_preemption_stalls")
REQUESTS_IN_FLIGHT = spec("kvwatch_requests_in_flight")
IN_FLIGHT_TOKENS = spec("kvwatch_in_flight_tokens")

# ---- derived KV signals (derived.py)
KV_LIVE_TOKENS = spec("kvwatch_kv_live_tokens")
KV_FRAGMENTATION_RATIO = spec("kvwatch_kv_fragmentation_ratio")
KV_HEADROOM_SECONDS = spec("kvwatch_kv_headroom_seconds")
RECOMPUTED_TOKENS = spec("kvwatch_recomputed_tokens")
KV_OVERCOMMITTED_REQUESTS = spec("kvwatch_kv_overcommitted_requests")
KV_STRANDED_TOKENS = spec("kvwatch_kv_stranded_tokens")
KV_TIER_LINK_UTILIZATION_RATIO = spec("kvwatch_kv_tier_link_utilization_ratio")
KV_TIER_LINK_CONDITION = spec("kvwatch_kv_tier_link_condition")
KV_TIER_RECOMPUTE_AVOIDED_TOKENS_PER_BYTE = spec("kvwatch_kv_tier_recompute_avoided_tokens_per_byte")

# ---- the vLLM plugin (plugin.py)
ENGINE_STEP_SECONDS = spec("kvwatch_engine_step_seconds")
VLLM_PLUGIN_DROPPED_DATAGRAMS = spec("kvwatch_vllm_plugin_dropped_datagrams")
VLLM_PLUGIN_DROPPED_STEPS = spec("kvwatch_vllm_plugin_dropped_steps")
