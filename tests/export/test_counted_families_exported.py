"""Every catalog counter a source counts through ``NodeState.count`` is on /metrics once counted.

The families are found in the code itself (every call whose first argument is a catalog counter, as
a literal or a module constant: ``count``, ``_counted``, ``_count_family``, the ledger's ``counter``),
so a family that is counted but wired to no exporter fails here instead of staying invisible while
the log names it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from prometheus_client import generate_latest

from kvwatch.catalog import CATALOG, spec
from kvwatch.state import DiscoveryStatus

from .node import full_node, registry_for

KVWATCH = Path(__file__).resolve().parents[2] / "kvwatch"
#: the callbacks a source is handed for its self-counters (``selfmetrics.Count``), with leading
#: underscores left off: count, _count, _counted, _count_family, counter
COUNTING = re.compile(r"count(ed|er|_family)?")


def _string_constants(trees: list[ast.Module]) -> dict[str, str]:
    found: dict[str, str] = {}
    for tree in trees:
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        found[target.id] = node.value.value
    return found


def counted_families() -> set[str]:
    trees = [ast.parse(path.read_text()) for path in KVWATCH.rglob("*.py")]
    constants = _string_constants(trees)
    catalog = {s.name for s in CATALOG if s.kind == "counter"}
    families: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if not isinstance(name, str) or not COUNTING.fullmatch(name.lstrip("_")):
                continue
            first = node.args[0]
            value = (
                first.value
                if isinstance(first, ast.Constant)
                else constants.get(first.id)
                if isinstance(first, ast.Name)
                else None
            )
            if value in catalog:
                families.add(value)
    return families


def test_the_scan_finds_the_proxy_self_counters():
    families = counted_families()
    assert {
        "kvwatch_proxy_requests_shed",
        "kvwatch_proxy_accept_errors",
        "kvwatch_otlp_spans",
        "kvwatch_ledger_write_errors",
        "kvwatch_proxy_usage_injection_refused",
    } <= families


def test_every_counted_family_appears_on_metrics_once_counted():
    state, config = full_node(replicas=1)
    families = sorted(counted_families())
    for family in families:
        state.count(family, *("counted",) * len(spec(family).labels))
    state.discovery = DiscoveryStatus()  # discovery's own counters are exported while it is on
    text = generate_latest(registry_for(state, config)).decode()
    missing = [
        f
        for f in families
        if not any(
            line.startswith(f"{f}_total{{") or line.startswith(f"{f}_total ") for line in text.splitlines()
        )
    ]
    assert not missing, f"counted but never exported: {missing}"
