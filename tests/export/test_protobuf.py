"""The protobuf exposition: native-histogram arithmetic as client_golang does it, content negotiation
as Prometheus asks, and every sample of the text exposition present with the same value."""

from __future__ import annotations

import math

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.export.encode import TextEncoder
from kvwatch.export.protobuf import PROTOBUF_CONTENT_TYPE, ProtobufEncoder, wants_protobuf
from kvwatch.export.server import metrics_app
from kvwatch.native_histogram import NativeHistogram, bucket_index, spans_and_deltas, upper_bound
from kvwatch.third_party.client_model import metrics_pb2 as pb

from .frozen import Frozen
from .node import full_node_registry
from .protobuf_decode import decode

# Accept headers exactly as Prometheus sends them: 2.42 scrape/scrape.go scrapeAcceptHeader(WithProtobuf);
# 3.8 acceptHeader() over config.ScrapeProtocolsHeaders with scrape_native_histograms (PrometheusProto first)
PROM_242_NATIVE = (
    "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
    "encoding=delimited,application/openmetrics-text;version=1.0.0;q=0.8,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROM_242_TEXT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROM_3_NATIVE = (
    "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;"
    "q=0.6,application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;"
    "escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
)


# ---- native-histogram arithmetic --------------------------------------------------------------


@pytest.mark.parametrize("schema", [3, 2, 1, 0, -1, -2, -4])
def test_a_boundary_value_is_in_the_bucket_it_closes_and_just_above_is_the_next(schema):
    for index in range(-40, 41):
        bound = upper_bound(index, schema)
        assert bucket_index(bound, schema) == index, (schema, index)
        assert bucket_index(math.nextafter(bound, math.inf), schema) == index + 1
        assert bucket_index(math.nextafter(bound, 0.0), schema) == index


def test_infinity_lands_one_past_the_largest_float():
    assert bucket_index(math.inf, 3) == bucket_index(1.7976931348623157e308, 3) + 1


def test_spans_fill_gaps_of_up_to_two_buckets_and_open_a_span_after_a_longer_one():
    # 0,1 then one empty (2), 3, then three empty (4..6), 7: as client_golang's makeBuckets encodes
    spans, deltas = spans_and_deltas({0: 1, 1: 3, 3: 1, 7: 5})
    assert spans == [(0, 4), (3, 1)]
    assert deltas == [1, 2, -3, 1, 4]
    spans, deltas = spans_and_deltas({-26: 4, -20: 2})
    assert spans == [(-26, 1), (5, 1)]
    assert deltas == [4, -2]
    assert spans_and_deltas({}) == ([], [])


def test_over_the_bucket_limit_the_schema_drops_and_merged_buckets_equal_observing_at_that_schema():
    values = [0.001 * 1.07**k for k in range(200)]  # 200 values over ~6 doublings
    limited = NativeHistogram(schema=3, bucket_limit=20)
    for v in values:
        limited.observe(v)
    assert limited.schema < 3
    assert len(limited.positive) <= 20
    direct = NativeHistogram(schema=limited.schema, bucket_limit=10_000)
    for v in values:
        direct.observe(v)
    assert limited.positive == direct.positive
    assert sum(limited.positive.values()) == len(values)


def test_zero_and_negative_values_have_their_own_buckets():
    h = NativeHistogram()
    for v in (0.0, 0.0, -0.5, 0.5, math.nan):
        h.observe(v)
    assert h.zero_count == 2
    assert h.positive == {bucket_index(0.5, 3): 1}
    assert h.negative == {bucket_index(-0.5, 3): 1}


# ---- content negotiation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accept", "protobuf"),
    [
        (PROM_242_NATIVE, True),
        (PROM_3_NATIVE, True),
        (PROM_242_TEXT, False),
        ("", False),
        ("*/*", False),
        ("text/plain", False),
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited", True),
        # a protobuf type we do not serve (text encoding, another message), or refused with q=0
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=text", False),
        ("application/vnd.google.protobuf;proto=other.Message;encoding=delimited", False),
        (
            "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0,*/*",
            False,
        ),
        # text preferred over protobuf
        (
            "text/plain;q=0.9,application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
            "encoding=delimited;q=0.5",
            False,
        ),
        (
            'application/vnd.google.protobuf; proto="io.prometheus.client.MetricFamily"; encoding=delimited; '
            "q=bad",
            False,
        ),
    ],
)
def test_protobuf_is_chosen_only_when_the_accept_header_rates_it_above_text(accept, protobuf):
    assert wants_protobuf(accept) is protobuf


