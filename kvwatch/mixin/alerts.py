"""Operational alerts: KV pressure, stranded capacity, tier saturation, starvation, GPU and kvwatch health.

Paging (``critical``) is kept for what needs a human now: a lost GPU, a GPU error that kills or
corrupts work, and kvwatch being gone everywhere (every SLO alert is then blind). KV-cache causes
open tickets (``warning``): the per-band SLO alerts (``kvwatch/mixin/rules.py``) page when users
actually feel them. Every threshold and ``for:`` is a field of ``thresholds.AlertConfig``, set in
the SLO file's ``alerts:`` section, and listed in docs/alerting.md.

Two levels, as the recording rules (``kvwatch/mixin/rules.py`` puts each in its file): node alerts
read one node's raw series or node-level recordings and keep ``instance``; fleet alerts read the
fleet-level recordings (``cluster``, ``model_name``) and compare replicas across nodes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvwatch.mixin.promql import (
    CLASSIC,
    FLEET_LABELS,
    HistogramForm,
    by,
    eq,
    nre,
    one_of,
    re_,
    regex_any,
    selector,
)
from kvwatch.mixin.recording import COMPLETION_OUTCOMES
from kvwatch.mixin.rulefile import CRITICAL, WARNING, Alert, Group
from kvwatch.mixin.slo import SloFile
from kvwatch.mixin.thresholds import AlertConfig

DEFAULT_JOB = "kvwatch"

#: sources that only report when something arrives (OTLP exports; the vLLM plugin's datagrams, which
#: an idle engine does not send): idle is not stale
PUSH_SOURCES = ("otlp", "vllm_plugin")

#: XIDs that mean the GPU's work is lost or its memory cannot be trusted until it is drained and
#: reset (or replaced); from NVIDIA's XID catalog (docs.nvidia.com/deploy/xid-errors). Others (13,
#: 31, 43, 45: usually the application) open a ticket.
CRITICAL_XIDS: Mapping[str, str] = {
    "48": "double-bit ECC error (DBE)",
    "62": "internal micro-controller halt",
    "63": "ECC page retirement / row remapping recorded (reset the GPU to apply it)",
    "64": "ECC page retirement / row remapping recording failed",
    "74": "NVLink error",
    "79": "GPU has fallen off the bus",
    "92": "high single-bit ECC error rate",
    "94": "contained ECC error (affected applications must restart, GPU needs a reset)",
    "95": "uncontained ECC error (every application on the GPU is affected, GPU needs a reset)",
    "119": "GSP RPC timeout",
    "120": "GSP error",
}
#: clock-event reasons that mean the GPU is slowed against its will (power capping under load,
#: ``sw_power_cap``, is normal operation and not alerted)
THROTTLE_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown")

_MODEL = by((*FLEET_LABELS, "model_name"))
_REPLICA = (
    "replica {{ $labels.replica }} (model {{ $labels.model_name }}, DP rank "
    "{{ $labels.dp_rank }}) on {{ $labels.instance }}"
)
_GPU = "GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on {{ $labels.instance }}"


def _lasting(cfg: AlertConfig, alert: str) -> str:
    """An alert's ``for:`` in words for its description: ``1h30m`` -> ``1 hour 30 minutes``."""
    units = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "y": "year"}
    words = [
        f"{n} {units[u]}{'' if n == '1' else 's'}"
        for n, u in re.findall(r"(\d+)([smhdwy])", cfg.for_of(alert) or "0s")
    ]
    return " ".join(words)


def counter_rose(series: str, window: str) -> str:
    """True where an event counter rose within ``window``, including a series that first appeared
    in it: ``increase()`` cannot see the jump from nothing to 1, and XID series appear with their
    first event. (A Prometheus that starts scraping an agent which already counted XIDs therefore
    alerts once for them.)"""
    return f"increase({series}[{window}]) > 0\nor\n({series} > 0 unless {series} offset {window})"


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


def _per_finished(ratio: float) -> str:
    """``0.5`` reads "one for every 2 requests it finishes"; a ratio whose inverse is not a whole
    number (or 0, or above 1) reads as itself."""
    every = 1 / ratio if ratio > 0 else 0.0
    if every >= 2 and abs(every - round(every)) < 1e-9:
        return f"one for every {round(every)} requests it finishes"
    return f"{ratio:g} for every request it finishes"


