"""kvwatch's Grafana dashboards, as code: Node, Latency by length band, Fleet.

``kvwatch dashboards`` renders them to ``dashboards/*.json``; ``--check`` fails when the committed
JSON differs. Every query goes through ``Scope.sel`` (filters only by the dashboard variables whose
label the series has, so choosing a model never blanks the GPU panels) and is checked against the
metric catalog, the recording rules and the external allow-list before anything is written.

``panel_queries()`` lists every query of every panel with the template variables replaced by
concrete values, for tests that run them against a real Prometheus.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvwatch import buckets
from kvwatch.catalog import BY_NAME
from kvwatch.mixin import grafana as g
from kvwatch.mixin.grafana import Query
from kvwatch.mixin.promql import (
    FLEET_LABELS,
    Match,
    catalog_family,
    eq,
    referenced_metrics,
    selector,
    unknown_names,
)
from kvwatch.mixin.rulefile import recorded_names
from kvwatch.mixin.rules import rule_files
from kvwatch.mixin.slo import slo_from_mapping

#: grafana.com dashboard 12239, NVIDIA's dcgm-exporter dashboard (grafana/dcgm-exporter-dashboard.json)
DCGM_DASHBOARD_UID = "Oxed_c6Wz"
DEFAULT_JOB = "kvwatch"

NODE_UID = "kvwatch-node"
LATENCY_UID = "kvwatch-latency-by-band"
FLEET_UID = "kvwatch-fleet"

#: dashboard variable -> the label it filters
VARIABLE_LABELS: Mapping[str, str] = {
    "cluster": "cluster", "node": "instance", "model": "model_name", "replica": "replica",
    "band": "length_band",
}

#: what panel_queries() puts in for each variable by default (regexes match everything)
DEFAULT_VALUES: Mapping[str, str] = {
    "datasource": "prometheus", "cluster": ".*", "job": DEFAULT_JOB, "node": ".*", "model": ".*",
    "replica": ".*", "band": ".*", "ttft_slo": "2.0", "tpot_slo": "0.06",
    "__rate_interval": "1m", "__interval": "15s", "__range": "1h",
}

RATE = "$__rate_interval"
SLO_OBJECTIVE = "kvwatch:slo_objective:ratio"

# labels of the recorded series the dashboards read (fleet-level ones have no instance)
_FLEET_BAND = (*FLEET_LABELS, "model_name", "length_band")
_FLEET_MODEL = (*FLEET_LABELS, "model_name")
_SLO_LABELS = (*_FLEET_BAND, "slo", "sli")
# node-level recorded series keep every label of the replica series; tier ratios drop dp_rank
_REPLICA_LABELS = (*BY_NAME["kvwatch_preemptions"].labels, "cluster", "instance")
_TIER_LABELS = ("replica", "model_name", "cluster", "instance")


@dataclass(frozen=True, slots=True)
class Options:
    dcgm_dashboard_uid: str = DCGM_DASHBOARD_UID
    job: str = DEFAULT_JOB


@dataclass(frozen=True, slots=True)
class Scope:
    """The variables a dashboard has; ``sel`` applies those whose label a series carries."""

    variables: tuple[str, ...]

    def sel(self, name: str, *extra: Match | str, labels: Sequence[str] | None = None) -> str:
        if labels is None:
            spec = catalog_family(name)
            if spec is None:
                raise KeyError(f"{name}: not a catalog series; pass the labels of recorded series")
            labels = (*spec.labels, "cluster", "instance")
        matchers = [f'{VARIABLE_LABELS[v]}=~"${v}"' for v in self.variables
                    if VARIABLE_LABELS.get(v) in labels]
        return selector(name, *matchers, *extra)

    def rate(self, name: str, *extra: Match | str, window: str = RATE) -> str:
        return f"rate({self.sel(name, *extra)}[{window}])"


@dataclass(frozen=True, slots=True)
class Board:
    uid: str
    title: str
    description: str
    variables: tuple[dict[str, Any], ...]
    panels: tuple[dict[str, Any], ...]
    links: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    @property
    def filename(self) -> str:
        return f"{self.uid}.json"

    def json(self) -> dict[str, Any]:
        return g.dashboard_json(uid=self.uid, title=self.title, description=self.description,
                                variables=self.variables, panels=self.panels, links=self.links)


def _quantile(q: float, family: str, scope: Scope, by: str = "length_band") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({scope.rate(family + '_bucket')}))"


def _links() -> tuple[dict[str, Any], ...]:
    return ({"title": "kvwatch", "type": "dashboards", "tags": ["kvwatch"], "asDropdown": False,
             "includeVars": True, "keepTime": True, "targetBlank": False},)


def _dcgm_link(opts: Options) -> dict[str, Any]:
    return {"title": "NVIDIA DCGM Exporter dashboard", "type": "link", "icon": "dashboard",
            "url": f"/d/{opts.dcgm_dashboard_uid}", "keepTime": True, "targetBlank": True,
            "tooltip": "dcgm-exporter's dashboard (grafana.com 12239); kvwatch's uuid = its UUID"}


def _variables(names: Iterable[str], job: str) -> tuple[dict[str, Any], ...]:
    out = [g.datasource_variable()]
    for name in names:
        if name == "cluster":
            out.append(g.query_variable("cluster", "Cluster", "label_values(kvwatch_build_info, cluster)"))
        elif name == "job":
            var = g.query_variable("job", "Job", 'label_values(kvwatch_build_info{cluster=~"$cluster"}, job)',
                                   multi=False)
            var.update(includeAll=False, current={"selected": True, "text": job, "value": job})
            out.append(var)
        elif name == "node":
            out.append(g.query_variable("node", "Node",
                                        'label_values(kvwatch_build_info{cluster=~"$cluster"}, instance)'))
        elif name == "model":
            out.append(g.query_variable(
                "model", "Model",
                'label_values(kvwatch_replica_info{cluster=~"$cluster", instance=~"$node"}, model_name)'))
        elif name == "replica":
            out.append(g.query_variable(
                "replica", "Replica",
                'label_values(kvwatch_replica_info{cluster=~"$cluster", instance=~"$node", '
                'model_name=~"$model"}, replica)'))
        elif name == "band":
            out.append(g.query_variable(
                "band", "Length band",
                'label_values(kvwatch_requests_total{cluster=~"$cluster", model_name=~"$model"}, '
                'length_band)'))
        elif name == "ttft_slo":
            out.append(g.custom_variable(
                "ttft_slo", "TTFT target (s)", [buckets.le_label(b) for b in buckets.TTFT_SECONDS],
                DEFAULT_VALUES["ttft_slo"], "A bucket boundary of kvwatch_request_ttft_seconds"))
        elif name == "tpot_slo":
            out.append(g.custom_variable(
                "tpot_slo", "TPOT target (s)", [buckets.le_label(b) for b in buckets.TPOT_SECONDS],
                DEFAULT_VALUES["tpot_slo"], "A bucket boundary of kvwatch_request_tpot_seconds"))
        else:
            raise ValueError(f"unknown dashboard variable {name!r}")
    return tuple(out)


_PCT_HIGH_BAD = ((None, "green"), (0.9, "orange"), (0.98, "red"))
_ANY_IS_BAD = ((None, "green"), (1, "orange"))
_ANY_IS_RED = ((None, "green"), (1, "red"))
_PAGE_BURN = ((None, "green"), (6, "orange"), (14.4, "red"))
_BUDGET = ((None, "red"), (0, "orange"), (0.25, "green"))


# --------------------------------------------------------------------------------------------
# Node
# --------------------------------------------------------------------------------------------


def node_board(opts: Options) -> Board:
    s = Scope(("cluster", "node", "model", "replica"))
    rep = "{{instance}} {{replica}} {{dp_rank}}"
    gpu = "{{instance}} GPU {{gpu}}"
    lay = g.Layout()

    lay.row("Overview")
    lay.add(g.stat("Engines up", [
        Query(f"sum({s.sel('kvwatch_target_up')})", "up"),
        Query(f"count({s.sel('kvwatch_target_up')})", "configured")],
        description="Engine replicas whose last metrics scrape succeeded, of those configured."), 4, 4)
    lay.add(g.stat("Highest KV occupancy", [Query(f"max({s.sel('kvwatch_kv_usage_ratio')})")],
                   description="The fullest KV cache among the selected replicas (engine's own figure).",
                   unit="percentunit", thresholds=_PCT_HIGH_BAD), 4, 4)
    lay.add(g.stat("Lowest KV headroom", [Query(f"min({s.sel('kvwatch_kv_headroom_seconds')})")],
                   description="Seconds until the first KV pool fills at its current growth.",
                   unit="s", thresholds=((None, "red"), (120, "orange"), (300, "green"))), 4, 4)
    lay.add(g.stat("Preemptions, all replicas", [Query(f"sum({s.rate('kvwatch_preemptions_total')})")],
                   description="Requests preempted (vLLM) or retracted (SGLang) per second.",
                   unit="reqps", thresholds=((None, "green"), (0.05, "orange"), (1, "red"))), 4, 4)
    lay.add(g.stat("Waiting requests", [Query(f"sum({s.sel('kvwatch_requests_waiting')})")],
                   description="Requests queued in the engines.", thresholds=_ANY_IS_BAD), 4, 4)
    lay.add(g.stat("GPUs lost", [Query(f"sum({s.sel('kvwatch_gpu_lost')})")],
                   description="GPUs NVML reports lost (fallen off the bus).",
                   thresholds=((None, "green"), (1, "red"))), 4, 4)

    lay.row("KV cache")
    lay.add(g.timeseries("KV occupancy per replica", [Query(s.sel("kvwatch_kv_usage_ratio"), rep)],
                         description="KV cache in use as the engine reports it (vLLM: blocks held by live "
                                     "requests; SGLang: token slots).",
                         unit="percentunit", min_=0, max_=1, thresholds=_PCT_HIGH_BAD, threshold_lines=True),
            12, 8)
    lay.add(g.timeseries("Internal fragmentation", [
        Query(s.sel("kvwatch_kv_fragmentation_ratio"), f"{rep} ({{{{source}}}})")],
        description="1 - live tokens / (used blocks x block size): block slots held but not filled. "
                    "source=proxy_estimate when live tokens come from the proxy's accounting.",
        unit="percentunit", min_=0, max_=1), 12, 8)
    headroom = f"clamp_max({s.sel('kvwatch_kv_headroom_seconds')}, 3600)"
    lay.add(g.timeseries("KV headroom", [Query(headroom, rep)],
                         description="Seconds until the KV pool is full at the current net growth (shown up "
                                     "to 1h; +Inf when not growing).",
                         unit="s", min_=0, thresholds=((None, "red"), (300, "green")), threshold_lines=True),
            12, 8)
    lay.add(g.timeseries("KV tokens: capacity, in use, live", [
        Query(s.sel("kvwatch_kv_capacity_tokens"), f"{rep} capacity"),
        Query(f"{s.sel('kvwatch_kv_capacity_tokens')} - {s.sel('kvwatch_kv_free_tokens')}", f"{rep} in use"),
        Query(f"max without (source) ({s.sel('kvwatch_kv_live_tokens')})", f"{rep} live")],
        description="In use = capacity - free (held by live requests); live = tokens the running requests "
                    "actually hold. The gap is fragmentation.", unit="short", min_=0), 12, 8)
    lay.add(g.timeseries("Running and waiting requests", [
        Query(s.sel("kvwatch_requests_running"), f"{rep} running"),
        Query(s.sel("kvwatch_requests_waiting"), f"{rep} waiting")],
        description="The engine's running batch and its queue.", min_=0), 12, 8)
    lay.add(g.timeseries("Over-committed requests", [Query(s.sel("kvwatch_kv_overcommitted_requests"), rep)],
                         description="Running requests whose max_tokens could not all fit if every request "
                                     "ran to its limit.", min_=0), 12, 8)

    lay.row("Preemption and recompute")
    lay.add(g.timeseries("Preemptions", [Query(s.rate("kvwatch_preemptions_total"), rep)],
                         description="Preemptions (vLLM) or retractions (SGLang) per second.", unit="reqps",
                         min_=0), 8, 8)
    lay.add(g.timeseries("Recomputed tokens", [
        Query(s.rate("kvwatch_recomputed_tokens_total"), f"{rep} ({{{{source}}}})")],
        description="Tokens recomputed after preemption per second; source=estimate is preemptions x mean "
                    "live tokens per running request.", unit="short", min_=0), 8, 8)
    waste = s.sel("kvwatch:recompute_waste:ratio_rate15m", labels=_REPLICA_LABELS)
    lay.add(g.timeseries("Recompute waste", [Query(waste, rep)],
                         description="Recomputed tokens per token processed (prompt + output), 15m rate. "
                                     "KVWatchRecomputeWaste fires above 20%.",
                         unit="percentunit", min_=0, thresholds=((None, "green"), (0.2, "red")),
                         threshold_lines=True), 8, 8)

    lay.row("KV tier traffic beside PCIe")
    lay.add(g.timeseries("KV tier traffic (engine)", [
        Query(f"sum without (family) ({s.rate('kvwatch_kv_tier_transfer_bytes_total')})",
              "{{instance}} {{replica}} {{src_tier}} → {{dst_tier}}", sparse=True)],
        description="KV bytes the engine moved between tiers (vLLM offload connectors, LMCache, SGLang "
                    "HiCache, Dynamo KVBM, TRT-LLM).", unit="Bps", min_=0), 12, 8)
    lay.add(g.timeseries("PCIe traffic (NVML) and link bandwidth", [
        Query(s.rate("kvwatch_gpu_pcie_tx_bytes_total"), f"{gpu} tx"),
        Query(s.rate("kvwatch_gpu_pcie_rx_bytes_total"), f"{gpu} rx"),
        Query(s.sel("kvwatch_gpu_pcie_link_max_bytes_per_second"), f"{gpu} link max")],
        description="Everything that crossed each GPU's PCIe link (NVML byte counters) next to the link's "
                    "one-direction bandwidth as trained. More than the engine's tier traffic means "
                    "something else uses the bus.", unit="Bps", min_=0), 12, 8)
    lay.add(g.timeseries("KV tier traffic / PCIe bandwidth", [
        Query(s.sel("kvwatch:kv_tier_pcie:ratio_rate5m", labels=_TIER_LABELS),
              "{{instance}} {{replica}} {{direction}}", sparse=True)],
        description="A replica's offload (or onload) bytes over the one-direction bandwidth of its GPUs' "
                    "links. KVWatchKVTierPCIeSaturated fires above 80%. Needs the replica -> GPU map.",
        unit="percentunit", min_=0, thresholds=((None, "green"), (0.8, "red")), threshold_lines=True), 12, 8)
    lay.add(g.table("PCIe links", [
        Query(s.sel("kvwatch_gpu_pcie_link_generation"), instant=True, table=True),
        Query(s.sel("kvwatch_gpu_pcie_link_generation_max"), instant=True, table=True),
        Query(s.sel("kvwatch_gpu_pcie_link_width"), instant=True, table=True),
        Query(s.sel("kvwatch_gpu_pcie_link_width_max"), instant=True, table=True),
        Query(f"increase({s.sel('kvwatch_gpu_pcie_replays_total')}[$__range])", instant=True, table=True)],
        description="Generation and width as trained vs maximum (A: gen, B: max gen, C: width, D: max "
                    "width, E: replays in range). GPUs lower the generation when idle; under load it "
                    "should match the maximum.", hide=("Time", "job", "__name__")), 12, 8)

    lay.row("GPUs")
    lay.add(g.timeseries("GPU memory", [
        Query(s.sel("kvwatch_gpu_memory_used_bytes"), f"{gpu} used"),
        Query(s.sel("kvwatch_gpu_memory_total_bytes"), f"{gpu} total")],
        description="Framebuffer used by processes, against the total.", unit="bytes", min_=0), 12, 8)
    lay.add(g.timeseries("GPU utilization", [Query(s.sel("kvwatch_gpu_utilization_ratio"), gpu)],
                         description="Share of the sample period a kernel ran (not SM occupancy).",
                         unit="percentunit", min_=0, max_=1), 12, 8)
    nvlink = "sum by (cluster, instance, gpu) ({})"
    lay.add(g.timeseries("NVLink traffic", [
        Query(nvlink.format(s.rate(f"kvwatch_gpu_nvlink_{d}_bytes_total")), f"{gpu} {d}")
        for d in ("tx", "rx")],
        description="NVLink data bytes per GPU, all links summed.", unit="Bps", min_=0), 12, 8)
    lay.add(g.timeseries("Power and temperature", [
        Query(s.sel("kvwatch_gpu_power_watts"), f"{gpu} W"),
        Query(s.sel("kvwatch_gpu_temperature_celsius"), f"{gpu} {{{{sensor}}}} °C")],
        description="Power draw (W) and temperatures (°C, GPU and HBM) on one axis.", unit="short"), 12, 8)
    lay.add(g.timeseries("Clock events (throttling)", [
        Query(s.sel("kvwatch_gpu_clock_event_active", 'reason!="gpu_idle"'), f"{gpu} {{{{reason}}}}")],
        description="1 while a clock-event reason is active. hw_/sw_thermal_slowdown, hw_slowdown and "
                    "hw_power_brake_slowdown slow the GPU against its will; sw_power_cap is normal "
                    "under load.", min_=0, max_=1, step=True), 12, 8)
    lay.add(g.timeseries("XIDs and ECC errors", [
        Query(f"increase({s.sel('kvwatch_gpu_xid_errors_total')}[{RATE}])", f"{gpu} XID {{{{xid}}}}",
              sparse=True),
        Query(f"increase({s.sel('kvwatch_gpu_ecc_errors_total')}[{RATE}])", f"{gpu} ECC {{{{type}}}}")],
        description="XID events per code (a series appears with the first event) and ECC errors. See the "
                    "KVWatchGPUCriticalXID runbook for what each XID means.", min_=0), 12, 8)
    dcgm_url = (f"/d/{opts.dcgm_dashboard_uid}/nvidia-dcgm-exporter-dashboard?${{__url_time_range}}"
                "&var-Hostname=${__data.fields.node}&var-gpu=${__data.fields.gpu}"
                "&var-UUID=${__data.fields.uuid}")
    lay.add(g.table("GPUs (open in the DCGM dashboard)", [
        Query(f"{s.sel('kvwatch_gpu_info')} * on (cluster, instance) group_left (node) "
              f"{s.sel('kvwatch_build_info')}", instant=True, table=True),
        Query(s.sel("kvwatch_gpu_remapped_rows", 'type="uncorrectable"'), instant=True, table=True)],
        description="kvwatch's GPUs with the node name dcgm-exporter uses; click a row to open the "
                    "dcgm-exporter dashboard for that GPU (uuid = dcgm-exporter's UUID label).",
        links=[{"title": "dcgm-exporter: this GPU", "url": dcgm_url, "targetBlank": True}],
        hide=("Time", "job", "__name__", "Value #A", "type")), 12, 8)
    lay.add(g.table("Replicas on GPUs", [Query(s.sel("kvwatch_replica_gpu_info"), instant=True, table=True)],
                    description="Which GPUs each replica runs on, and how kvwatch found out (config, "
                                "the engine's PIDs, CUDA_VISIBLE_DEVICES).",
                    hide=("Time", "job", "__name__", "Value")), 12, 8)
    lay.add(g.timeseries("Tensor core activity (dcgm-exporter)", [
        Query("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE * on (UUID) group_left () max by (UUID) (label_replace("
              f"{s.sel('kvwatch_gpu_info')}, \"UUID\", \"$1\", \"uuid\", \"(.*)\"))",
              "GPU {{gpu}} {{UUID}}")],
        description="dcgm-exporter's profiling field for the GPUs of the selected nodes, joined on UUID. "
                    "Empty without dcgm-exporter (or without its DCP metrics).",
        unit="percentunit", min_=0, max_=1), 12, 8)

    lay.row("kvwatch agent")
    lay.add(g.timeseries("Collectors", [
        Query(s.sel("kvwatch_collector_success"), "{{instance}} {{collector}}")],
        description="1 if the collector's last run succeeded (engines, NVML, GPU mapping, export areas).",
        min_=0, max_=1, step=True), 8, 8)
    lay.add(g.timeseries("Source staleness", [
        Query(f"time() - {s.sel('kvwatch_source_last_success_timestamp_seconds')}",
              "{{instance}} {{source}}")],
        description="Seconds since each source last succeeded. KVWatchSourceStale fires past 10 minutes.",
        unit="s", min_=0), 8, 8)
    lay.add(g.timeseries("Engine scrape errors", [
        Query(s.rate("kvwatch_target_scrape_errors_total"), "{{instance}} {{replica}} {{reason}}",
              sparse=True)],
        description="Failed scrapes of engine metrics by reason.", unit="short", min_=0), 8, 8)

    return Board(NODE_UID, "kvwatch / Node",
                 "Per replica KV cache (occupancy, fragmentation, headroom, preemption, recompute), KV tier "
                 "traffic beside PCIe, GPU memory, NVLink, throttling and XIDs, and kvwatch's own health.",
                 _variables(("cluster", "job", "node", "model", "replica"), opts.job), tuple(lay.panels),
                 (*_links(), _dcgm_link(opts)))


# --------------------------------------------------------------------------------------------
# Latency by length band
# --------------------------------------------------------------------------------------------

_LATENCY = (
    ("TTFT", "kvwatch_request_ttft_seconds", "Time to first token: request received -> first content chunk."),
    ("TPOT", "kvwatch_request_tpot_seconds", "Time per output token: (e2e - TTFT) / (output tokens - 1)."),
    ("End to end", "kvwatch_request_duration_seconds", "Request received -> last byte sent."),
)


def _burn_rate(window: str, s: Scope) -> str:
    ratio = s.sel(f"kvwatch:slo_errors:ratio_rate{window}", labels=_SLO_LABELS)
    return f"{ratio}\n/ on (slo) group_left ()\n(1 - {SLO_OBJECTIVE})"


def latency_board(opts: Options) -> Board:
    s = Scope(("cluster", "node", "model", "replica", "band"))
    fleet = Scope(("cluster", "model", "band"))  # for fleet-level recorded series
    band = "{{length_band}}"
    lay = g.Layout()

    for title, family, what in _LATENCY:
        lay.row(f"{title} by output-length band")
        for q in (0.5, 0.9, 0.99):
            lay.add(g.timeseries(f"{title} p{round(q * 100)}", [Query(_quantile(q, family, s), band)],
                                 description=f"{what} p{round(q * 100)} per band (band = final output "
                                             f"tokens), from kvwatch's histogram.", unit="s", min_=0), 8, 8)
    lay.row("Streaming and SLO attainment")
    gaps = _quantile(0.99, "kvwatch_request_inter_chunk_seconds", s)
    lay.add(g.timeseries("Inter-chunk gap p99", [Query(gaps, band)],
                         description="p99 of the gaps between content chunks (a chunk may carry several "
                                     "tokens) per band.", unit="s", min_=0), 8, 8)
    for var, family, label in (("ttft_slo", "kvwatch_request_ttft_seconds", "TTFT"),
                               ("tpot_slo", "kvwatch_request_tpot_seconds", "TPOT")):
        le_target = eq("le", f"${var}")
        good = f"sum by (length_band) ({s.rate(family + '_bucket', le_target)})"
        total = f"sum by (length_band) ({s.rate(family + '_count')})"
        lay.add(g.bargauge(f"Requests within the {label} target", [Query(f"{good}\n/\n({total} > 0)", band)],
                           description=f"Share of requests per band with {label} at most ${var} (a bucket "
                                       f"boundary; pick it above).", unit="percentunit", min_=0, max_=1,
                           thresholds=((None, "red"), (0.9, "orange"), (0.99, "green"))), 8, 8)

    lay.row("SLO burn and error budget")
    slo_legend = "{{slo}} {{model_name}} {{length_band}}"
    lay.add(g.timeseries("Burn rate, 1h", [Query(_burn_rate("1h", fleet), slo_legend)],
                         description="Error ratio over 1h / error budget. The page needs 14.4 here (and over "
                                     "5m), or 6 over 6h (and 30m).", min_=0,
                         thresholds=_PAGE_BURN, threshold_lines=True), 8, 8)
    lay.add(g.timeseries("Burn rate, 6h", [Query(_burn_rate("6h", fleet), slo_legend)],
                         description="Error ratio over 6h / error budget. 6 pages (with 30m); 1 over 3d "
                                     "opens a ticket.", min_=0,
                         thresholds=((None, "green"), (1, "orange"), (6, "red")), threshold_lines=True), 8, 8)
    lay.add(g.bargauge("Error budget left", [
        Query(fleet.sel("kvwatch:slo_error_budget_remaining:ratio", labels=_SLO_LABELS), slo_legend)],
        description="Share of the SLO period's error budget not yet spent, per objective and band.",
        unit="percentunit", max_=1, thresholds=_BUDGET), 8, 8)
    lay.add(g.table("Firing SLO alerts", [
        Query(fleet.sel("ALERTS", 'alertname=~"KVWatch(Latency|Completion)BudgetBurn"', 'alertstate="firing"',
                        labels=(*_SLO_LABELS,)), instant=True, table=True, sparse=True)],
        description="KVWatchLatencyBudgetBurn / KVWatchCompletionBudgetBurn firing now.",
        hide=("Time", "__name__", "Value", "alertstate")), 24, 6)

    lay.row("Outcomes per band")
    lay.add(g.timeseries("Finished requests by outcome", [
        Query(f"sum by (length_band, outcome) ({s.rate('kvwatch_requests_total')})",
              "{{length_band}} {{outcome}}")],
        description="completed (stop), truncated (token budget), aborted (client went away), error "
                    "(5xx / broken stream), rejected (4xx).", unit="reqps", stack=True, min_=0), 12, 8)
    lay.add(g.timeseries("Completion ratio per band", [
        Query(fleet.sel("kvwatch:request_completion:ratio_rate5m", labels=_FLEET_BAND),
              "{{model_name}} " + band)],
        description="(completed + truncated) / finished, 5m. Long bands falling while short bands hold is "
                    "starvation (KVWatchLongRequestsStarving).", unit="percentunit", min_=0, max_=1), 12, 8)
    lay.add(g.timeseries("Abandonment ratio per band", [
        Query(fleet.sel("kvwatch:request_outcome:ratio_rate5m", 'outcome="aborted"', labels=_FLEET_BAND),
              "{{model_name}} " + band)],
        description="Share of finished requests whose client went away, 5m.", unit="percentunit", min_=0),
        12, 8)
    lay.add(g.timeseries("Truncation ratio per band", [
        Query(fleet.sel("kvwatch:request_outcome:ratio_rate5m", 'outcome="truncated"', labels=_FLEET_BAND),
              "{{model_name}} " + band)],
        description="Share of finished requests cut by their max_tokens, 5m.", unit="percentunit", min_=0),
        12, 8)

    lay.row("Load and output lengths")
    adm = "{{admission_band}}"
    lay.add(g.timeseries("In flight by admission band", [
        Query(f"sum by (admission_band) ({s.sel('kvwatch_requests_in_flight')})", adm)],
        description="Requests being relayed now by the proxy, by band of their max_tokens.", stack=True,
        min_=0), 8, 8)
    lay.add(g.timeseries("In-flight tokens by admission band", [
        Query(f"sum by (admission_band) ({s.sel('kvwatch_in_flight_tokens')})", adm)],
        description="Estimated tokens (prompt + generated so far) held by in-flight requests.", stack=True,
        min_=0), 8, 8)
    lay.add(g.bargauge("Output length distribution", [
        Query(f"sum by (le) (increase({s.sel('kvwatch_request_output_tokens_bucket')}[$__range]))", "{{le}}",
              instant=True, heatmap=True)],
        description="Finished requests by output tokens over the time range (cumulative buckets as "
                    "counts per bucket).", unit="short"), 8, 8)
    per_step = f"sum by (le) (increase({s.sel('kvwatch_request_output_tokens_bucket')}[{RATE}]))"
    lay.add(g.heatmap("Output length over time", Query(per_step, "{{le}}", heatmap=True),
        description="Finished requests per output-token bucket over time.", unit="short"), 12, 8)
    lay.add(g.timeseries("Requests with estimated output tokens", [
        Query(f"sum({s.rate('kvwatch_request_output_tokens_estimated_total')})\n/\n"
              f"(sum({s.rate('kvwatch_requests_total')}) > 0)", "estimated")],
        description="Share of requests whose tokens were counted from chunks (no usage arrived): their band "
                    "can be off.", unit="percentunit", min_=0), 12, 8)

    return Board(LATENCY_UID, "kvwatch / Latency by length band",
                 "TTFT, TPOT and end-to-end latency per output-length band, SLO attainment, burn rates and "
                 "error budget, outcomes per band, in-flight load and output-length distribution.",
                 _variables(("cluster", "node", "model", "replica", "band", "ttft_slo", "tpot_slo"),
                            opts.job),
                 tuple(lay.panels), _links())


# --------------------------------------------------------------------------------------------
# Fleet
# --------------------------------------------------------------------------------------------


def fleet_board(opts: Options) -> Board:
    s = Scope(("cluster", "model"))
    rep = "{{instance}} {{replica}} {{dp_rank}}"
    lay = g.Layout()

    lay.row("Fleet")
    lay.add(g.stat("kvwatch agents up", [
        Query('sum(up{cluster=~"$cluster", job=~"$job"})', "up"),
        Query('count(up{cluster=~"$cluster", job=~"$job"})', "scraped")],
        description="kvwatch agents Prometheus scraped successfully, of those it knows."), 4, 4)
    lay.add(g.stat("Engines down", [Query(f"count({s.sel('kvwatch_target_up')} == 0) or vector(0)")],
                   description="Engine replicas kvwatch cannot scrape.",
                   thresholds=((None, "green"), (1, "red"))), 4, 4)
    capacity = s.sel("kvwatch:kv_capacity_tokens:sum", labels=_FLEET_MODEL)
    lay.add(g.stat("KV capacity", [Query(f"sum({capacity})")],
                   description="KV tokens across the selected models' replicas.", unit="short"), 4, 4)
    stranded = s.sel("kvwatch:kv_stranded:ratio", labels=_FLEET_MODEL)
    lay.add(g.stat("Most stranded KV", [Query(f"max({stranded})")],
                   description="Largest share of a model's KV capacity free on idle replicas while others "
                               "queue.", unit="percentunit", thresholds=((None, "green"), (0.2, "orange"))),
                               4, 4)
    lay.add(g.stat("Firing kvwatch alerts", [
        Query('count(ALERTS{alertname=~"KVWatch.+", alertstate="firing", cluster=~"$cluster"}) '
              "or vector(0)")],
        description="kvwatch alerts firing now (pages and tickets).", thresholds=_ANY_IS_RED),
        4, 4)
    lay.add(g.stat("GPUs lost", [Query(f"count({s.sel('kvwatch_gpu_lost')} == 1) or vector(0)")],
                   description="GPUs NVML reports lost, across nodes.", thresholds=_ANY_IS_RED),
            4, 4)

    lay.row("Stranded capacity")
    lay.add(g.timeseries("Stranded KV tokens per model", [
        Query(s.sel("kvwatch:kv_stranded_tokens:sum", labels=_FLEET_MODEL), "{{model_name}} across nodes"),
        Query(f"sum by (model_name) ({s.sel('kvwatch_kv_stranded_tokens')})", "{{model_name}} within nodes")],
        description="Free KV tokens on replicas with nothing waiting while another replica of the same model "
                    "queues or preempts, across nodes (recording rule) and summed over each node's own "
                    "view (agent).", min_=0), 12, 8)
    lay.add(g.timeseries("Stranded share of capacity", [
        Query(s.sel("kvwatch:kv_stranded:ratio", labels=_FLEET_MODEL), "{{model_name}}")],
        description="Stranded tokens / the model's KV capacity. KVWatchKVCapacityStranded fires above 20%.",
        unit="percentunit", min_=0, max_=1, thresholds=((None, "green"), (0.2, "red")), threshold_lines=True),
        12, 8)

    lay.row("Replicas under the most pressure")
    lay.add(g.table("Fullest KV caches", [Query(f"topk(10, {s.sel('kvwatch_kv_usage_ratio')})", rep,
                                                instant=True, table=True)],
                    description="The 10 replicas with the highest KV occupancy.", unit="percentunit",
                    hide=("Time", "job", "__name__")), 8, 8)
    lay.add(g.table("Least KV headroom", [Query(f"bottomk(10, {s.sel('kvwatch_kv_headroom_seconds')})", rep,
                                                instant=True, table=True)],
                    description="The 10 replicas closest to a full KV pool at their current growth.",
                    unit="s", hide=("Time", "job", "__name__")), 8, 8)
    lay.add(g.table("Most preemptions", [
        Query(f"topk(10, {s.sel('kvwatch:preemptions:rate5m', labels=_REPLICA_LABELS)})", rep, instant=True,
              table=True)],
        description="The 10 replicas preempting the most per second (5m rate).", unit="reqps",
        hide=("Time", "job", "__name__")), 8, 8)
    lay.add(g.timeseries("KV occupancy across replicas", [
        Query(f"max by (model_name) ({s.sel('kvwatch_kv_usage_ratio')})", "{{model_name}} max"),
        Query(f"quantile by (model_name) (0.5, {s.sel('kvwatch_kv_usage_ratio')})", "{{model_name}} median"),
        Query(f"min by (model_name) ({s.sel('kvwatch_kv_usage_ratio')})", "{{model_name}} min")],
        description="Spread of KV occupancy over a model's replicas: a wide spread with queues is stranded "
                    "capacity.", unit="percentunit", min_=0, max_=1), 12, 8)
    lay.add(g.timeseries("KV tier traffic / PCIe bandwidth, top 10", [
        Query(f"topk(10, {s.sel('kvwatch:kv_tier_pcie:ratio_rate5m', labels=_TIER_LABELS)})",
              "{{instance}} {{replica}} {{direction}}", sparse=True)],
        description="Replicas whose KV offload/onload uses the most of their GPUs' PCIe bandwidth (needs "
                    "KV offload and the replica -> GPU map).", unit="percentunit", min_=0), 12, 8)

    lay.row("Service level per band")
    slo_legend = "{{slo}} {{model_name}} {{length_band}}"
    lay.add(g.bargauge("Error budget left", [
        Query(s.sel("kvwatch:slo_error_budget_remaining:ratio", labels=_SLO_LABELS), slo_legend)],
        description="Share of each SLO's error budget left for the period, per model and band.",
        unit="percentunit", max_=1, thresholds=_BUDGET), 8, 10)
    lay.add(g.timeseries("Burn rate, 1h", [Query(_burn_rate("1h", s), slo_legend)],
                         description="Error ratio over 1h / error budget, per objective and band.", min_=0,
                         thresholds=_PAGE_BURN, threshold_lines=True), 8, 10)
    lay.add(g.timeseries("Completion ratio per band, 1h", [
        Query(s.sel("kvwatch:request_completion:ratio_rate1h", labels=_FLEET_BAND),
              "{{model_name}} {{length_band}}")],
        description="(completed + truncated) / finished over 1h per band.", unit="percentunit", min_=0,
        max_=1), 8, 10)

    node_url = f"/d/{NODE_UID}/kvwatch-node?${{__url_time_range}}&var-node=${{__data.fields.instance}}"
    lay.row("Nodes")
    lay.add(g.table("Nodes", [
        Query(f"max by (cluster, instance) ({s.sel('kvwatch_kv_usage_ratio')})", instant=True, table=True),
        Query(f"sum by (cluster, instance) ({s.rate('kvwatch_preemptions_total')})",
              instant=True, table=True),
        Query(f"sum by (cluster, instance) ({s.sel('kvwatch_target_up')})", instant=True, table=True),
        Query(f"count by (cluster, instance) ({s.sel('kvwatch_gpu_info')})", instant=True, table=True)],
        description="Per node: highest KV occupancy (A), preemptions/s (B), engines up (C), GPUs (D). Click "
                    "a row for its Node dashboard.",
        links=[{"title": "Node dashboard", "url": node_url}], hide=("Time",)), 24, 8)

    return Board(FLEET_UID, "kvwatch / Fleet",
                 "Across nodes: stranded KV capacity per model, the replicas under the most pressure, error "
                 "budget and burn rate per band, node overview.",
                 _variables(("cluster", "job", "model"), opts.job), tuple(lay.panels), _links())


# --------------------------------------------------------------------------------------------
# rendering, checks, the query list
# --------------------------------------------------------------------------------------------


def boards(opts: Options | None = None) -> list[Board]:
    opts = opts or Options()
    return [node_board(opts), latency_board(opts), fleet_board(opts)]


def render_dashboards(opts: Options | None = None) -> dict[str, str]:
    return {b.filename: json.dumps(b.json(), indent=2, ensure_ascii=False) + "\n" for b in boards(opts)}


def recorded_series() -> set[str]:
    """Names kvwatch's rules record (SLO names do not depend on the objectives)."""
    slo = slo_from_mapping({"objectives": [
        {"name": "l", "sli": "ttft", "threshold": 1, "objective": 0.99, "bands": "*"},
        {"name": "c", "sli": "completion", "objective": 0.99, "bands": "*"}]})
    return recorded_names(rule_files(slo))


