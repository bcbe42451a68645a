"""metrics.profile: the lean default folds some families per node (per GPU), and each folded series
is exactly the sum of the full profile's series it replaces; everything else is unchanged."""

from __future__ import annotations

from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.catalog import BY_NAME
from kvwatch.config import ConfigError, config_from_mapping
from kvwatch.export.encode import TextEncoder
from kvwatch.export.profile import (
    ENGINE_SIDE_ONLY_FAMILIES,
    PER_GPU_NVLINK_FAMILIES,
    PER_NODE_REQUEST_FAMILIES,
)
from kvwatch.export.protobuf import ProtobufEncoder
from kvwatch.native_histogram import BUCKET_LIMIT, NativeHistogram, merged

from .node import full_node_registry
from .protobuf_decode import decode

Labels = tuple[tuple[str, str], ...]


def _family(name: str) -> str:
    for suffix in ("_bucket", "_count", "_sum", "_total", ""):
        if name.endswith(suffix) and name[: len(name) - len(suffix)] in BY_NAME:
            return name[: len(name) - len(suffix)]
    return name


def _samples(profile: str) -> dict[tuple[str, Labels], float]:
    text = TextEncoder().encode(full_node_registry(replicas=3, profile=profile)).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name != "kvwatch_build_info"
    }


def _without(labels: Labels, label: str) -> Labels:
    return tuple((k, "" if k == label else v) for k, v in labels)


def test_the_default_profile_is_lean_and_an_unknown_one_is_refused():
    assert config_from_mapping({}).metrics.profile == "lean"
    assert config_from_mapping({"metrics": {"profile": "full"}}).metrics.profile == "full"
    with pytest.raises(ConfigError, match=r"metrics\.profile.*one of lean, full"):
        config_from_mapping({"metrics": {"profile": "tiny"}})


def test_each_lean_series_is_the_sum_of_the_full_series_it_folds():
    full, lean = _samples("full"), _samples("lean")
    folded: dict[tuple[str, Labels], float] = defaultdict(float)
    for (name, labels), value in full.items():
        family = _family(name)
        if family in ENGINE_SIDE_ONLY_FAMILIES and dict(labels)["source"] == "proxy":
            continue  # lean has it from engine-side sources only
        if family in PER_NODE_REQUEST_FAMILIES:
            folded[(name, _without(labels, "replica"))] += value
        elif family in PER_GPU_NVLINK_FAMILIES:
            folded[(name, _without(labels, "link"))] += value
        else:
            folded[(name, labels)] = value
    assert lean == pytest.approx(dict(folded))
    # what the fold bought on this 3-replica node: at least a third of the request histogram series
    assert len(lean) < 0.7 * len(full), (len(lean), len(full))
    # the engine-side histograms a per-replica alert reads stay per replica
    assert any(
        n == "kvwatch_request_preemptions_count" and dict(ls)["replica"] == "replica-2" for n, ls in lean
    )


def test_lean_native_histograms_are_the_merged_replicas():
    def natives(profile: str) -> dict[tuple[str, Labels], tuple[int, float]]:
        out = {}
        for family in decode(ProtobufEncoder().encode(full_node_registry(replicas=3, profile=profile))):
            for m in family.metric:
                if m.histogram.schema or m.histogram.positive_span:
                    labels = tuple(sorted((lp.name, lp.value) for lp in m.label))
                    out[(family.name, labels)] = (m.histogram.sample_count, m.histogram.sample_sum)
        return out

    full, lean = natives("full"), natives("lean")
    summed: dict[tuple[str, Labels], list[float]] = defaultdict(lambda: [0, 0.0])
    for (name, labels), (count, total) in full.items():
        if name in ENGINE_SIDE_ONLY_FAMILIES and dict(labels)["source"] == "proxy":
            continue
        key = (name, _without(labels, "replica") if name in PER_NODE_REQUEST_FAMILIES else labels)
        summed[key][0] += count
        summed[key][1] += total
    assert {k: (c, pytest.approx(s)) for k, (c, s) in summed.items()} == lean
    assert any(dict(labels)["replica"] == "" for _name, labels in lean)


def test_merging_native_histograms_equals_observing_everything_at_the_coarsest_schema():
    wide, narrow = NativeHistogram(), NativeHistogram()
    values_wide = [1e-4 * 1.05**i for i in range(400)]  # 19 doublings: more than 160 buckets at schema 3
    values_narrow = [0.0, 0.5, 0.51, 2.0, 3.0]
    for v in values_wide:
        wide.observe(v)
    for v in values_narrow:
        narrow.observe(v)
    assert wide.schema < narrow.schema == 3
    total = merged([wide, narrow])
    expected = NativeHistogram(schema=wide.schema)
    for v in values_wide + values_narrow:
        expected.observe(v)
    assert (total.schema, total.zero_count, total.positive) == (expected.schema, 1, expected.positive)
    assert len(total.positive) <= BUCKET_LIMIT
    assert merged([]).positive == {}