def kv_alerts(cfg: AlertConfig, form: HistogramForm = CLASSIC) -> tuple[Alert, ...]:
    preempt_10m = "rate(kvwatch_preemptions_total[10m])"
    finished_10m = "sum without (finished_reason) (rate(kvwatch_engine_finished_requests_total[10m]))"
    return (
        Alert(
            "KVWatchKVCachePressure",
            f"(kvwatch_kv_usage_ratio > {cfg.kv_pressure_usage})\nand\n"
            f"(rate(kvwatch_preemptions_total[5m]) > 0)",
            WARNING,
            "A replica's KV cache is nearly full and the engine is preempting requests.",
            f"The KV cache of {_REPLICA} is {{{{ $value | humanizePercentage }}}} full and the engine "
            f"preempted requests in the last 5 minutes: running requests are being evicted and recomputed.",
            for_=cfg.for_of("KVWatchKVCachePressure"),
        ),
        Alert(
            "KVWatchPreemptionStorm",
            f"{preempt_10m}\n  > {cfg.storm_preemptions_per_finished} * "
            f"({finished_10m} or 0 * {preempt_10m})\n"
            f"and\n{preempt_10m} > {cfg.storm_min_preemptions_per_s}",
            WARNING,
            "A replica preempts requests faster than it finishes them.",
            f'The engine of {_REPLICA} preempts {{{{ printf "%.2f" $value }}}} requests/s, more than '
            f"{_per_finished(cfg.storm_preemptions_per_finished)} (10 minute rate): "
            f"the KV cache is thrashing.",
            for_=cfg.for_of("KVWatchPreemptionStorm"),
        ),
        Alert(
            "KVWatchRecomputeWaste",
            f"kvwatch:recompute_waste:ratio_rate15m > {cfg.recompute_waste_ratio}",
            WARNING,
            "A replica spends a large share of its work recomputing preempted requests.",
            f"The engine of {_REPLICA} recomputed {{{{ $value | humanizePercentage }}}} as many tokens "
            f"as it processed (prompt + output) over 15 minutes, because preempted requests lose their "
            f"KV cache.",
            for_=cfg.for_of("KVWatchRecomputeWaste"),
        ),
        repeated_preemption_alert(cfg, form),
        Alert(
            "KVWatchKVHeadroomLow",
            f"kvwatch_kv_headroom_seconds < {cfg.headroom_seconds}",
            WARNING,
            "A replica's KV cache will be full within minutes at its current growth.",
            f"The KV cache of {_REPLICA} fills in {{{{ $value | humanizeDuration }}}} at its current "
            f"growth; after that the engine queues or preempts.",
            for_=cfg.for_of("KVWatchKVHeadroomLow"),
        ),
    )


def repeated_preemption_alert(cfg: AlertConfig, form: HistogramForm = CLASSIC) -> Alert:
    """Requests of a longer band (every band but the shortest, whose name starts at 0) were preempted
    again and again: vLLM preempts the newest request, so a long answer can be evicted and recomputed
    many times. Needs the per-request preemption counts of kvwatch's vLLM plugin."""
    band = 'length_band!~"0-.*|unknown"'

    def increase(series: str) -> str:
        return f"increase({series}{{{band}}}[30m])"

    family = "kvwatch_request_preemptions"
    count = form.count(family, increase)
    return Alert(
        "KVWatchLongRequestsPreemptedRepeatedly",
        f"{form.sum(family, increase)} / {count}\n"
        f"  > {cfg.repeated_preemptions_per_request}\n"
        f"and\n{count} >= {cfg.repeated_preemptions_min_requests}",
        WARNING,
        "Long requests are preempted again and again.",
        "Requests of length band {{ $labels.length_band }} on replica {{ $labels.replica }} "
        "(model {{ $labels.model_name }}) on {{ $labels.instance }} were preempted "
        '{{ printf "%.1f" $value }} times each on average over 30 minutes: each preemption throws '
        "away their KV cache and recomputes it.",
        for_=cfg.for_of("KVWatchLongRequestsPreemptedRepeatedly"),
    )


