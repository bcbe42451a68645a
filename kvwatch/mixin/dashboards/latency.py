"""The Latency by length band dashboard: TTFT / TPOT / end-to-end quantiles per output-length band,
SLO attainment, burn rates, error budget, outcomes and output lengths."""

from __future__ import annotations

from kvwatch.mixin import grafana as g
from kvwatch.mixin.dashboards.scaffold import (
    BUDGET,
    FLEET_BAND,
    LATENCY_UID,
    PAGE_BURN,
    RATE,
    SLO_LABELS,
    Board,
    Options,
    Scope,
    burn_rate,
    links,
    quantile,
    variables,
)
from kvwatch.mixin.grafana import Query
from kvwatch.mixin.promql import HistogramForm, Match

_LATENCY = (
    ("TTFT", "kvwatch_request_ttft_seconds", "Time to first token: request received -> first content chunk."),
    ("TPOT", "kvwatch_request_tpot_seconds", "Time per output token: (e2e - TTFT) / (output tokens - 1)."),
    ("End to end", "kvwatch_request_duration_seconds", "Request received -> last byte sent."),
)


def PluginQuery(expr: str, legend: str = "") -> Query:  # noqa: N802 (reads as the Query it makes)
    """A query of what only the vLLM plugin reports: empty on a node without it (an optional feature)."""
    return Query(expr, legend, sparse=True)


def _engine_side_panels(lay: g.Layout, s: Scope, band: str, form: HistogramForm) -> None:
    """What only kvwatch's vLLM plugin sees per band (source="vllm_plugin"; docs/vllm-plugin.md)."""
    plugin = 'source="vllm_plugin"'

    def rated(series: str, *extra: Match | str) -> str:
        return s.rate(series, plugin, *extra)

    lay.row("Inside the engine, per band (vLLM plugin)")
    for title, family in (
        ("Queue", "kvwatch_request_queue_seconds"),
        ("Prefill", "kvwatch_request_prefill_seconds"),
        ("Decode", "kvwatch_request_decode_seconds"),
        ("End to end (engine)", "kvwatch_request_duration_seconds"),
    ):
        p90 = form.quantile(0.9, family, rated, "length_band")
        lay.add(
            g.timeseries(
                f"{title} p90, engine clock",
                [PluginQuery(p90, band)],
                description=f"{title} p90 per band as vLLM measured it (no proxy needed).",
                unit="s",
                min_=0,
            ),
            6,
            8,
        )
    pre = "kvwatch_request_preemptions"
    mean_pre = f"{form.sum(pre, rated, 'length_band')}\n/\n({form.count(pre, rated, 'length_band')} > 0)"
    lay.add(
        g.timeseries(
            "Preemptions per request",
            [PluginQuery(mean_pre, band)],
            description="Mean times a finished request of the band was preempted (exact). Long "
            "bands far above short ones: KVWatchLongRequestsPreemptedRepeatedly.",
            min_=0,
        ),
        8,
        8,
    )
    lay.add(
        g.timeseries(
            "Output / max_tokens p50",
            [
                PluginQuery(
                    form.quantile(0.5, "kvwatch_request_output_limit_ratio", rated, "length_band"), band
                )
            ],
            description="How much of its max_tokens a request used: low values mean limits far above the "
            "answers (length prediction error).",
            unit="percentunit",
            min_=0,
            max_=1,
        ),
        8,
        8,
    )
    reuse = "kvwatch_request_prefix_reuse_ratio"
    lay.add(
        g.timeseries(
            "Prefix reuse per band",
            [
                PluginQuery(
                    f"{form.sum(reuse, rated, 'length_band')}\n/\n"
                    f"({form.count(reuse, rated, 'length_band')} > 0)",
                    band,
                )
            ],
            description="Mean share of a request's prompt served from the prefix cache.",
            unit="percentunit",
            min_=0,
            max_=1,
        ),
        8,
        8,
    )
    lay.add(
        g.timeseries(
            "Unused max_tokens",
            [
                PluginQuery(
                    f"sum by (length_band) ({s.rate('kvwatch_request_unused_max_tokens_total', plugin)})",
                    band,
                )
            ],
            description="Tokens per second of max_tokens that requests stopping early never generated: KV a "
            "worst-case reservation would have held for nothing.",
            min_=0,
        ),
        8,
        8,
    )
    lay.add(
        g.timeseries(
            "Exact recomputed tokens",
            [
                PluginQuery(
                    f"sum by (replica) ({s.rate('kvwatch_recomputed_tokens_total', plugin)})", "{{replica}}"
                )
            ],
            description="Tokens re-prefilled per second after preemption, from vLLM's prefix-cache stats "
            "(replaces the estimate where the plugin runs).",
            min_=0,
        ),
        8,
        8,
    )
    lay.add(
        g.timeseries(
            "Step time p90 by batch tokens",
            [
                PluginQuery(
                    form.quantile(0.9, "kvwatch_engine_step_seconds", s.rate, "batch_tokens"),
                    "{{batch_tokens}}",
                )
            ],
            description="Engine step time by tokens scheduled in the step (needs vLLM's "
            "--enable-logging-iteration-details).",
            unit="s",
            min_=0,
        ),
        8,
        8,
    )


