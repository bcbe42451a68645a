"""Every series selector of the shipped rules, alerts and dashboard panels reads the same in the lean
profile as in the full one: on a full node (8 replicas of a real vLLM capture, 8 GPUs, every band and
outcome, the vLLM plugin's records), each selector that matches series in the full exposition matches
series in the lean one, and their values add up to the same total, so every sum, rate and ratio
built on them answers the same. With one replica chosen in a dashboard, the panels lean folds per
node go empty: they are listed here (docs/scale.md, "Profiles")."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.export.encode import TextEncoder
from kvwatch.mixin.dashboards.check import panel_queries
from tests.export.node import full_node_registry

ROOT = Path(__file__).resolve().parents[2]
RULE_FILES = sorted((ROOT / "alerts").glob("kvwatch-*.rules.yaml"))
#: labels Prometheus adds at scrape time: not in an exposition, so not matched here
TARGET_LABELS = frozenset({"cluster", "instance", "job"})

_STRING = r'"(?:\\.|[^"\\])*"'
_SELECTOR = re.compile(r"(?<![\w:])(kvwatch_[a-z0-9_]+)(?![\w:])\s*(\{(?:[^{}\"]|" + _STRING + r")*\})?")
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*(" + _STRING + ")")

Sample = tuple[str, dict[str, str], float]
Selector = tuple[str, tuple[tuple[str, str, str], ...]]


def selectors(expr: str) -> Iterator[Selector]:
    """(series name, (label, op, value) matchers) of each kvwatch series an expression reads."""
    for m in _SELECTOR.finditer(expr):
        matchers = tuple(
            (label, op, re.sub(r"\\(.)", r"\1", quoted[1:-1]))
            for label, op, quoted in _MATCHER.findall(m.group(2) or "")
        )
        yield m.group(1), tuple(x for x in matchers if x[0] not in TARGET_LABELS)


def _matches(labels: dict[str, str], label: str, op: str, value: str) -> bool:
    have = labels.get(label, "")  # an empty label is no label, as Prometheus stores it
    return {
        "=": have == value,
        "!=": have != value,
        "=~": re.fullmatch(value, have) is not None,
        "!~": re.fullmatch(value, have) is None,
    }[op]


def matching(samples: list[Sample], selector: Selector) -> list[float]:
    return [v for _labels, v in matching_series(samples, selector)]


Series = tuple[tuple[tuple[str, str], ...], float]


def matching_series(samples: list[Sample], selector: Selector) -> list[Series]:
    """(non-empty labels, value) of each matching series, sorted."""
    name, matchers = selector
    return sorted(
        (tuple(sorted((k, v) for k, v in labels.items() if v)), value)
        for n, labels, value in samples
        if n == name and all(_matches(labels, *m) for m in matchers)
    )


_AGGREGATION = re.compile(r"\b(?:sum|max|min|avg|count)\b\s*(?:by\s*\(([^)]*)\))?\s*\(")


def keeps_replica(expr: str) -> bool:
    """Whether a rule's result is per replica: no aggregation, or one that keeps ``replica``."""
    aggregations = [m.group(1) for m in _AGGREGATION.finditer(expr)]
    return all(by is not None and "replica" in by for by in aggregations)


@pytest.fixture(scope="module")
def exposition() -> dict[str, list[Sample]]:
    out = {}
    for profile in ("full", "lean"):
        text = TextEncoder().encode(full_node_registry(replicas=8, profile=profile)).decode()
        out[profile] = [
            (s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples
        ]
    return out


def shipped_queries(values: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(where, concrete PromQL) of every rule and dashboard panel query."""
    out = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                out.append((f"{path.name}: {rule.get('alert') or rule.get('record')}", rule["expr"]))
    out += [(f"{q.dashboard}: {q.panel}", q.concrete) for q in panel_queries(values)]
    return out


def test_the_selector_reader_finds_every_matcher():
    found = list(
        selectors(
            'sum(rate(kvwatch_request_ttft_seconds_bucket{cluster=~"a", '
            'length_band=~"10k-20k|20k\\\\+", le="2.0"}[5m])) / kvwatch_requests_total'
        )
    )
    assert found == [
        (
            "kvwatch_request_ttft_seconds_bucket",
            (("length_band", "=~", "10k-20k|20k\\+"), ("le", "=", "2.0")),
        ),
        ("kvwatch_requests_total", ()),
    ]


def test_every_shipped_selector_reads_the_same_in_lean_as_in_full(exposition):
    full, lean = exposition["full"], exposition["lean"]
    checked, problems = 0, []
    for where, expr in shipped_queries():
        for selector in selectors(expr):
            in_full = matching(full, selector)
            if not in_full:  # an event-only series (XIDs on this node, firing alerts): nothing to compare
                continue
            checked += 1
            in_lean = matching(lean, selector)
            if not in_lean:
                problems.append(f"{where}: {selector} matches {len(in_full)} series in full, none in lean")
            elif (
                where.startswith("kvwatch-")
                and ".rules.yaml" in where
                and keeps_replica(expr)
                and matching_series(lean, selector) != matching_series(full, selector)
            ):
                problems.append(f"{where}: a per-replica rule, but {selector} is not per replica in lean")
            elif sum(in_lean) != pytest.approx(sum(in_full)):
                problems.append(
                    f"{where}: {selector} adds up to {sum(in_full)} in full, {sum(in_lean)} in lean"
                )
    assert not problems, "\n".join(problems)
    assert checked > 150, checked  # the rules and the three dashboards, not a handful


#: dashboard panels that, with one replica chosen, have data in full and none in lean: they read
#: families lean keeps per node (docs/scale.md, "Profiles")
FULL_ONLY_FOR_ONE_REPLICA = {
    f"kvwatch-latency-by-band: {title}"
    for title in (
        "End to end (engine) p90, engine clock",
        "End to end p50",
        "End to end p90",
        "End to end p99",
        "In flight by admission band",
        "In-flight tokens by admission band",
        "Inter-chunk gap p99",
        "Output / max_tokens p50",
        "Output length distribution",
        "Output length over time",
        "Requests within the TPOT target",
        "Requests within the TTFT target",
        "TPOT p50",
        "TPOT p90",
        "TPOT p99",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "Unused max_tokens",
    )
}


def test_with_one_replica_chosen_only_the_listed_panels_go_empty_in_lean(exposition):
    full, lean = exposition["full"], exposition["lean"]
    emptied = set()
    for where, expr in shipped_queries({"replica": "replica-3"}):
        for selector in selectors(expr):
            if matching(full, selector) and not matching(lean, selector):
                emptied.add(where)
    assert emptied == FULL_ONLY_FOR_ONE_REPLICA