def tier_alerts(cfg: AlertConfig) -> tuple[Alert, ...]:
    width_low = "kvwatch_gpu_pcie_link_width < kvwatch_gpu_pcie_link_width_max"
    gen_low = (
        f"(kvwatch_gpu_pcie_link_generation < kvwatch_gpu_pcie_link_generation_max)\n"
        f"  and\n  (kvwatch_gpu_utilization_ratio > {cfg.link_busy_utilization})"
    )
    return (
        Alert(
            "KVWatchKVTierPCIeSaturated",
            f"kvwatch:kv_tier_pcie:ratio_rate5m > {cfg.tier_pcie_ratio}",
            WARNING,
            "KV offload traffic is close to the PCIe bandwidth of the replica's GPUs.",
            "KV {{ $labels.direction }} traffic of replica {{ $labels.replica }} (model "
            "{{ $labels.model_name }}) on {{ $labels.instance }} uses {{ $value | humanizePercentage }} "
            "of the one-direction PCIe bandwidth of its GPUs' links: tier transfers are bus-bound.",
            for_=cfg.for_of("KVWatchKVTierPCIeSaturated"),
        ),
        Alert(
            "KVWatchGPUPCIeLinkDegraded",
            f'label_replace({width_low}, "degraded", "width", "", "")\n'
            f"or\n"
            f'label_replace(\n  {gen_low},\n  "degraded", "generation", "", ""\n)',
            WARNING,
            "A GPU's PCIe link trained below its maximum generation or width.",
            f"The PCIe link {{{{ $labels.degraded }}}} of {_GPU} is {{{{ $value }}}}, below the maximum "
            f"(the generation is only checked while the GPU is busy): host offload bandwidth is reduced.",
            for_=cfg.for_of("KVWatchGPUPCIeLinkDegraded"),
        ),
    )


# --------------------------------------------------------------------------------------------
# fleet: replicas of a model across nodes
# --------------------------------------------------------------------------------------------


def stranded_alert(cfg: AlertConfig) -> Alert:
    return Alert(
        "KVWatchKVCapacityStranded",
        f"kvwatch:kv_stranded:ratio > {cfg.stranded_ratio}",
        WARNING,
        "KV capacity sits free on idle replicas while other replicas of the same model queue.",
        "{{ $value | humanizePercentage }} of the KV capacity of model {{ $labels.model_name }} is free "
        "on replicas with nothing waiting while another replica of it queues or preempts: routing "
        "does not use the free memory.",
        for_=cfg.for_of("KVWatchKVCapacityStranded"),
    )


def starvation_alert(slo: SloFile, cfg: AlertConfig) -> Alert:
    long_ = one_of("length_band", slo.long_bands)
    short = one_of("length_band", slo.short_bands)
    completion = "kvwatch:request_completion:ratio_rate1h"
    aborted = selector("kvwatch:request_outcome:ratio_rate1h", long_, eq("outcome", "aborted"))
    return Alert(
        "KVWatchLongRequestsStarving",
        f"({selector(completion, long_)} < {cfg.starving_long_completion})\n"
        f"and ignoring (outcome)\n"
        f"({aborted} > {cfg.starving_aborted_ratio})\n"
        f"and on ({_MODEL})\n"
        f"(min by ({_MODEL}) ({selector(completion, short)}) >= {cfg.starving_short_completion})\n"
        f"and\n"
        f"(sum without (outcome) ({selector('kvwatch:requests:rate1h', long_)}) * 3600 "
        f">= {cfg.starving_min_requests})",
        WARNING,
        "Long requests are abandoned or fail while short requests of the same model are fine.",
        f"Only {{{{ $value | humanizePercentage }}}} of {{{{ $labels.model_name }}}} requests in length "
        f"band {{{{ $labels.length_band }}}} finished {' or '.join(COMPLETION_OUTCOMES)} in the last hour "
        f"and more than {round(cfg.starving_aborted_ratio * 100)}% were aborted by their clients, while the "
        f"short bands ({', '.join(slo.short_bands)}) completed at least "
        f"{round(cfg.starving_short_completion * 100)}%: long requests are starving.",
        for_=cfg.for_of("KVWatchLongRequestsStarving"),
    )


# --------------------------------------------------------------------------------------------
# GPUs
# --------------------------------------------------------------------------------------------


