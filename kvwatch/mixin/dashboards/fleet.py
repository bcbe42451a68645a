"""The Fleet dashboard: across nodes, stranded KV capacity per model, the replicas under the most
pressure, error budget and burn rate per band, and a node overview."""

from __future__ import annotations

from kvwatch.mixin import grafana as g
from kvwatch.mixin.dashboards.scaffold import (
    ANY_IS_RED,
    COUNT,
    FLEET_BAND,
    FLEET_MODEL,
    FLEET_UID,
    NODE_UID,
    REPLICA_LABELS,
    SHARE,
    SHIPPED_ALERTS,
    TIER_LABELS,
    WHOLE_SHARE,
    Board,
    Options,
    Scope,
    budget_left_panel,
    burn_rate_panel,
    fires_above,
    links,
    variables,
)
from kvwatch.mixin.grafana import Query


def fleet_board(opts: Options) -> Board:
    s = Scope(("cluster", "model"))
    rep = "{{instance}} {{replica}} {{dp_rank}}"
    lay = g.Layout()

    capacity = s.sel("kvwatch:kv_capacity_tokens:sum", labels=FLEET_MODEL)
    stranded = s.sel("kvwatch:kv_stranded:ratio", labels=FLEET_MODEL)
    lay.row("Fleet", 4, 4)
    lay.add(
        g.stat(
            "kvwatch agents up",
            [
                Query('sum(up{cluster=~"$cluster", job=~"$job"})', "up"),
                Query('count(up{cluster=~"$cluster", job=~"$job"})', "scraped"),
            ],
            "kvwatch agents Prometheus scraped successfully, of those it knows.",
        ),
        g.stat(
            "Engines down",
            [Query(f"count({s.sel('kvwatch_target_up')} == 0) or vector(0)")],
            "Engine replicas kvwatch cannot scrape.",
            thresholds=ANY_IS_RED,
        ),
        g.stat(
            "KV capacity",
            [Query(f"sum({capacity})")],
            "KV tokens across the selected models' replicas.",
            unit="short",
        ),
        g.stat(
            "Most stranded KV",
            [Query(f"max({stranded})")],
            "Largest share of a model's KV capacity free on idle replicas while others queue.",
            unit="percentunit",
            thresholds=((None, "green"), (0.2, "orange")),
        ),
        g.stat(
            "Firing kvwatch alerts",
            [
                Query(
                    'count(ALERTS{alertname=~"KVWatch.+", alertstate="firing", cluster=~"$cluster"}) '
                    "or vector(0)"
                )
            ],
            "kvwatch alerts firing now (pages and tickets).",
            thresholds=ANY_IS_RED,
        ),
        g.stat(
            "GPUs lost",
            [Query(f"count({s.sel('kvwatch_gpu_lost')} == 1) or vector(0)")],
            "GPUs NVML reports lost, across nodes.",
            thresholds=ANY_IS_RED,
        ),
    )

    lay.row("Stranded capacity", 12, 8)
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
            "Free KV tokens on replicas with nothing waiting while another replica of the "
            "same model queues or preempts, across nodes (recording rule) and summed over each node's own "
            "view (agent).",
            COUNT,
        ),
        g.timeseries(
            "Stranded share of capacity",
            [Query(s.sel("kvwatch:kv_stranded:ratio", labels=FLEET_MODEL), "{{model_name}}")],
            "Stranded tokens / the model's KV capacity. KVWatchKVCapacityStranded fires above "
            f"{SHIPPED_ALERTS.stranded_ratio:.0%}.",
            WHOLE_SHARE,
            thresholds=fires_above(SHIPPED_ALERTS.stranded_ratio),
        ),
    )

    lay.row("Replicas under the most pressure", 8, 8)
    lay.add(
        *(
            g.table(
                title,
                [Query(f"{pick}(10, {series})", rep, instant=True, table=True)],
                description,
                unit=unit,
                hide=("Time", "job", "__name__"),
            )
            for title, pick, series, unit, description in (
                (
                    "Fullest KV caches",
                    "topk",
                    s.sel("kvwatch_kv_usage_ratio"),
                    "percentunit",
                    "The 10 replicas with the highest KV occupancy.",
                ),
                (
                    "Least KV headroom",
                    "bottomk",
                    s.sel("kvwatch_kv_headroom_seconds"),
                    "s",
                    "The 10 replicas closest to a full KV pool at their current growth.",
                ),
                (
                    "Most preemptions",
                    "topk",
                    s.sel("kvwatch:preemptions:rate5m", labels=REPLICA_LABELS),
                    "reqps",
                    "The 10 replicas preempting the most per second (5m rate).",
                ),
            )
        )
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
            "Spread of KV occupancy over a model's replicas: a wide spread with queues is stranded capacity.",
            WHOLE_SHARE,
        ),
        g.timeseries(
            "KV tier traffic / PCIe bandwidth, top 10",
            [
                Query(
                    f"topk(10, {s.sel('kvwatch:kv_tier_pcie:ratio_rate5m', labels=TIER_LABELS)})",
                    "{{instance}} {{replica}} {{direction}}",
                    sparse=True,
                )
            ],
            "Replicas whose KV offload/onload uses the most of their GPUs' PCIe bandwidth (needs "
            "KV offload and the replica -> GPU map).",
            SHARE,
        ),
        w=12,
        h=8,
    )

    lay.row("Service level per band", 8, 10)
    lay.add(
        budget_left_panel(s, "Share of each SLO's error budget left for the period, per model and band."),
        burn_rate_panel("1h", s, "Error ratio over 1h / error budget, per objective and band."),
        g.timeseries(
            "Completion ratio per band, 1h",
            [
                Query(
                    s.sel("kvwatch:request_completion:ratio_rate1h", labels=FLEET_BAND),
                    "{{model_name}} {{length_band}}",
                )
            ],
            "(completed + truncated) / finished over 1h per band.",
            WHOLE_SHARE,
        ),
    )

    node_url = f"/d/{NODE_UID}/kvwatch-node?${{__url_time_range}}&var-node=${{__data.fields.instance}}"
    lay.row("Nodes", 24, 8)
    lay.add(
        g.table(
            "Nodes",
            [
                Query(f"{how} by (cluster, instance) ({series})", instant=True, table=True)
                for how, series in (
                    ("max", s.sel("kvwatch_kv_usage_ratio")),
                    ("sum", s.rate("kvwatch_preemptions_total")),
                    ("sum", s.sel("kvwatch_target_up")),
                    ("count", s.sel("kvwatch_gpu_info")),
                )
            ],
            "Per node: highest KV occupancy (A), preemptions/s (B), engines up (C), GPUs (D). "
            "Click a row for its Node dashboard.",
            links=[{"title": "Node dashboard", "url": node_url}],
            hide=("Time",),
        )
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
