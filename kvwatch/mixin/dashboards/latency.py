"""The Latency by length band dashboard: TTFT / TPOT / end-to-end quantiles per output-length band,
SLO attainment, burn rates, error budget, outcomes and output lengths."""

from __future__ import annotations

from kvwatch.mixin import grafana as g
from kvwatch.mixin.dashboards.scaffold import (
    COUNT,
    FLEET_BAND,
    LATENCY_UID,
    RATE,
    REQUESTS_PER_S,
    SECONDS,
    SHARE,
    SLO_LABELS,
    WHOLE_SHARE,
    Board,
    Options,
    Scope,
    budget_left_panel,
    burn_rate_panel,
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

    def per_band_mean(family: str) -> str:
        """Mean observation per band (sum / count), absent for a band with none."""
        return (
            f"{form.sum(family, rated, 'length_band')}\n/\n({form.count(family, rated, 'length_band')} > 0)"
        )

    lay.row("Inside the engine, per band (vLLM plugin)", 6, 8)
    lay.add(
        *(
            g.timeseries(
                f"{title} p90, engine clock",
                [PluginQuery(form.quantile(0.9, family, rated, "length_band"), band)],
                f"{title} p90 per band as vLLM measured it (no proxy needed).",
                SECONDS,
            )
            for title, family in (
                ("Queue", "kvwatch_request_queue_seconds"),
                ("Prefill", "kvwatch_request_prefill_seconds"),
                ("Decode", "kvwatch_request_decode_seconds"),
                ("End to end (engine)", "kvwatch_request_duration_seconds"),
            )
        )
    )
    lay.add(
        g.timeseries(
            "Preemptions per request",
            [PluginQuery(per_band_mean("kvwatch_request_preemptions"), band)],
            "Mean times a finished request of the band was preempted (exact). Long "
            "bands far above short ones: KVWatchLongRequestsPreemptedRepeatedly.",
            COUNT,
        ),
        g.timeseries(
            "Output / max_tokens p50",
            [
                PluginQuery(
                    form.quantile(0.5, "kvwatch_request_output_limit_ratio", rated, "length_band"), band
                )
            ],
            "How much of its max_tokens a request used: low values mean limits far above the "
            "answers (length prediction error).",
            WHOLE_SHARE,
        ),
        g.timeseries(
            "Prefix reuse per band",
            [PluginQuery(per_band_mean("kvwatch_request_prefix_reuse_ratio"), band)],
            "Mean share of a request's prompt served from the prefix cache.",
            WHOLE_SHARE,
        ),
        g.timeseries(
            "Unused max_tokens",
            [
                PluginQuery(
                    f"sum by (length_band) ({s.rate('kvwatch_request_unused_max_tokens_total', plugin)})",
                    band,
                )
            ],
            "Tokens per second of max_tokens that requests stopping early never generated: KV a "
            "worst-case reservation would have held for nothing.",
            COUNT,
        ),
        g.timeseries(
            "Exact recomputed tokens",
            [
                PluginQuery(
                    f"sum by (replica) ({s.rate('kvwatch_recomputed_tokens_total', plugin)})", "{{replica}}"
                )
            ],
            "Tokens re-prefilled per second after preemption, from vLLM's prefix-cache stats "
            "(replaces the estimate where the plugin runs).",
            COUNT,
        ),
        g.timeseries(
            "Step time p90 by batch tokens",
            [
                PluginQuery(
                    form.quantile(0.9, "kvwatch_engine_step_seconds", s.rate, "batch_tokens"),
                    "{{batch_tokens}}",
                )
            ],
            "Engine step time by tokens scheduled in the step (needs vLLM's "
            "--enable-logging-iteration-details).",
            SECONDS,
        ),
        w=8,
        h=8,
    )


def latency_board(opts: Options) -> Board:
    form = opts.form
    s = Scope(("cluster", "node", "model", "replica", "band"))
    fleet = Scope(("cluster", "model", "band"))  # for fleet-level recorded series
    band = "{{length_band}}"
    lay = g.Layout()

    for title, family, what in _LATENCY:
        lay.row(f"{title} by output-length band", 8, 8)
        for q in (0.5, 0.9, 0.99):
            expr = quantile(q, family, s, form=form)
            lay.add(
                g.timeseries(
                    f"{title} p{round(q * 100)}",
                    [Query(expr, band)],
                    f"{what} p{round(q * 100)} per band (band = final output "
                    f"tokens), from kvwatch's histogram.",
                    SECONDS,
                )
            )
    lay.row("Streaming and SLO attainment", 8, 8)
    gaps = quantile(0.99, "kvwatch_request_inter_chunk_seconds", s, form=form)
    lay.add(
        g.timeseries(
            "Inter-chunk gap p99",
            [Query(gaps, band)],
            "p99 of the gaps between content chunks (a chunk may carry several tokens) per band.",
            SECONDS,
        )
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
                f"Share of requests per band with {label} at most ${var} ({how}).",
                WHOLE_SHARE,
                thresholds=((None, "red"), (0.9, "orange"), (0.99, "green")),
            )
        )

    lay.row("SLO burn and error budget", 8, 8)
    lay.add(
        burn_rate_panel(
            "1h",
            fleet,
            "Error ratio over 1h / error budget. The page needs 14.4 here (and over 5m), or 6 over 6h "
            "(and 30m).",
        ),
        burn_rate_panel(
            "6h",
            fleet,
            "Error ratio over 6h / error budget. 6 pages (with 30m); 1 over 3d opens a ticket.",
            thresholds=((None, "green"), (1, "orange"), (6, "red")),
        ),
        budget_left_panel(
            fleet, "Share of the SLO period's error budget not yet spent, per objective and band."
        ),
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
            "KVWatchLatencyBudgetBurn / KVWatchCompletionBudgetBurn firing now.",
            hide=("Time", "__name__", "Value", "alertstate"),
        ),
        w=24,
        h=6,
    )

    outcome_ratio = "kvwatch:request_outcome:ratio_rate5m"
    lay.row("Outcomes per band", 12, 8)
    lay.add(
        g.timeseries(
            "Finished requests by outcome",
            [
                Query(
                    f"sum by (length_band, outcome) ({s.rate('kvwatch_requests_total')})",
                    "{{length_band}} {{outcome}}",
                )
            ],
            "completed (stop), truncated (token budget), aborted (client went away), error "
            "(5xx / broken stream), rejected (4xx).",
            REQUESTS_PER_S,
            stack=True,
        ),
        g.timeseries(
            "Completion ratio per band",
            [
                Query(
                    fleet.sel("kvwatch:request_completion:ratio_rate5m", labels=FLEET_BAND),
                    "{{model_name}} " + band,
                )
            ],
            "(completed + truncated) / finished, 5m. Long bands falling while short bands "
            "hold is starvation (KVWatchLongRequestsStarving).",
            WHOLE_SHARE,
        ),
        *(
            g.timeseries(
                f"{title} ratio per band",
                [
                    Query(
                        fleet.sel(outcome_ratio, f'outcome="{outcome}"', labels=FLEET_BAND),
                        f"{{{{model_name}}}} {band}",
                    )
                ],
                f"Share of finished requests {what}, 5m.",
                SHARE,
            )
            for title, outcome, what in (
                ("Abandonment", "aborted", "whose client went away"),
                ("Truncation", "truncated", "cut by their max_tokens"),
            )
        ),
    )

    lay.row("Load and output lengths", 8, 8)
    lay.add(
        *(
            g.timeseries(
                f"{what} by admission band",
                [Query(f"sum by (admission_band) ({s.sel(series)})", "{{admission_band}}")],
                description,
                COUNT,
                stack=True,
            )
            for what, series, description in (
                (
                    "In flight",
                    "kvwatch_requests_in_flight",
                    "Requests being relayed now by the proxy, by band of their max_tokens.",
                ),
                (
                    "In-flight tokens",
                    "kvwatch_in_flight_tokens",
                    "Estimated tokens (prompt + generated so far) held by in-flight requests.",
                ),
            )
        )
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
                "Output tokens of finished requests, quantiles across the selected bands.",
                COUNT,
            )
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
                "Finished requests by output tokens over the time range (cumulative buckets as "
                "counts per bucket).",
            )
        )
        per_step = f"sum by (le) (increase({s.sel(tokens + '_bucket')}[{RATE}]))"
        lay.add(
            g.heatmap(
                "Output length over time",
                Query(per_step, "{{le}}", heatmap=True),
                "Finished requests per output-token bucket over time.",
            ),
            w=12,
            h=8,
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
            "Share of requests whose tokens were counted from chunks (no usage arrived): "
            "their band can be off.",
            SHARE,
        ),
        w=12,
        h=8,
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
