"""The metrics profile (``metrics.profile``): what the lean default folds, and why the shipped rules,
alerts and dashboards still answer the same (docs/scale.md, "Profiles").

``full`` exports every request series per replica and every NVLink counter per link. ``lean`` (the
default) keeps per replica only what a shipped alert or a per-replica panel needs, and folds the
rest into one series per node (request families, ``replica=""``) or per GPU (NVLink, ``link=""``):

* every request histogram the proxy reports (TTFT, TPOT, e2e, inter-chunk gap, output tokens,
  output / ``max_tokens``), with the full bucket layout: the SLO rules sum them
  ``by (model_name, length_band)`` and the Latency-by-band panels ``by (le, length_band)``, so the
  node's sum is exactly what they computed from the replicas' series. Only the engine-side
  histograms (queue, prefill, decode, preemptions, prefix reuse) stay per replica:
  ``KVWatchLongRequestsPreemptedRepeatedly`` reads the preemption count of each replica;
* the estimated-output, preemption-stall and unused-``max_tokens`` counters (no rule reads them)
  and the proxy's in-flight gauges (the Latency-by-band panels sum them ``by (admission_band)``);
* output / ``max_tokens`` only from engine-side sources: its one panel reads ``source="vllm_plugin"``,
  so the proxy's copy (66 series on the reference node) answers nothing;
* NVLink traffic and link state, summed over the GPU's links: the Node dashboard sums them
  ``by (gpu)``; ``kvwatch_gpu_nvlink_active`` becomes the number of active links.

``kvwatch_requests_total`` stays per replica. What a lean node loses is the
answer to "which replica" on the latency and output-length panels: with one replica chosen they
are empty (``docs/dashboards.md``); choose ``full`` for that.
"""

from __future__ import annotations

from kvwatch.catalog import spec, specs
from kvwatch.config import Config
from kvwatch.config.schema import LEAN_PROFILE

#: the ``replica`` (or ``link``) value of a series folded per node (per GPU): empty, which
#: Prometheus stores as no label, and which ``replica=~".*"`` (a dashboard's "All") matches
FOLDED = ""

# the sets hold family names (what a collector compares with its spec's name), each looked up in the
# catalog at import, so that a misspelled one fails there rather than silently folding nothing

#: request families one series per node in lean (docs above)
PER_NODE_REQUEST_FAMILIES = frozenset(
    family.name
    for family in specs(
        "kvwatch_request_ttft_seconds",
        "kvwatch_request_tpot_seconds",
        "kvwatch_request_duration_seconds",
        "kvwatch_request_inter_chunk_seconds",
        "kvwatch_request_output_tokens",
        "kvwatch_request_output_limit_ratio",
        "kvwatch_request_output_tokens_estimated",
        "kvwatch_request_preemption_stalls",
        "kvwatch_request_unused_max_tokens",
        "kvwatch_requests_in_flight",
        "kvwatch_in_flight_tokens",
    )
)

#: request histograms lean leaves out for the proxy source (kept for engine-side sources)
ENGINE_SIDE_ONLY_FAMILIES = frozenset({spec("kvwatch_request_output_limit_ratio").name})
PROXY_SOURCE = "proxy"

#: GPU families one series per GPU in lean: summed over its links
PER_GPU_NVLINK_FAMILIES = frozenset(
    family.name
    for family in specs(
        "kvwatch_gpu_nvlink_tx_bytes",
        "kvwatch_gpu_nvlink_rx_bytes",
        "kvwatch_gpu_nvlink_active",
    )
)


def is_lean(config: Config | None) -> bool:
    """Whether /metrics folds per node; a collector without a config serves the default (lean)."""
    return (config or Config()).metrics.profile == LEAN_PROFILE
