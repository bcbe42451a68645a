"""Request latency and outcomes by output-length band (catalog area ``request``).

Histograms are cumulative since the agent started, labelled ``replica, model_name, length_band,
source``; the band is the request's final output-token count (docs/requests.md). Buckets come from
``kvwatch.buckets`` and contain the usual SLO thresholds as exact boundaries.

``kvwatch_requests_total`` is pre-created at zero for every outcome x band of each
(replica, model_name, source) that is configured or has been seen: a counter that appears at 1
loses its first increment to ``rate()``/``increase()``, and an error-ratio query over a band that
had no errors yet should say 0, not "no data". Histograms are not pre-created (27 buckets x 6
families x 6 bands per key is too many series for what it buys: an SLO ratio over a band with no
traffic has no meaningful value anyway), and a histogram with no observation yet is left out (a
proxy never observes engine queue time, so that family stays empty for proxied replicas).

``kvwatch_request_preemption_stalls_total`` (proxy only, the one source that measures each request's
longest gap) counts finished requests whose longest gap was a preemption stall; it starts at zero
for every band of each configured proxy replica, like the outcome counter.

In-flight gauges (proxy only) are labelled by the *admission* band, from the request's
``max_tokens``, since a running request's final length is not known yet; every configured proxy
replica has a zero series per band.

kvwatch's own request-path counters (accounting errors, timed-out connections, OTLP spans, SGLang
file lines, ledger errors) are rendered by ``export/self_metrics.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping

from prometheus_client.core import Metric

from kvwatch import buckets
from kvwatch.catalog import spec
from kvwatch.config import Config
from kvwatch.export.protobuf import NativeHistogramRows
from kvwatch.model import OUTCOMES
from kvwatch.state import DualHistogram, NodeState

HISTOGRAMS = (
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

    def configured_sources(self) -> set[tuple[str, str, str]]:
        """(replica, model_name, source) that will report requests, known before the first one."""
        cfg = self.config
        out: set[tuple[str, str, str]] = set()
        for replica in cfg.replicas:
            model = replica.model_name or OTHER_MODEL
            if replica.proxy_listen is not None and replica.api_url is not None:
                out.add((replica.name, model, "proxy"))
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

    def collect(self) -> Iterator[Metric]:
        hists, outcomes, estimated = self.state.requests.snapshot()
        keys = sorted(hists)
        for name in HISTOGRAMS:
            catalog = spec(name)
            family = NativeHistogramRows(catalog.name, catalog.help, catalog.labels)
            for key in keys:
                h = hists[key][name]
                if h.count:  # a family this source never observes (queue time at a proxy) stays out
                    family.add_row(key, buckets.le_labels(h.bounds), h.cumulative_counts(), h.sum)
                    if isinstance(h, DualHistogram):
                        family.add_native(key, h.native)
            yield family
        yield self._outcomes(outcomes)
        yield self._per_proxy_band("kvwatch_request_output_tokens_estimated", estimated)
        unused = spec("kvwatch_request_unused_max_tokens").counter()
        for key, n in sorted(self.state.requests.unused_limit_counts().items()):
            unused.add_metric(list(key), float(n))
        yield unused
        yield self._stalls()
        yield from self._in_flight()

    def _outcomes(self, outcomes: dict[tuple[str, str, str, str, str], int]) -> Metric:
        sources = self.configured_sources() | {(r, m, s) for r, m, _band, s, _o in outcomes}
        values: dict[tuple[str, str, str, str, str], float] = {
            (replica, model, band, source, outcome): 0.0
            for replica, model, source in sources
            for band in self.state.bands.all_names
            for outcome in OUTCOMES
        }
        for key, n in outcomes.items():
            values[key] = float(n)
        family = spec("kvwatch_requests").counter()
        for key in sorted(values):
            family.add_metric(list(key), values[key])
        return family

    def _stalls(self) -> Metric:
        return self._per_proxy_band("kvwatch_request_preemption_stalls", self.state.requests.stall_counts())

    def _per_proxy_band(self, name: str, counts: Mapping[tuple[str, str, str, str], int]) -> Metric:
        """A counter only the proxy observes, from zero for every band of each configured proxy
        replica: a rate() over it is 0, not "no data", before the first such request."""
        values = {(replica, model, band, source): 0.0
                  for replica, model, source in self.configured_sources() if source == "proxy"
                  for band in self.state.bands.all_names}
        for key, n in counts.items():
            values[key] = float(n)
        family = spec(name).counter()
        for key in sorted(values):
            family.add_metric(list(key), values[key])
        return family

    def _in_flight(self) -> Iterator[Metric]:
        requests: Counter[tuple[str, str, str]] = Counter()
        tokens: Counter[tuple[str, str, str]] = Counter()
        for replica, model, source in self.configured_sources():
            if source == "proxy":
                for band in self.state.bands.all_names:
                    requests[(replica, model, band)] += 0
                    tokens[(replica, model, band)] += 0
        for r in self.state.in_flight.current():
            key = (r.replica, r.model_name, r.admission_band)
            requests[key] += 1
            tokens[key] += r.prompt_tokens_estimate + r.generated_tokens
        gauge = spec("kvwatch_requests_in_flight").gauge()
        for key in sorted(requests):
            gauge.add_metric(list(key), float(requests[key]))
        yield gauge
        gauge = spec("kvwatch_in_flight_tokens").gauge()
        for key in sorted(tokens):
            gauge.add_metric(list(key), float(tokens[key]))
        yield gauge