def gpu_alerts(cfg: AlertConfig) -> tuple[Alert, ...]:
    crit = regex_any(CRITICAL_XIDS)
    critical_xids = selector("kvwatch_gpu_xid_errors_total", re_("xid", crit))
    other_xids = selector("kvwatch_gpu_xid_errors_total", nre("xid", crit))
    uncorrected = selector("kvwatch_gpu_ecc_errors_total", eq("type", "uncorrected"))
    throttled = selector("kvwatch_gpu_clock_event_active", one_of("reason", THROTTLE_REASONS))
    return (
        Alert(
            "KVWatchGPULost",
            "kvwatch_gpu_lost == 1",
            CRITICAL,
            "A GPU has fallen off the bus (NVML reports it lost).",
            f"NVML reports {_GPU} lost: every replica on it has stopped. Drain the node and reset or "
            f"replace the GPU.",
            for_=cfg.for_of("KVWatchGPULost"),
        ),
        Alert(
            "KVWatchGPUCriticalXID",
            counter_rose(critical_xids, "15m"),
            CRITICAL,
            "A GPU reported an XID error that loses work or needs a GPU reset.",
            f"{_GPU} reported XID {{{{ $labels.xid }}}} in the last 15 minutes "
            f"(about {{{{ $value | humanize }}}} times). See the runbook for what this XID means and "
            f"whether to drain.",
            for_=cfg.for_of("KVWatchGPUCriticalXID"),
        ),
        Alert(
            "KVWatchGPUXIDErrors",
            counter_rose(other_xids, "15m"),
            WARNING,
            "A GPU reported XID errors (usually an application fault).",
            f"{_GPU} reported XID {{{{ $labels.xid }}}} in the last 15 minutes "
            f"(about {{{{ $value | humanize }}}} times); these XIDs usually mean an application (engine) "
            f"fault, not failing hardware.",
            for_=cfg.for_of("KVWatchGPUXIDErrors"),
        ),
        Alert(
            "KVWatchGPUUncorrectableECC",
            f"increase({uncorrected}[15m]) > 0",
            CRITICAL,
            "A GPU had uncorrectable ECC memory errors.",
            f"{_GPU} counted about {{{{ $value | humanize }}}} uncorrectable ECC errors in the last 15 "
            f"minutes: data in its memory was corrupted. Drain the GPU.",
            for_=cfg.for_of("KVWatchGPUUncorrectableECC"),
        ),
        Alert(
            "KVWatchGPURowRemapFailure",
            "kvwatch_gpu_row_remap_failure == 1",
            CRITICAL,
            "A GPU failed to remap a bad HBM row.",
            f"{_GPU} could not remap a failing memory row: the GPU should be drained and replaced.",
            for_=cfg.for_of("KVWatchGPURowRemapFailure"),
        ),
        Alert(
            "KVWatchGPURowRemapPending",
            "kvwatch_gpu_row_remap_pending == 1",
            WARNING,
            "A GPU has a memory row remap waiting for a GPU reset.",
            f"{_GPU} has a row remap pending: it takes effect at the next GPU reset. Drain and reset the "
            f"GPU in a maintenance window.",
            for_=cfg.for_of("KVWatchGPURowRemapPending"),
        ),
        Alert(
            "KVWatchGPUThrottled",
            f"{throttled} == 1",
            WARNING,
            "A GPU is slowing its clocks for thermal or hardware reasons.",
            f"{_GPU} has clock event {{{{ $labels.reason }}}} active for "
            f"{_lasting(cfg, 'KVWatchGPUThrottled')}: tokens per second drop on every replica using it.",
            for_=cfg.for_of("KVWatchGPUThrottled"),
        ),
    )


# --------------------------------------------------------------------------------------------
# kvwatch itself
# --------------------------------------------------------------------------------------------