def latency_board(opts: Options) -> Board:
    form = opts.form
    s = Scope(("cluster", "node", "model", "replica", "band"))
    fleet = Scope(("cluster", "model", "band"))  # for fleet-level recorded series
    band = "{{length_band}}"
    lay = g.Layout()

    for title, family, what in _LATENCY:
        lay.row(f"{title} by output-length band")
        for q in (0.5, 0.9, 0.99):
            expr = quantile(q, family, s, form=form)
            lay.add(
                g.timeseries(
                    f"{title} p{round(q * 100)}",
                    [Query(expr, band)],
                    description=f"{what} p{round(q * 100)} per band (band = final output "
                    f"tokens), from kvwatch's histogram.",
                    unit="s",
                    min_=0,
                ),
                8,
                8,
            )
    lay.row("Streaming and SLO attainment")
    gaps = quantile(0.99, "kvwatch_request_inter_chunk_seconds", s, form=form)
    lay.add(
        g.timeseries(
            "Inter-chunk gap p99",
            [Query(gaps, band)],
            description="p99 of the gaps between content chunks (a chunk may carry several tokens) per band.",
            unit="s",
            min_=0,
        ),
        8,
        8,
    )
    for var, family, label in (
        ("ttft_slo", "kvwatch_request_ttft_seconds", "TTFT"),
        ("tpot_slo", "kvwatch_request_tpot_seconds", "TPOT"),
    ):
        share = form.share_at_most(f"${var}", family, s.rate, "length_band")
        how = (
            "interpolated within the native bucket holding it unless it is a power of 2 ** (1/8)"
            if form.is_native(family)
            else "a bucket boundary; pick it above"
        )
        lay.add(
            g.bargauge(
                f"Requests within the {label} target",
                [Query(share, band)],
                description=f"Share of requests per band with {label} at most ${var} ({how}).",
                unit="percentunit",
                min_=0,
                max_=1,
                thresholds=((None, "red"), (0.9, "orange"), (0.99, "green")),
            ),
            8,
            8,
        )

    lay.row("SLO burn and error budget")
    slo_legend = "{{slo}} {{model_name}} {{length_band}}"
    lay.add(
        g.timeseries(
            "Burn rate, 1h",
            [Query(burn_rate("1h", fleet), slo_legend)],
            description="Error ratio over 1h / error budget. The page needs 14.4 here (and over "
            "5m), or 6 over 6h (and 30m).",
            min_=0,
            thresholds=PAGE_BURN,
            threshold_lines=True,
        ),
        8,
        8,
    )
    lay.add(
        g.timeseries(
            "Burn rate, 6h",
            [Query(burn_rate("6h", fleet), slo_legend)],
            description="Error ratio over 6h / error budget. 6 pages (with 30m); 1 over 3d opens a ticket.",
            min_=0,
            thresholds=((None, "green"), (1, "orange"), (6, "red")),
            threshold_lines=True,
        ),
        8,
        8,
    )
    lay.add(
        g.bargauge(
            "Error budget left",
            [Query(fleet.sel("kvwatch:slo_error_budget_remaining:ratio", labels=SLO_LABELS), slo_legend)],
            description="Share of the SLO period's error budget not yet spent, per objective and band.",
            unit="percentunit",
            max_=1,
            thresholds=BUDGET,
        ),
        8,
        8,
    )
    lay.add(
        g.table(
            "Firing SLO alerts",
            [
                Query(
                    fleet.sel(
                        "ALERTS",
                        'alertname=~"KVWatch(Latency|Completion)BudgetBurn"',
                        'alertstate="firing"',
                        labels=(*SLO_LABELS,),
                    ),
                    instant=True,
                    table=True,
                    sparse=True,
                )
            ],
            description="KVWatchLatencyBudgetBurn / KVWatchCompletionBudgetBurn firing now.",
            hide=("Time", "__name__", "Value", "alertstate"),
        ),
        24,
        6,
    )

    lay.row("Outcomes per band")
    lay.add(
        g.timeseries(
            "Finished requests by outcome",
            [
                Query(
                    f"sum by (length_band, outcome) ({s.rate('kvwatch_requests_total')})",
                    "{{length_band}} {{outcome}}",
                )
            ],
            description="completed (stop), truncated (token budget), aborted (client went away), error "
            "(5xx / broken stream), rejected (4xx).",
            unit="reqps",
            stack=True,
            min_=0,
        ),
        12,
        8,
    )
    lay.add(
        g.timeseries(
            "Completion ratio per band",
            [
                Query(
                    fleet.sel("kvwatch:request_completion:ratio_rate5m", labels=FLEET_BAND),
                    "{{model_name}} " + band,
                )
            ],
            description="(completed + truncated) / finished, 5m. Long bands falling while short bands "
            "hold is starvation (KVWatchLongRequestsStarving).",
            unit="percentunit",
            min_=0,
            max_=1,
        ),
        12,
        8,
    )
    lay.add(
        g.timeseries(
            "Abandonment ratio per band",
            [
                Query(
                    fleet.sel("kvwatch:request_outcome:ratio_rate5m", 'outcome="aborted"', labels=FLEET_BAND),
                    "{{model_name}} " + band,
                )
            ],
            description="Share of finished requests whose client went away, 5m.",
            unit="percentunit",
            min_=0,
        ),
        12,
        8,
    )
    lay.add(
        g.timeseries(
            "Truncation ratio per band",
            [
                Query(
                    fleet.sel(
                        "kvwatch:request_outcome:ratio_rate5m", 'outcome="truncated"', labels=FLEET_BAND
                    ),
                    "{{model_name}} " + band,
                )
            ],
            description="Share of finished requests cut by their max_tokens, 5m.",
            unit="percentunit",
            min_=0,
        ),
        12,
        8,
    )

    lay.row("Load and output lengths")
    adm = "{{admission_band}}"
    lay.add(
        g.timeseries(
            "In flight by admission band",
            [Query(f"sum by (admission_band) ({s.sel('kvwatch_requests_in_flight')})", adm)],
            description="Requests being relayed now by the proxy, by band of their max_tokens.",
            stack=True,
            min_=0,
        ),
        8,
        8,
    )
    lay.add(
        g.timeseries(
            "In-flight tokens by admission band",
            [Query(f"sum by (admission_band) ({s.sel('kvwatch_in_flight_tokens')})", adm)],
            description="Estimated tokens (prompt + generated so far) held by in-flight requests.",
            stack=True,
            min_=0,
        ),
        8,
        8,
    )
    tokens = "kvwatch_request_output_tokens"
    if form.is_native(tokens):  # a native histogram has no le to draw bars or heatmap cells by
        lay.add(
            g.timeseries(
                "Output tokens p50 / p90 / p99",
                [
                    Query(form.quantile(q, tokens, s.rate, None), f"p{round(q * 100)}")
                    for q in (0.5, 0.9, 0.99)
                ],
                description="Output tokens of finished requests, quantiles across the selected bands.",
                unit="short",
                min_=0,
            ),
            8,
            8,
        )
    else:
        lay.add(
            g.bargauge(
                "Output length distribution",
                [
                    Query(
                        f"sum by (le) (increase({s.sel(tokens + '_bucket')}[$__range]))",
                        "{{le}}",
                        instant=True,
                        heatmap=True,
                    )
                ],
                description="Finished requests by output tokens over the time range (cumulative buckets as "
                "counts per bucket).",
                unit="short",
            ),
            8,
            8,
        )
        per_step = f"sum by (le) (increase({s.sel(tokens + '_bucket')}[{RATE}]))"
        lay.add(
            g.heatmap(
                "Output length over time",
                Query(per_step, "{{le}}", heatmap=True),
                description="Finished requests per output-token bucket over time.",
                unit="short",
            ),
            12,
            8,
        )
    lay.add(
        g.timeseries(
            "Requests with estimated output tokens",
            [
                Query(
                    f"sum({s.rate('kvwatch_request_output_tokens_estimated_total')})\n/\n"
                    f"(sum({s.rate('kvwatch_requests_total')}) > 0)",
                    "estimated",
                )
            ],
            description="Share of requests whose tokens were counted from chunks (no usage arrived): "
            "their band can be off.",
            unit="percentunit",
            min_=0,
        ),
        12,
        8,
    )

    _engine_side_panels(lay, s, band, form)

    native = (
        " Native-histogram variant (kvwatch dashboards --native): reads the native series a "
        "Prometheus with native histograms on keeps instead of classic buckets."
        if opts.native
        else ""
    )
    return Board(
        f"{LATENCY_UID}-native" if opts.native else LATENCY_UID,
        "kvwatch / Latency by length band" + (" (native histograms)" if opts.native else ""),
        "TTFT, TPOT and end-to-end latency per output-length band, SLO attainment, burn rates and "
        f"error budget, outcomes per band, in-flight load and output-length distribution.{native}",
        variables(("cluster", "node", "model", "replica", "band", "ttft_slo", "tpot_slo"), opts.job),
        tuple(lay.panels),
        links(),
    )