_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*\w+\)$", re.DOTALL)


def variable_selectors(board: Board) -> list[str]:
    """The series selector inside each label_values() variable query."""
    out = []
    for var in board.variables:
        if var.get("type") == "query":
            m = _LABEL_VALUES.match(var["definition"])
            if not m:
                raise ValueError(f"{board.uid}: variable {var['name']} is not label_values(selector, label)")
            out.append(m.group(1))
    return out


def name_problems(all_boards: Sequence[Board]) -> list[str]:
    """Every panel or variable query that reads a series kvwatch does not export, record or allow."""
    recorded = recorded_series()
    problems = []
    for board in all_boards:
        for panel in board.panels:
            for q in g.queries_of(panel):
                problems += [f"{board.uid}: {panel['title']}: {p}" for p in unknown_names(q.expr, recorded)]
        for sel in variable_selectors(board):
            problems += [f"{board.uid}: variable: {p}" for p in unknown_names(sel, recorded)]
    return problems


# names start with a letter or "_": "$1" in label_replace() is a regex group, not a variable
_VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)|\[\[([A-Za-z_]\w*)\]\]")


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Replace Grafana variables (``$x``, ``${x}``, ``[[x]]``) by concrete values; KeyError names an
    unknown variable."""
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise KeyError(f"no value for dashboard variable ${name} in {expr!r}")
        return values[name]
    return _VARIABLE.sub(repl, expr)


@dataclass(frozen=True, slots=True)
class PanelQuery:
    """One query of one panel, with its variables substituted."""

    dashboard: str  # uid
    panel: str  # title
    ref_id: str
    expr: str  # as in the dashboard JSON
    concrete: str  # variables replaced
    instant: bool
    sparse: bool  # only has series once an event happened (XIDs, scrape errors, firing alerts) or
    # with an optional feature in use (KV offload tiers)
    external: bool  # reads another exporter's series (dcgm-exporter): empty without it


def panel_queries(values: Mapping[str, str] | None = None, opts: Options | None = None) -> list[PanelQuery]:
    """Every (dashboard, panel, query) kvwatch ships, with concrete PromQL to run against a real
    Prometheus. ``values`` overrides DEFAULT_VALUES (e.g. ``{"node": "127.0.0.1:9477"}``)."""
    merged = {**DEFAULT_VALUES, **(values or {})}
    out = []
    for board in boards(opts):
        for panel in board.panels:
            for i, q in enumerate(g.queries_of(panel)):
                names = referenced_metrics(q.expr)
                out.append(PanelQuery(
                    dashboard=board.uid, panel=panel["title"], ref_id=chr(ord("A") + i), expr=q.expr,
                    concrete=substitute(q.expr, merged), instant=q.instant, sparse=q.sparse,
                    external=any(n.startswith("DCGM_FI_") for n in names)))
    return out