# ---- the exposition ---------------------------------------------------------------------------


def _text_samples(body: bytes) -> set[tuple[str, frozenset[tuple[str, str]], str]]:
    out = set()
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.add((s.name, frozenset(s.labels.items()), repr(float(s.value))))
    return out


def _proto_samples(families: list[pb.MetricFamily]) -> set[tuple[str, frozenset[tuple[str, str]], str]]:
    """The classic samples a text parser would see in the protobuf families."""
    out = set()
    for f in families:
        for m in f.metric:
            labels = {p.name: p.value for p in m.label}
            key = frozenset(labels.items())
            if f.type == pb.COUNTER:
                out.add((f.name, key, repr(m.counter.value)))
            elif f.type == pb.GAUGE:
                out.add((f.name, key, repr(m.gauge.value)))
            elif f.type == pb.UNTYPED:
                out.add((f.name, key, repr(m.untyped.value)))
            elif f.type == pb.HISTOGRAM:
                h = m.histogram
                for b in h.bucket:
                    le = repr(b.upper_bound)
                    out.add(
                        (
                            f"{f.name}_bucket",
                            frozenset({**labels, "le": le}.items()),
                            repr(float(b.cumulative_count)),
                        )
                    )
                out.add(
                    (
                        f"{f.name}_bucket",
                        frozenset({**labels, "le": "+Inf"}.items()),
                        repr(float(h.sample_count)),
                    )
                )
                out.add((f"{f.name}_count", key, repr(float(h.sample_count))))
                out.add((f"{f.name}_sum", key, repr(h.sample_sum)))
            else:
                raise AssertionError(f"unexpected type {f.type} of {f.name}")
    return out


def test_every_text_sample_is_in_the_protobuf_exposition_with_its_value():
    frozen = Frozen(full_node_registry().collect())
    text = _text_samples(TextEncoder().encode(frozen))
    proto = _proto_samples(decode(ProtobufEncoder().encode(frozen)))
    assert len(text) > 3000
    assert proto == text


def test_request_histograms_carry_native_buckets_that_add_up_to_the_count():
    families = {f.name: f for f in decode(ProtobufEncoder().encode(full_node_registry()))}
    ttft = families["kvwatch_request_ttft_seconds"]
    assert ttft.type == pb.HISTOGRAM and ttft.metric
    for m in ttft.metric:
        h = m.histogram
        assert h.schema == 3 and h.zero_threshold == 2.0**-128
        assert h.bucket, "the classic buckets travel in the same message"
        counts, running = [], 0
        for d in h.positive_delta:
            running += d
            counts.append(running)
        assert all(c >= 0 for c in counts)
        assert h.zero_count + sum(counts) == h.sample_count
        assert sum(s.length for s in h.positive_span) == len(h.positive_delta)
    # inter-chunk gaps arrive pre-binned: classic buckets only, which Prometheus keeps as classic
    gaps = families["kvwatch_request_inter_chunk_seconds"].metric[0].histogram
    assert gaps.bucket and not gaps.positive_span and gaps.zero_threshold == 0


async def test_metrics_endpoint_negotiates_and_keeps_text_the_default():
    registry = full_node_registry()
    client = TestClient(TestServer(metrics_app(registry, lambda: True)))
    await client.start_server()
    try:
        plain = await client.get("/metrics")
        # the format the encoder writes (prometheus_client 0.26's CONTENT_TYPE_LATEST says 1.0.0)
        assert plain.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text_body = await plain.read()
        assert text_body.startswith(b"# HELP")
        proto = await client.get("/metrics", headers={"Accept": PROM_242_NATIVE})
        assert proto.headers["Content-Type"] == PROTOBUF_CONTENT_TYPE
        families = decode(await proto.read())
        kinds = {f.name: f.type for f in families}
        assert kinds["kvwatch_request_ttft_seconds"] == pb.HISTOGRAM
        assert kinds["kvwatch_requests_total"] == pb.COUNTER
        assert kinds["kvwatch_build_info"] == pb.GAUGE
        old = await client.get("/metrics", headers={"Accept": PROM_242_TEXT})
        assert old.headers["Content-Type"].startswith("text/plain")
    finally:
        await client.close()
