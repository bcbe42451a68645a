"""The protobuf exposition (``io.prometheus.client.MetricFamily``, length-delimited): the one form in
which Prometheus ingests native histograms (up to 3.x; prometheus-client has no such encoder).

Served only when the scrape's ``Accept`` prefers it (``wants_protobuf``); the text exposition stays
the default. Every family the text carries is here with the same name, labels and values, as
client_golang's ``expfmt`` would encode it: counters keep their ``_total`` name, info and stateset
families are gauges, a classic histogram's ``+Inf`` bucket is left to ``sample_count``, and a
``_created`` sample becomes a gauge family of its own, as the text encoder renders it. Request
histograms kept with native state (``state.DualHistogram``) carry both their classic buckets and
the native schema, zero bucket, spans and deltas in one message (``kvwatch/native_histogram.py``),
so rules written on either form work. docs/scale.md ("Native histograms") says how to scrape it.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from kvwatch.export.encode import HistogramRows
from kvwatch.native_histogram import NativeHistogram, spans_and_deltas
from kvwatch.third_party.client_model import metrics_pb2 as pb

PROTOBUF_MEDIA_TYPE = "application/vnd.google.protobuf"
PROTOBUF_PARAMS = {"proto": "io.prometheus.client.MetricFamily", "encoding": "delimited"}
PROTOBUF_CONTENT_TYPE = (
    "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited"
)
_MAX_ACCEPT_BYTES = 8192  # aiohttp's own header limit; anything longer is not a scraper's header

_TYPES = {
    "counter": pb.COUNTER,
    "gauge": pb.GAUGE,
    "info": pb.GAUGE,
    "stateset": pb.GAUGE,
    "histogram": pb.HISTOGRAM,
    "gaugehistogram": pb.GAUGE_HISTOGRAM,
    "summary": pb.SUMMARY,
    "unknown": pb.UNTYPED,
}
_CREATED = "_created"


def _media_ranges(accept: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """(type/subtype, parameters, q) of each media range; a range with a malformed q is skipped."""
    for item in accept[:_MAX_ACCEPT_BYTES].split(","):
        parts = item.split(";")
        media = parts[0].strip().lower()
        params: dict[str, str] = {}
        for part in parts[1:]:
            key, _, value = part.partition("=")
            params[key.strip().lower()] = value.strip().strip('"')
        try:
            q = float(params.pop("q", "1"))
        except ValueError:
            continue
        if media and 0.0 <= q <= 1.0:
            yield media, params, q


def _quality(ranges: list[tuple[str, dict[str, str], float]], media: str, required: dict[str, str]) -> float:
    """q of the most specific range that matches ``media`` with the ``required`` parameters
    (RFC 9110 12.5.1: ``type/subtype`` over ``type/*`` over ``*/*``)."""
    best, specificity = 0.0, -1
    major = media.split("/", 1)[0] + "/*"
    for candidate, params, q in ranges:
        if candidate == media:
            if any(params.get(k) != v for k, v in required.items()):
                continue
            rank = 2
        elif candidate == major:
            rank = 1
        elif candidate == "*/*":
            rank = 0
        else:
            continue
        if rank > specificity:
            best, specificity = q, rank
    return best


def wants_protobuf(accept: str) -> bool:
    """Whether a scrape's ``Accept`` rates the delimited protobuf exposition above the text one.

    Prometheus with native histograms on sends the protobuf type first with the highest q (2.x: no q,
    so 1; 3.x: ``...;encoding=delimited;q=0.6,application/openmetrics-text;...;q=0.5,...,*/*;q=0.1``,
    ``acceptHeader`` in its scrape/scrape.go). A tie, no header or ``*/*`` alone get text.
    """
    if "protobuf" not in accept:
        return False
    ranges = list(_media_ranges(accept))
    proto = _quality(ranges, PROTOBUF_MEDIA_TYPE, PROTOBUF_PARAMS)
    return proto > 0.0 and proto > _quality(ranges, "text/plain", {})


class NativeHistogramRows(HistogramRows):
    """A histogram family whose series may also carry native state; the text encoder renders it as
    plain ``HistogramRows`` (classic buckets only), the protobuf encoder sends both."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        super().__init__(name, documentation, labelnames)
        self.native: dict[tuple[str, ...], NativeHistogram] = {}

    def add_native(self, label_values: tuple[str, ...], native: NativeHistogram) -> None:
        """The native form of the series ``add_row`` added with these label values."""
        self.native[label_values] = native


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _labels(metric: pb.Metric, labels: dict[str, str]) -> None:
    for name in sorted(labels):
        pair = metric.label.add()
        pair.name = name
        pair.value = labels[name]


def _native(h: pb.Histogram, native: NativeHistogram) -> None:
    """The native fields exactly as client_golang's ``histogram.Write`` fills them."""
    h.schema = native.schema
    h.zero_threshold = native.zero_threshold
    h.zero_count = native.zero_count
    for side, span_field, delta_field in (
        (native.negative, h.negative_span, h.negative_delta),
        (native.positive, h.positive_span, h.positive_delta),
    ):
        spans, deltas = spans_and_deltas(side)
        for offset, length in spans:
            span_field.add(offset=offset, length=length)
        delta_field.extend(deltas)
    if native.zero_threshold == 0 and native.zero_count == 0 and not h.positive_span and not h.negative_span:
        h.positive_span.add(offset=0, length=0)  # otherwise a scraper takes it for a classic histogram


class ProtobufEncoder:
    """Renders a registry (or any collector) as length-delimited ``MetricFamily`` messages."""

    def encode(self, collector: Collector) -> bytes:
        out: list[bytes] = []
        for metric in collector.collect():
            for family in self._families(metric):
                if family.metric:  # Prometheus skips empty families; so does client_golang
                    body = family.SerializeToString()
                    out.append(_varint(len(body)))
                    out.append(body)
        return b"".join(out)

    def _families(self, metric: Metric) -> list[pb.MetricFamily]:
        name, kind = metric.name, metric.type
        exposed = name + "_total" if kind == "counter" else name + "_info" if kind == "info" else name
        family = pb.MetricFamily(name=exposed, help=metric.documentation, type=_TYPES.get(kind, pb.UNTYPED))
        if isinstance(metric, HistogramRows):
            self._histogram_rows(family, metric)
            return [family]
        created = pb.MetricFamily(name=name + _CREATED, help=metric.documentation, type=pb.GAUGE)
        if kind in ("histogram", "gaugehistogram", "summary"):
            self._grouped(family, created, metric)
        else:
            for sample in metric.samples:
                if sample.name == name + _CREATED:
                    self._gauge(created, sample)
                elif kind == "counter":
                    m = family.metric.add()
                    _labels(m, sample.labels)
                    m.counter.value = sample.value
                    self._stamp(m, sample)
                elif family.type == pb.UNTYPED:
                    m = family.metric.add()
                    _labels(m, sample.labels)
                    m.untyped.value = sample.value
                    self._stamp(m, sample)
                else:
                    self._gauge(family, sample)
        return [family, created]

    @staticmethod
    def _stamp(m: pb.Metric, sample: Sample) -> None:
        if sample.timestamp is not None:
            m.timestamp_ms = int(float(sample.timestamp) * 1000)

    def _gauge(self, family: pb.MetricFamily, sample: Sample) -> None:
        m = family.metric.add()
        _labels(m, sample.labels)
        m.gauge.value = sample.value
        self._stamp(m, sample)

    def _histogram_rows(self, family: pb.MetricFamily, metric: HistogramRows) -> None:
        native = metric.native if isinstance(metric, NativeHistogramRows) else {}
        for values, les, counts, total in metric.rows:
            m = family.metric.add()
            _labels(m, dict(zip(metric.labelnames, values, strict=True)))
            h = m.histogram
            h.sample_count = int(counts[-1])
            h.sample_sum = total
            for le, count in zip(les[:-1], counts[:-1], strict=True):  # +Inf is sample_count
                h.bucket.add(cumulative_count=int(count), upper_bound=float(le))
            if values in native:
                _native(h, native[values])

    def _grouped(self, family: pb.MetricFamily, created: pb.MetricFamily, metric: Metric) -> None:
        """Histograms and summaries given as samples (not ``HistogramRows``): one message per label set."""
        by_labels: dict[tuple[tuple[str, str], ...], pb.Metric] = {}
        name = metric.name
        for sample in metric.samples:
            if sample.name == name + _CREATED:
                self._gauge(created, sample)
                continue
            labels = {k: v for k, v in sample.labels.items() if k not in ("le", "quantile")}
            key = tuple(sorted(labels.items()))
            m = by_labels.get(key)
            if m is None:
                m = by_labels[key] = family.metric.add()
                _labels(m, labels)
            part = m.summary if family.type == pb.SUMMARY else m.histogram
            if sample.name == name + "_count" or sample.name == name + "_gcount":
                part.sample_count = int(sample.value)
            elif sample.name == name + "_sum" or sample.name == name + "_gsum":
                part.sample_sum = sample.value
            elif family.type == pb.SUMMARY:
                m.summary.quantile.add(quantile=float(sample.labels["quantile"]), value=sample.value)
            elif sample.labels.get("le") != "+Inf":
                m.histogram.bucket.add(
                    cumulative_count=int(sample.value), upper_bound=float(sample.labels["le"])
                )
