"""The Fleet dashboard: across nodes, stranded KV capacity per model, the replicas under the most
pressure, error budget and burn rate per band, and a node overview."""

from __future__ import annotations

from kvwatch.mixin import grafana as g
from kvwatch.mixin.dashboards.scaffold import (
    ANY_IS_RED,
    BUDGET,
    FLEET_BAND,
    FLEET_MODEL,
    FLEET_UID,
    NODE_UID,
    PAGE_BURN,
    REPLICA_LABELS,
    SLO_LABELS,
    TIER_LABELS,
    Board,
    Options,
    Scope,
    burn_rate,
    links,
    variables,
)
from kvwatch.mixin.grafana import Query


def fleet_board(opts: Options) -> Board:
    s = Scope(("cluster", "model"))
    rep = "{{instance}} {{replica}} {{dp_rank}}"
    lay = g.Layout()

    lay.row("Fleet")
    lay.add(
        g.stat(
            "kvwatch agents up",
            [
                Query('sum(up{cluster=~"$cluster", job=~"$job"})', "up"),
                Query('count(up{cluster=~"$cluster", job=~"$job"})', "scraped"),
            ],
            description="kvwatch agents Prometheus scraped successfully, of those it knows.",
        ),
        4,
        4,
    )
    lay.add(
        g.stat(
            "Engines down",
            [Query(f"count({s.sel('kvwatch_target_up')} == 0) or vector(0)")],
            description="Engine replicas kvwatch cannot scrape.",
            thresholds=((None, "green"), (1, "red")),
        ),
        4,
        4,
    )
    capacity = s.sel("kvwatch:kv_capacity_tokens:sum", labels=FLEET_MODEL)
    lay.add(
        g.stat(
            "KV capacity",
            [Query(f"sum({capacity})")],
            description="KV tokens across the selected models' replicas.",
            unit="short",
        ),
        4,
        4,
    )
    stranded = s.sel("kvwatch:kv_stranded:ratio", labels=FLEET_MODEL)
    lay.add(
        g.stat(
            "Most stranded KV",
            [Query(f"max({stranded})")],
            description="Largest share of a model's KV capacity free on idle replicas while others queue.",
            unit="percentunit",
            thresholds=((None, "green"), (0.2, "orange")),
        ),
        4,
        4,
    )
    lay.add(
        g.stat(
            "Firing kvwatch alerts",
            [
                Query(
                    'count(ALERTS{alertname=~"KVWatch.+", alertstate="firing", cluster=~"$cluster"}) '
                    "or vector(0)"
                )
            ],
            description="kvwatch alerts firing now (pages and tickets).",
            thresholds=ANY_IS_RED,
        ),
        4,
        4,
    )
    lay.add(
        g.stat(
            "GPUs lost",
            [Query(f"count({s.sel('kvwatch_gpu_lost')} == 1) or vector(0)")],
            description="GPUs NVML reports lost, across nodes.",
            thresholds=ANY_IS_RED,
        ),
        4,
        4,
    )

    lay.row("Stranded capacity")
    lay.add(
        g.timeseries(
            "Stranded KV tokens per model",
            [
                Query(
                    s.sel("kvwatch:kv_stranded_tokens:sum", labels=FLEET_MODEL), "{{model_name}} across nodes"
                ),
                Query(
                    f"sum by (model_name) ({s.sel('kvwatch_kv_stranded_tokens')})",
                    "{{model_name}} within nodes",
                ),
            ],
            description="Free KV tokens on replicas with nothing waiting while another replica of the "
            "same model queues or preempts, across nodes (recording rule) and summed over each node's own "
            "view (agent).",
            min_=0,
        ),
        12,
        8,
    )
    lay.add(
        g.timeseries(
            "Stranded share of capacity",
            [Query(s.sel("kvwatch:kv_stranded:ratio", labels=FLEET_MODEL), "{{model_name}}")],
            description="Stranded tokens / the model's KV capacity. "
            "KVWatchKVCapacityStranded fires above 20%.",
            unit="percentunit",
            min_=0,
            max_=1,
            thresholds=((None, "green"), (0.2, "red")),
            threshold_lines=True,
        ),
        12,
        8,
    )

    lay.row("Replicas under the most pressure")
    lay.add(
        g.table(
            "Fullest KV caches",
            [Query(f"topk(10, {s.sel('kvwatch_kv_usage_ratio')})", rep, instant=True, table=True)],
            description="The 10 replicas with the highest KV occupancy.",
            unit="percentunit",
            hide=("Time", "job", "__name__"),
        ),
        8,
        8,
    )
    lay.add(
        g.table(
            "Least KV headroom",
            [Query(f"bottomk(10, {s.sel('kvwatch_kv_headroom_seconds')})", rep, instant=True, table=True)],
            description="The 10 replicas closest to a full KV pool at their current growth.",
            unit="s",
            hide=("Time", "job", "__name__"),
        ),
        8,
        8,
    )
    lay.add(
        g.table(
            "Most preemptions",
            [
                Query(
                    f"topk(10, {s.sel('kvwatch:preemptions:rate5m', labels=REPLICA_LABELS)})",
                    rep,
                    instant=True,
                    table=True,
                )
            ],
            description="The 10 replicas preempting the most per second (5m rate).",
            unit="reqps",
            hide=("Time", "job", "__name__"),
        ),
        8,
        8,
    )
    lay.add(
        g.timeseries(
            "KV occupancy across replicas",
            [
                Query(f"max by (model_name) ({s.sel('kvwatch_kv_usage_ratio')})", "{{model_name}} max"),
                Query(
                    f"quantile by (model_name) (0.5, {s.sel('kvwatch_kv_usage_ratio')})",
                    "{{model_name}} median",
                ),
                Query(f"min by (model_name) ({s.sel('kvwatch_kv_usage_ratio')})", "{{model_name}} min"),
            ],
            description="Spread of KV occupancy over a model's replicas: a wide spread with queues is "
            "stranded capacity.",
            unit="percentunit",
            min_=0,
            max_=1,
        ),
        12,
        8,
    )
    lay.add(
        g.timeseries(
            "KV tier traffic / PCIe bandwidth, top 10",
            [
                Query(
                    f"topk(10, {s.sel('kvwatch:kv_tier_pcie:ratio_rate5m', labels=TIER_LABELS)})",
                    "{{instance}} {{replica}} {{direction}}",
                    sparse=True,
                )
            ],
            description="Replicas whose KV offload/onload uses the most of their GPUs' PCIe bandwidth (needs "
            "KV offload and the replica -> GPU map).",
            unit="percentunit",
            min_=0,
        ),
        12,
        8,
    )

    lay.row("Service level per band")
    slo_legend = "{{slo}} {{model_name}} {{length_band}}"
    lay.add(
        g.bargauge(
            "Error budget left",
            [Query(s.sel("kvwatch:slo_error_budget_remaining:ratio", labels=SLO_LABELS), slo_legend)],
            description="Share of each SLO's error budget left for the period, per model and band.",
            unit="percentunit",
            max_=1,
            thresholds=BUDGET,
        ),
        8,
        10,
    )
    lay.add(
        g.timeseries(
            "Burn rate, 1h",
            [Query(burn_rate("1h", s), slo_legend)],
            description="Error ratio over 1h / error budget, per objective and band.",
            min_=0,
            thresholds=PAGE_BURN,
            threshold_lines=True,
        ),
        8,
        10,
    )
    lay.add(
        g.timeseries(
            "Completion ratio per band, 1h",
            [
                Query(
                    s.sel("kvwatch:request_completion:ratio_rate1h", labels=FLEET_BAND),
                    "{{model_name}} {{length_band}}",
                )
            ],
            description="(completed + truncated) / finished over 1h per band.",
            unit="percentunit",
            min_=0,
            max_=1,
        ),
        8,
        10,
    )

    node_url = f"/d/{NODE_UID}/kvwatch-node?${{__url_time_range}}&var-node=${{__data.fields.instance}}"
    lay.row("Nodes")
    lay.add(
        g.table(
            "Nodes",
            [
                Query(
                    f"max by (cluster, instance) ({s.sel('kvwatch_kv_usage_ratio')})",
                    instant=True,
                    table=True,
                ),
                Query(
                    f"sum by (cluster, instance) ({s.rate('kvwatch_preemptions_total')})",
                    instant=True,
                    table=True,
                ),
                Query(f"sum by (cluster, instance) ({s.sel('kvwatch_target_up')})", instant=True, table=True),
                Query(
                    f"count by (cluster, instance) ({s.sel('kvwatch_gpu_info')})", instant=True, table=True
                ),
            ],
            description="Per node: highest KV occupancy (A), preemptions/s (B), engines up (C), GPUs (D). "
            "Click a row for its Node dashboard.",
            links=[{"title": "Node dashboard", "url": node_url}],
            hide=("Time",),
        ),
        24,
        8,
    )

    return Board(
        FLEET_UID,
        "kvwatch / Fleet",
        "Across nodes: stranded KV capacity per model, the replicas under the most pressure, error "
        "budget and burn rate per band, node overview.",
        variables(("cluster", "job", "model"), opts.job),
        tuple(lay.panels),
        links(),
    )
