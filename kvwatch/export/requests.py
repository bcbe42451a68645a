"""Request latency and outcomes by output-length band (catalog area ``request``).

Histograms are cumulative since the agent started, labelled ``replica, model_name, length_band,
source``; the band is the request's final output-token count (docs/requests.md). Buckets come from
``kvwatch.buckets`` and contain the usual SLO thresholds as exact boundaries.

``kvwatch_requests_total`` is pre-created at zero for every outcome x band of each
(replica, model_name, source) that is configured or has been seen (finished or in flight): a counter
that appears at 1 loses its first increment to ``rate()``/``increase()``, and an error-ratio query over
a band that had no errors yet should say 0, not "no data". A proxied replica is configured with its
``model_name`` only: without one, the proxy labels requests with the model the engine serves, known
only once a request carries it (``configured_sources``). Histograms are not pre-created (27 buckets x 6
families x 6 bands per key is too many series for what it buys: an SLO ratio over a band with no
traffic has no meaningful value anyway), and a histogram with no observation yet is left out (a
proxy never observes engine queue time, so that family stays empty for proxied replicas).

``kvwatch_request_preemption_stalls_total`` (proxy only, the one source that measures each request's
longest gap) counts finished requests whose longest gap was a preemption stall; it starts at zero
for every band of each proxied replica, like the in-flight gauges below.

In-flight gauges (proxy only) are labelled by the *admission* band, from the request's
``max_tokens``, since a running request's final length is not known yet; every proxied replica has
a zero series per band, under its configured ``model_name`` or, without one, each model its requests
were seen with.

kvwatch's own request-path counters (accounting errors, timed-out connections, OTLP spans, SGLang
file lines, ledger errors) are rendered by ``export/self_metrics.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TypeVar

from prometheus_client.core import Metric

from kvwatch import buckets
from kvwatch.buckets import Histogram
from kvwatch.catalog import MetricSpec, specs
from kvwatch.config import Config, ReplicaConfig
from kvwatch.export.families import (
    IN_FLIGHT_TOKENS,
    REQUEST_OUTPUT_TOKENS_ESTIMATED,
    REQUEST_PREEMPTION_STALLS,
    REQUEST_UNUSED_MAX_TOKENS,
    REQUESTS,
    REQUESTS_IN_FLIGHT,
)
from kvwatch.export.profile import (
    ENGINE_SIDE_ONLY_FAMILIES,
    FOLDED,
    PER_NODE_REQUEST_FAMILIES,
    PROXY_SOURCE,
    is_lean,
)
from kvwatch.export.protobuf import NativeHistogramRows
from kvwatch.model import OUTCOMES, InFlightRequest
from kvwatch.native_histogram import merged
from kvwatch.state import NodeState
from kvwatch.state.request_stats import DualHistogram

RequestKey = tuple[str, str, str, str]  # replica, model_name, length_band, source
_Row = TypeVar("_Row")

HISTOGRAMS: tuple[MetricSpec, ...] = specs(
    "kvwatch_request_ttft_seconds",
    "kvwatch_request_tpot_seconds",
    "kvwatch_request_inter_chunk_seconds",
    "kvwatch_request_duration_seconds",
    "kvwatch_request_queue_seconds",
    "kvwatch_request_output_tokens",
    "kvwatch_request_prefill_seconds",
    "kvwatch_request_decode_seconds",
    "kvwatch_request_preemptions",
    "kvwatch_request_output_limit_ratio",
    "kvwatch_request_prefix_reuse_ratio",
)
OTHER_MODEL = "other"


class RequestCollector:
    def __init__(self, state: NodeState, config: Config) -> None:
        self.state = state
        self.config = config
        #: families folded into one series per node (metrics.profile lean: export/profile.py)
        lean = is_lean(config)
        self.per_node = PER_NODE_REQUEST_FAMILIES if lean else frozenset()
        self.engine_side_only = ENGINE_SIDE_ONLY_FAMILIES if lean else frozenset()

    def configured_sources(self) -> set[tuple[str, str, str]]:
        """(replica, model_name, source) that will report requests, known before the first one.

        A proxied replica without ``model_name`` is not among them: its proxy labels requests with
        the model the engine serves (learned from ``/v1/models``, in the proxy's process), which
        neither config nor state holds, so zeros under ``other`` would stay 0 beside the real series.
        Its series start with its first request (``_sources``)."""
        cfg = self.config
        out: set[tuple[str, str, str]] = set()
        for replica in cfg.replicas:
            if _proxied(replica) and replica.model_name:
                out.add((replica.name, replica.model_name, PROXY_SOURCE))
        for files in cfg.sglang_request_files:
            known = cfg.replica(files.replica)
            out.add((files.replica, (known.model_name if known else None) or OTHER_MODEL, "sglang_file"))
        for plugin in cfg.vllm_plugin_sockets:
            known = cfg.replica(plugin.replica)
            out.add((plugin.replica, (known.model_name if known else None) or OTHER_MODEL, "vllm_plugin"))
        if cfg.otlp.listen is not None:
            name = cfg.otlp.replica or (cfg.replicas[0].name if len(cfg.replicas) == 1 else None)
            known = cfg.replica(name) if name else None
            if known is not None:
                out.add((known.name, known.model_name or OTHER_MODEL, "otlp"))
        return out

    def _sources(
        self, outcomes: Mapping[tuple[str, str, str, str, str], int], running: list[InFlightRequest]
    ) -> set[tuple[str, str, str]]:
        """(replica, model_name, source) to pre-create series for: the configured ones, and those of
        every request seen, finished or still running (a running one has the label its record will
        carry), so a replica whose model the proxy learned has zero series from its first request."""
        finished = {(r, m, s) for r, m, _band, s, _o in outcomes}
        return (
            self.configured_sources() | finished | {(r.replica, r.model_name, PROXY_SOURCE) for r in running}
        )

    def _proxy_sources(self, sources: set[tuple[str, str, str]]) -> set[tuple[str, str, str]]:
        """Where the proxy-only families start at zero: each proxied replica under its configured
        ``model_name`` or, without one, under each label its requests were seen with (``_sources``)."""
        models = {r.name: r.model_name for r in self.config.replicas if _proxied(r)}
        return {
            (replica, model, source)
            for replica, model, source in sources
            if source == PROXY_SOURCE and replica in models and (models[replica] or model) == model
        }

    def collect(self) -> Iterator[Metric]:
        stats = self.state.requests
        hists, outcomes, estimated = stats.snapshot()
        gone = stats.forgotten()  # rows of replicas that went away, for lean's sums over the node
        gone_hists, _, gone_estimated = gone.snapshot()
        running = self.state.in_flight.current()
        sources = self._sources(outcomes, running)
        proxy_sources = self._proxy_sources(sources)
        for catalog in HISTOGRAMS:
            name = catalog.name
            family = NativeHistogramRows.of(catalog)
            of_family = {
                key: fams[name]
                for key, fams in self._node_rows(name, hists, gone_hists).items()
                if fams[name].count and not (name in self.engine_side_only and key[3] == PROXY_SOURCE)
            }
            if name in self.per_node:
                of_family = _per_node_histograms(of_family)
            for key, h in sorted(of_family.items()):  # a family a source never observes stays out
                family.add_row(key, buckets.le_labels(h.bounds), h.cumulative_counts(), h.sum)
                if isinstance(h, DualHistogram):
                    family.add_native(key, h.native)
            yield family
        yield self._outcomes(outcomes, sources)
        yield self._per_proxy_band(
            REQUEST_OUTPUT_TOKENS_ESTIMATED,
            self._node_rows(REQUEST_OUTPUT_TOKENS_ESTIMATED.name, estimated, gone_estimated),
            proxy_sources,
        )
        unused = REQUEST_UNUSED_MAX_TOKENS.counter()
        unused_counts = self._node_rows(unused.name, stats.unused_limit_counts(), gone.unused_limit_counts())
        if unused.name in self.per_node:
            unused_counts = _per_node_counts(unused_counts)
        for key, n in sorted(unused_counts.items()):
            unused.add_metric(list(key), float(n))
        yield unused
        yield self._per_proxy_band(
            REQUEST_PREEMPTION_STALLS,
            self._node_rows(REQUEST_PREEMPTION_STALLS.name, stats.stall_counts(), gone.stall_counts()),
            proxy_sources,
        )
        yield from self._in_flight(proxy_sources, running)

    def _node_rows(
        self, family: str, rows: Mapping[RequestKey, _Row], gone: Mapping[RequestKey, _Row]
    ) -> dict[RequestKey, _Row]:
        """A family's rows, with those of replicas that went away where the family is one sum over the
        node (lean): without them the sum would drop when a replica leaves, which Prometheus takes
        for a counter reset. Per replica, a replica that left just has no series."""
        return {**rows, **gone} if family in self.per_node else dict(rows)

    def _outcomes(
        self, outcomes: dict[tuple[str, str, str, str, str], int], sources: set[tuple[str, str, str]]
    ) -> Metric:
        values: dict[tuple[str, str, str, str, str], float] = {
            (replica, model, band, source, outcome): 0.0
            for replica, model, source in sources
            for band in self.state.bands.all_names
            for outcome in OUTCOMES
        }
        for key, n in outcomes.items():
            values[key] = float(n)
        family = REQUESTS.counter()
        for key in sorted(values):
            family.add_metric(list(key), values[key])
        return family

    def _per_proxy_band(
        self,
        catalog: MetricSpec,
        counts: Mapping[tuple[str, str, str, str], int],
        sources: set[tuple[str, str, str]],
    ) -> Metric:
        """A counter only the proxy observes, from zero for every band of each of ``sources``
        (``_proxy_sources``): a rate() over it is 0, not "no data", before the first such request."""
        folded = catalog.name in self.per_node
        values = {
            (FOLDED if folded else replica, model, band, source): 0.0
            for replica, model, source in sources
            for band in self.state.bands.all_names
        }
        for key, n in (_per_node_counts(counts) if folded else counts).items():
            values[key] = float(n)
        family = catalog.counter()
        for key in sorted(values):
            family.add_metric(list(key), values[key])
        return family

    def _in_flight(
        self, sources: set[tuple[str, str, str]], running: list[InFlightRequest]
    ) -> Iterator[Metric]:
        requests: Counter[tuple[str, str, str]] = Counter()
        tokens: Counter[tuple[str, str, str]] = Counter()
        for replica, model, _source in sources:
            for band in self.state.bands.all_names:
                requests[(replica, model, band)] += 0
                tokens[(replica, model, band)] += 0
        for r in running:
            key = (r.replica, r.model_name, r.admission_band)
            requests[key] += 1
            tokens[key] += r.prompt_tokens_estimate + r.generated_tokens
        for catalog, counted in ((REQUESTS_IN_FLIGHT, requests), (IN_FLIGHT_TOKENS, tokens)):
            values = counted
            if catalog.name in self.per_node:
                values = Counter()
                for (_replica, model, band), n in counted.items():
                    values[(FOLDED, model, band)] += n
            gauge = catalog.gauge()
            for key in sorted(values):
                gauge.add_metric(list(key), float(values[key]))
            yield gauge


def _proxied(replica: ReplicaConfig) -> bool:
    return replica.proxy_listen is not None and replica.api_url is not None


def _node_key(key: RequestKey) -> RequestKey:
    return (FOLDED, *key[1:])


def _per_node_counts(counts: Mapping[RequestKey, int]) -> dict[RequestKey, int]:
    """Counts summed over the node's replicas, per (model_name, length_band, source)."""
    out: Counter[RequestKey] = Counter()
    for key, n in counts.items():
        out[_node_key(key)] += n
    return dict(out)


def _per_node_histograms(hists: Mapping[RequestKey, Histogram]) -> dict[RequestKey, Histogram]:
    """One family's histograms summed over the node's replicas: classic bins added (every replica
    has the same bounds), native buckets merged at the coarsest schema among them."""
    groups: dict[RequestKey, list[Histogram]] = {}
    for key, h in hists.items():
        groups.setdefault(_node_key(key), []).append(h)
    out: dict[RequestKey, Histogram] = {}
    for key, parts in groups.items():
        natives = [h.native for h in parts if isinstance(h, DualHistogram)]
        total: Histogram = DualHistogram(parts[0].bounds) if natives else Histogram(parts[0].bounds)
        for h in parts:
            total.merge_bins(h.bounds, h.bins, h.sum)
        if isinstance(total, DualHistogram):
            total.native = merged(natives)
        out[key] = total
    return out