def self_alerts(job: str, cfg: AlertConfig) -> tuple[Alert, ...]:
    up = selector("up", eq("job", job))
    stale = selector(
        "kvwatch_source_last_success_timestamp_seconds",
        nre("source", "|".join(f"{regex_any([p])}.*" for p in PUSH_SOURCES)),
    )
    return (
        Alert(
            "KVWatchDown",
            f"{up} == 0",
            WARNING,
            "Prometheus cannot scrape a kvwatch agent.",
            "Prometheus has not scraped kvwatch on {{ $labels.instance }} for "
            f"{_lasting(cfg, 'KVWatchDown')}: KV, GPU and "
            "per-band latency of that node are not watched.",
            for_=cfg.for_of("KVWatchDown"),
        ),
        Alert(
            "KVWatchAbsent",
            f"absent({up})",
            CRITICAL,
            "No kvwatch agent is scraped at all.",
            'Prometheus has no target with job="{{ $labels.job }}" for '
            f"{_lasting(cfg, 'KVWatchAbsent')}: every kvwatch alert, "
            "the per-band SLO alerts included, is blind.",
            for_=cfg.for_of("KVWatchAbsent"),
        ),
        Alert(
            "KVWatchEngineTargetDown",
            "kvwatch_target_up == 0",
            WARNING,
            "kvwatch cannot scrape an inference engine's metrics.",
            "kvwatch on {{ $labels.instance }} has failed to scrape replica {{ $labels.replica }} "
            f"({{{{ $labels.backend }}}}) for {_lasting(cfg, 'KVWatchEngineTargetDown')}: the engine is "
            "down, restarting or unreachable.",
            for_=cfg.for_of("KVWatchEngineTargetDown"),
        ),
        Alert(
            "KVWatchCollectorFailing",
            "kvwatch_collector_success == 0",
            WARNING,
            "A kvwatch collector keeps failing.",
            "Collector {{ $labels.collector }} of kvwatch on {{ $labels.instance }} has failed for "
            f"{_lasting(cfg, 'KVWatchCollectorFailing')}; its series are missing.",
            for_=cfg.for_of("KVWatchCollectorFailing"),
        ),
        Alert(
            "KVWatchConfigReloadFailed",
            "kvwatch_config_last_reload_successful == 0",
            WARNING,
            "kvwatch refused its edited config and runs on the previous one.",
            "kvwatch on {{ $labels.instance }} has run on its previous config for "
            f"{_lasting(cfg, 'KVWatchConfigReloadFailed')}: the last reload was invalid (its log names "
            "every bad key).",
            for_=cfg.for_of("KVWatchConfigReloadFailed"),
        ),
        Alert(
            "KVWatchNearFileDescriptorLimit",
            f"{selector('process_open_fds', eq('job', job))} / {selector('process_max_fds', eq('job', job))}"
            f" > {cfg.open_fds_ratio}",
            WARNING,
            "kvwatch is close to its open-files limit: new proxy clients may be dropped.",
            "kvwatch on {{ $labels.instance }} has used {{ $value | humanizePercentage }} of its open-files "
            f"limit for {_lasting(cfg, 'KVWatchNearFileDescriptorLimit')}; at the limit accept() fails, and "
            "under uvloop the clients waiting are closed without a log line.",
            for_=cfg.for_of("KVWatchNearFileDescriptorLimit"),
        ),
        Alert(
            "KVWatchSourceStale",
            f"(time() - {stale} > {cfg.source_stale_seconds})\n"
            f"unless on (instance, job, source)\n"
            f'label_replace(kvwatch_collector_success == 0, "source", "$1", "collector", "(.*)")',
            WARNING,
            "A kvwatch source stopped reporting without reporting a failure.",
            "Source {{ $labels.source }} of kvwatch on {{ $labels.instance }} last succeeded "
            "{{ $value | humanizeDuration }} ago without reporting a failure: its poller is stuck.",
            for_=cfg.for_of("KVWatchSourceStale"),
        ),
    )


def node_alert_groups(
    job: str = DEFAULT_JOB, cfg: AlertConfig | None = None, form: HistogramForm = CLASSIC
) -> tuple[Group, ...]:
    """Alerts on one node's series: they run where the node is scraped."""
    cfg = cfg or AlertConfig()
    return (
        Group("kvwatch-kv.alerts", kv_alerts(cfg, form)),
        Group("kvwatch-tier.alerts", tier_alerts(cfg)),
        Group("kvwatch-gpu.alerts", gpu_alerts(cfg)),
        Group("kvwatch-self.alerts", self_alerts(job, cfg)),
    )


def fleet_alert_group(slo: SloFile) -> Group:
    """Alerts on the fleet-level recordings: they run where every node of the fleet is."""
    return Group("kvwatch-fleet.alerts", (stranded_alert(slo.alerts), starvation_alert(slo, slo.alerts)))
