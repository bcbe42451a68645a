"""The Node dashboard: per replica KV cache, preemption and recompute, KV tier traffic beside PCIe,
GPU memory, NVLink, throttling, XIDs, and kvwatch's own health."""

from __future__ import annotations

from kvwatch.mixin import grafana as g
from kvwatch.mixin.dashboards.scaffold import (
    ANY_IS_BAD,
    ANY_IS_RED,
    BYTES,
    BYTES_PER_S,
    COUNT,
    NODE_UID,
    ON_OFF,
    PCT_HIGH_BAD,
    RATE,
    REPLICA_LABELS,
    REQUESTS_PER_S,
    SECONDS,
    SHARE,
    SHIPPED_ALERTS,
    TIER_LABELS,
    WHOLE_SHARE,
    Board,
    Options,
    Scope,
    dcgm_link,
    fires_above,
    links,
    variables,
)
from kvwatch.mixin.grafana import Query


def node_board(opts: Options) -> Board:
    s = Scope(("cluster", "node", "model", "replica"))
    rep = "{{instance}} {{replica}} {{dp_rank}}"
    gpu = "{{instance}} GPU {{gpu}}"
    lay = g.Layout()

    lay.row("Overview", 4, 4)
    lay.add(
        g.stat(
            "Engines up",
            [
                Query(f"sum({s.sel('kvwatch_target_up')})", "up"),
                Query(f"count({s.sel('kvwatch_target_up')})", "configured"),
            ],
            "Engine replicas whose last metrics scrape succeeded, of those configured.",
        ),
        g.stat(
            "Highest KV occupancy",
            [Query(f"max({s.sel('kvwatch_kv_usage_ratio')})")],
            "The fullest KV cache among the selected replicas (engine's own figure).",
            unit="percentunit",
            thresholds=PCT_HIGH_BAD,
        ),
        g.stat(
            "Lowest KV headroom",
            [Query(f"min({s.sel('kvwatch_kv_headroom_seconds')})")],
            "Seconds until the first KV pool fills at its current growth.",
            unit="s",
            thresholds=((None, "red"), (120, "orange"), (300, "green")),
        ),
        g.stat(
            "Preemptions, all replicas",
            [Query(f"sum({s.rate('kvwatch_preemptions_total')})")],
            "Requests preempted (vLLM) or retracted (SGLang) per second.",
            unit="reqps",
            thresholds=((None, "green"), (0.05, "orange"), (1, "red")),
        ),
        g.stat(
            "Waiting requests",
            [Query(f"sum({s.sel('kvwatch_requests_waiting')})")],
            "Requests queued in the engines.",
            thresholds=ANY_IS_BAD,
        ),
        g.stat(
            "GPUs lost",
            [Query(f"sum({s.sel('kvwatch_gpu_lost')})")],
            "GPUs NVML reports lost (fallen off the bus).",
            thresholds=ANY_IS_RED,
        ),
    )

    headroom = f"clamp_max({s.sel('kvwatch_kv_headroom_seconds')}, 3600)"
    lay.row("KV cache", 12, 8)
    lay.add(
        g.timeseries(
            "KV occupancy per replica",
            [Query(s.sel("kvwatch_kv_usage_ratio"), rep)],
            "KV cache in use as the engine reports it (vLLM: blocks held by live "
            "requests; SGLang: token slots).",
            WHOLE_SHARE,
            thresholds=PCT_HIGH_BAD,
        ),
        g.timeseries(
            "Internal fragmentation",
            [Query(s.sel("kvwatch_kv_fragmentation_ratio"), f"{rep} ({{{{source}}}})")],
            "1 - live tokens / (used blocks x block size): block slots held but not filled. "
            "source=proxy_estimate when live tokens come from the proxy's accounting.",
            WHOLE_SHARE,
        ),
        g.timeseries(
            "KV headroom",
            [Query(headroom, rep)],
            "Seconds until the KV pool is full at the current net growth (shown up "
            "to 1h; +Inf when not growing).",
            SECONDS,
            thresholds=((None, "red"), (300, "green")),
        ),
        g.timeseries(
            "KV tokens: capacity, in use, live",
            [
                Query(s.sel("kvwatch_kv_capacity_tokens"), f"{rep} capacity"),
                Query(
                    f"{s.sel('kvwatch_kv_capacity_tokens')} - {s.sel('kvwatch_kv_free_tokens')}",
                    f"{rep} in use",
                ),
                Query(f"max without (source) ({s.sel('kvwatch_kv_live_tokens')})", f"{rep} live"),
            ],
            "In use = capacity - free (held by live requests); live = tokens the running "
            "requests actually hold. The gap is fragmentation.",
            COUNT,
        ),
        g.timeseries(
            "Running and waiting requests",
            [
                Query(s.sel("kvwatch_requests_running"), f"{rep} running"),
                Query(s.sel("kvwatch_requests_waiting"), f"{rep} waiting"),
            ],
            "The engine's running batch and its queue.",
            COUNT,
        ),
        g.timeseries(
            "Over-committed requests",
            [Query(s.sel("kvwatch_kv_overcommitted_requests"), rep)],
            "Running requests whose max_tokens could not all fit if every request ran to its limit.",
            COUNT,
        ),
    )

    waste = s.sel("kvwatch:recompute_waste:ratio_rate15m", labels=REPLICA_LABELS)
    lay.row("Preemption and recompute", 8, 8)
    lay.add(
        g.timeseries(
            "Preemptions",
            [Query(s.rate("kvwatch_preemptions_total"), rep)],
            "Preemptions (vLLM) or retractions (SGLang) per second.",
            REQUESTS_PER_S,
        ),
        g.timeseries(
            "Recomputed tokens",
            [Query(s.rate("kvwatch_recomputed_tokens_total"), f"{rep} ({{{{source}}}})")],
            "Tokens recomputed after preemption per second; source=estimate is preemptions "
            "x mean live tokens per running request.",
            COUNT,
        ),
        g.timeseries(
            "Recompute waste",
            [Query(waste, rep)],
            "Recomputed tokens per token processed (prompt + output), 15m rate. "
            f"KVWatchRecomputeWaste fires above {SHIPPED_ALERTS.recompute_waste_ratio:.0%}.",
            SHARE,
            thresholds=fires_above(SHIPPED_ALERTS.recompute_waste_ratio),
        ),
    )

    lay.row("KV tier traffic beside PCIe", 12, 8)
    lay.add(
        g.timeseries(
            "KV tier traffic (engine)",
            [
                Query(
                    f"sum without (family) ({s.rate('kvwatch_kv_tier_transfer_bytes_total')})",
                    "{{instance}} {{replica}} {{src_tier}} → {{dst_tier}}",
                    sparse=True,
                )
            ],
            "KV bytes the engine moved between tiers (vLLM offload connectors, LMCache, SGLang "
            "HiCache, Dynamo KVBM, TRT-LLM).",
            BYTES_PER_S,
        ),
        g.timeseries(
            "PCIe traffic (NVML) and link bandwidth",
            [
                Query(s.rate("kvwatch_gpu_pcie_tx_bytes_total"), f"{gpu} tx"),
                Query(s.rate("kvwatch_gpu_pcie_rx_bytes_total"), f"{gpu} rx"),
                Query(s.sel("kvwatch_gpu_pcie_link_max_bytes_per_second"), f"{gpu} link max"),
            ],
            "Everything that crossed each GPU's PCIe link (NVML byte counters) next to the "
            "link's one-direction bandwidth as trained. More than the engine's tier traffic means "
            "something else uses the bus.",
            BYTES_PER_S,
        ),
        g.timeseries(
            "KV tier traffic / PCIe bandwidth",
            [
                Query(
                    s.sel("kvwatch:kv_tier_pcie:ratio_rate5m", labels=TIER_LABELS),
                    "{{instance}} {{replica}} {{direction}}",
                    sparse=True,
                )
            ],
            "A replica's offload (or onload) bytes over the one-direction bandwidth of its GPUs' "
            f"links. KVWatchKVTierPCIeSaturated fires above {SHIPPED_ALERTS.tier_pcie_ratio:.0%}. Needs the "
            "replica -> GPU map.",
            SHARE,
            thresholds=fires_above(SHIPPED_ALERTS.tier_pcie_ratio),
        ),
        g.timeseries(
            "Recompute avoided per MB moved",
            [
                Query(
                    f"1e6 * {s.sel('kvwatch_kv_tier_recompute_avoided_tokens_per_byte')}",
                    "{{instance}} {{replica}}",
                    sparse=True,
                )
            ],
            "What the replica's KV tiers buy: tokens loaded back to the GPU instead of "
            "recomputed, per MB offloaded plus onloaded (rate window). Near 0 while KV moves: "
            "the tier stores what is never reused and only costs PCIe bandwidth. A token's KV "
            "is ~0.1-0.3 MB on the presets, so a tier that returns everything it stores reads "
            "about half of 1 / (MB per token).",
            COUNT,
        ),
        g.table(
            "PCIe links",
            [
                # aggregated, so no query carries its own __name__: Grafana's merge joins rows only
                # where the fields they share agree, and four names gave four rows per GPU
                *(
                    Query(f"max without () ({s.sel(name)})", instant=True, table=True)
                    for name in (
                        "kvwatch_gpu_pcie_link_generation",
                        "kvwatch_gpu_pcie_link_generation_max",
                        "kvwatch_gpu_pcie_link_width",
                        "kvwatch_gpu_pcie_link_width_max",
                    )
                ),
                Query(
                    f"increase({s.sel('kvwatch_gpu_pcie_replays_total')}[$__range])", instant=True, table=True
                ),
            ],
            "Generation and width as trained vs maximum (A: gen, B: max gen, C: width, D: max "
            "width, E: replays in range). GPUs lower the generation when idle; under load it "
            "should match the maximum.",
            hide=("Time", "job", "__name__"),
        ),
    )

    dcgm_url = (
        f"/d/{opts.dcgm_dashboard_uid}/nvidia-dcgm-exporter-dashboard?${{__url_time_range}}"
        "&var-Hostname=${__data.fields.node}&var-gpu=${__data.fields.gpu}"
        "&var-UUID=${__data.fields.uuid}"
    )
    lay.row("GPUs", 12, 8)
    lay.add(
        g.timeseries(
            "GPU memory",
            [
                Query(s.sel("kvwatch_gpu_memory_used_bytes"), f"{gpu} used"),
                Query(s.sel("kvwatch_gpu_memory_total_bytes"), f"{gpu} total"),
            ],
            "Framebuffer used by processes, against the total.",
            BYTES,
        ),
        g.timeseries(
            "GPU utilization",
            [Query(s.sel("kvwatch_gpu_utilization_ratio"), gpu)],
            "Share of the sample period a kernel ran (not SM occupancy).",
            WHOLE_SHARE,
        ),
        g.timeseries(
            "NVLink traffic",
            [
                Query(
                    f"sum by (cluster, instance, gpu) ({s.rate(f'kvwatch_gpu_nvlink_{d}_bytes_total')})",
                    f"{gpu} {d}",
                )
                for d in ("tx", "rx")
            ],
            "NVLink data bytes per GPU, all links summed.",
            BYTES_PER_S,
        ),
        g.timeseries(
            "Power and temperature",
            [
                Query(s.sel("kvwatch_gpu_power_watts"), f"{gpu} W"),
                Query(s.sel("kvwatch_gpu_temperature_celsius"), f"{gpu} {{{{sensor}}}} °C"),
            ],
            "Power draw (W) and temperatures (°C, GPU and HBM) on one axis.",
        ),
        g.timeseries(
            "Clock events (throttling)",
            [Query(s.sel("kvwatch_gpu_clock_event_active", 'reason!="gpu_idle"'), f"{gpu} {{{{reason}}}}")],
            "1 while a clock-event reason is active. hw_/sw_thermal_slowdown, hw_slowdown and "
            "hw_power_brake_slowdown slow the GPU against its will; sw_power_cap is normal "
            "under load.",
            ON_OFF,
            step=True,
        ),
        g.timeseries(
            "XIDs and ECC errors",
            [
                Query(
                    f"increase({s.sel('kvwatch_gpu_xid_errors_total')}[{RATE}])",
                    f"{gpu} XID {{{{xid}}}}",
                    sparse=True,
                ),
                Query(
                    f"increase({s.sel('kvwatch_gpu_ecc_errors_total')}[{RATE}])", f"{gpu} ECC {{{{type}}}}"
                ),
            ],
            "XID events per code (a series appears with the first event) and ECC errors. See the "
            "KVWatchGPUCriticalXID runbook for what each XID means.",
            COUNT,
        ),
        g.table(
            "GPUs (open in the DCGM dashboard)",
            [
                Query(
                    f"{s.sel('kvwatch_gpu_info')} * on (cluster, instance) group_left (node) "
                    f"{s.sel('kvwatch_build_info')}",
                    instant=True,
                    table=True,
                ),
                Query(s.sel("kvwatch_gpu_remapped_rows", 'type="uncorrectable"'), instant=True, table=True),
            ],
            "kvwatch's GPUs with the node name dcgm-exporter uses; click a row to open the "
            "dcgm-exporter dashboard for that GPU (uuid = dcgm-exporter's UUID label).",
            links=[{"title": "dcgm-exporter: this GPU", "url": dcgm_url, "targetBlank": True}],
            hide=("Time", "job", "__name__", "Value #A", "type"),
        ),
        g.table(
            "Replicas on GPUs",
            [Query(s.sel("kvwatch_replica_gpu_info"), instant=True, table=True)],
            "Which GPUs each replica runs on, and how kvwatch found out (config, "
            "the engine's PIDs, CUDA_VISIBLE_DEVICES).",
            hide=("Time", "job", "__name__", "Value"),
        ),
        g.timeseries(
            "Tensor core activity (dcgm-exporter)",
            [
                Query(
                    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE * on (UUID) group_left () max by (UUID) (label_replace("
                    f'{s.sel("kvwatch_gpu_info")}, "UUID", "$1", "uuid", "(.*)"))',
                    "GPU {{gpu}} {{UUID}}",
                )
            ],
            "dcgm-exporter's profiling field for the GPUs of the selected nodes, joined on UUID. "
            "Empty without dcgm-exporter (or without its DCP metrics).",
            WHOLE_SHARE,
        ),
    )

    lay.row("kvwatch agent", 8, 8)
    lay.add(
        g.timeseries(
            "Collectors",
            [Query(s.sel("kvwatch_collector_success"), "{{instance}} {{collector}}")],
            "1 if the collector's last run succeeded (engines, NVML, GPU mapping, export areas).",
            ON_OFF,
            step=True,
        ),
        g.timeseries(
            "Source staleness",
            [
                Query(
                    f"time() - {s.sel('kvwatch_source_last_success_timestamp_seconds')}",
                    "{{instance}} {{source}}",
                )
            ],
            "Seconds since each source last succeeded. KVWatchSourceStale fires past "
            f"{SHIPPED_ALERTS.source_stale_seconds / 60:g} minutes.",
            SECONDS,
        ),
        g.timeseries(
            "Engine scrape errors",
            [
                Query(
                    s.rate("kvwatch_target_scrape_errors_total"),
                    "{{instance}} {{replica}} {{reason}}",
                    sparse=True,
                )
            ],
            "Failed scrapes of engine metrics by reason.",
            COUNT,
        ),
    )

    return Board(
        NODE_UID,
        "kvwatch / Node",
        "Per replica KV cache (occupancy, fragmentation, headroom, preemption, recompute), KV tier "
        "traffic beside PCIe, GPU memory, NVLink, throttling and XIDs, and kvwatch's own health.",
        variables(("cluster", "job", "node", "model", "replica"), opts.job),
        tuple(lay.panels),
        (*links(), dcgm_link(opts)),
    )
