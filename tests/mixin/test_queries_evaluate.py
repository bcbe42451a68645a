"""Every dashboard query and recording rule *evaluates* (not just parses) against series shaped
like kvwatch's exposition: two nodes, two replicas and two GPUs each, every catalog family.

promtool's unit-test engine runs the shipped rule files over synthetic input and evaluates each
query; a vector-matching error (many-to-many joins, a group_left on the wrong side) is reported as
an evaluation error, and a query that returns nothing where kvwatch would have data shows up as an
empty result. The real-Prometheus test against ``kvwatch demo`` checks the same list
(``panel_queries()``) against live data.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import yaml

from kvwatch import buckets
from kvwatch.catalog import CATALOG, GPU, REPLICA, MetricSpec
from kvwatch.mixin.dashboards.check import panel_queries, recorded_series
from kvwatch.mixin.rules import LEVELS
from kvwatch.model import OUTCOMES

from .helpers import ALERTS, run_tool, tool

INSTANCES = ("node-a:9477", "node-b:9477")
STEPS = 60  # 30 s apart: 30 minutes
EVAL = "30m"

# values of the labels that are not replica or GPU identity
_LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "collector": ("nvml", "engine:r0"),
    "source": ("proxy", "vllm_plugin"),
    "reason": ("hw_slowdown", "sw_power_cap"),
    "type": ("uncorrected", "uncorrectable"),
    "xid": ("13",),
    "link": ("0",),
    "sensor": ("gpu",),
    "clock": ("sm",),
    "finished_reason": ("stop", "length"),
    "length_band": ("0-1k", "20k+"),
    "outcome": OUTCOMES,
    "admission_band": ("0-1k", "20k+"),
    "pid": ("4242",),
    "result": ("request",),
    "version_hint": ("v1",),
    "cache_dtype": ("auto",),
    "call": ("nvmlDeviceGetPowerUsage",),
    "error": ("NotSupported",),
    "mapped_by": ("config",),
    "name": ("NVIDIA H200",),
    "pci_bus_id": ("00000000:18:00.0",),
    "driver_version": ("570.1",),
    "version": ("0.1.0",),
    "python": ("3.11",),
    "nvidia_ml_py": ("13",),
    "node": ("gpu-node",),
    "model_name": ("m",),
}
_TIERS = (
    {"family": "vllm_offload", "src_tier": "gpu", "dst_tier": "host"},
    {"family": "vllm_offload", "src_tier": "host", "dst_tier": "gpu"},
)
_GAUGES = {
    "kvwatch_kv_usage_ratio": "0.7",
    "kvwatch_kv_headroom_seconds": "600",
    "kvwatch_gpu_lost": "0",
    "kvwatch_requests_waiting": "2",
    "kvwatch_gpu_pcie_link_max_bytes_per_second": "32e9",
    "kvwatch_collector_success": "1",
    "kvwatch_target_up": "1",
}


def _entities(instance: str, spec: MetricSpec) -> list[dict[str, str]]:
    """Label sets of one family on one node, shaped as kvwatch exports them."""
    node = instance.split(":", maxsplit=1)[0]
    replicas = [{"replica": r, "model_name": "m", "backend": "vllm", "dp_rank": "0"} for r in ("r0", "r1")]
    gpus = [{"gpu": g, "uuid": f"GPU-{node}-{g}"} for g in ("0", "1")]
    labels = set(spec.labels)
    if spec.name == "kvwatch_replica_gpu":  # the map is per replica: dp_rank is empty
        base = [{"replica": f"r{i}", "dp_rank": "", **gpus[i], "mapped_by": "config"} for i in (0, 1)]
        labels.clear()
    elif set(REPLICA) <= labels:
        base, labels = replicas, labels - set(REPLICA)
    elif set(GPU) <= labels:
        base, labels = gpus, labels - set(GPU)
    elif "replica" in labels:
        keep = set(REPLICA) & labels
        base = [{k: v for k, v in r.items() if k in keep} for r in replicas]
        labels -= keep
    else:
        base = [{}]
    if {"family", "src_tier", "dst_tier"} <= labels:
        base = [{**b, **t} for b in base for t in _TIERS]
        labels -= {"family", "src_tier", "dst_tier"}
    rest = sorted(labels)
    out = []
    for b in base:
        for combo in itertools.product(*(_LABEL_VALUES.get(name, ("x",)) for name in rest)):
            out.append({**b, **dict(zip(rest, combo, strict=True)), "instance": instance, "job": "kvwatch"})
    return out


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items() if v != "")  # "" = label absent
    return {"series": f"{name}{{{inner}}}", "values": values}


def _input_series() -> list[dict[str, str]]:
    out = []
    for instance in INSTANCES:
        out.append(_series("up", {"instance": instance, "job": "kvwatch"}, f"1x{STEPS}"))
        for spec in CATALOG:
            for labels in _entities(instance, spec):
                if spec.kind == "counter":
                    out.append(_series(f"{spec.name}_total", labels, f"0+10x{STEPS}"))
                elif spec.kind == "info":
                    out.append(_series(f"{spec.name}_info", labels, f"1x{STEPS}"))
                elif spec.kind == "gauge":
                    stamp = spec.name.endswith("_timestamp_seconds")  # kept fresh: the test's clock
                    value = "0+30" if stamp else _GAUGES.get(spec.name, "5")
                    out.append(_series(spec.name, labels, f"{value}x{STEPS}"))
                else:
                    out += _histogram(spec.name, labels)
    return out


def _histogram(name: str, labels: dict[str, str]) -> list[dict[str, str]]:
    bounds = {
        "kvwatch_request_ttft_seconds": buckets.TTFT_SECONDS,
        "kvwatch_request_tpot_seconds": buckets.TPOT_SECONDS,
        "kvwatch_request_inter_chunk_seconds": buckets.INTER_CHUNK_SECONDS,
        "kvwatch_request_duration_seconds": buckets.DURATION_SECONDS,
        "kvwatch_request_queue_seconds": buckets.QUEUE_SECONDS,
        "kvwatch_request_output_tokens": buckets.output_token_bounds((1000, 5000, 10000, 20000)),
        "kvwatch_request_prefill_seconds": buckets.TTFT_SECONDS,
        "kvwatch_request_decode_seconds": buckets.DURATION_SECONDS,
        "kvwatch_request_preemptions": buckets.PREEMPTIONS,
        "kvwatch_request_output_limit_ratio": buckets.RATIO,
        "kvwatch_request_prefix_reuse_ratio": buckets.RATIO,
        "kvwatch_engine_step_seconds": buckets.STEP_SECONDS,
        "kvwatch_kv_block_lifetime_seconds": buckets.KV_BLOCK_SECONDS,
        "kvwatch_kv_block_idle_seconds": buckets.KV_BLOCK_SECONDS,
        "kvwatch_kv_block_reuse_gap_seconds": buckets.KV_BLOCK_SECONDS,
    }[name]
    total = len(bounds) + 1
    out = [
        _series(f"{name}_bucket", {**labels, "le": buckets.le_label(b)}, f"0+{i + 1}x{STEPS}")
        for i, b in enumerate(bounds)
    ]
    out.append(_series(f"{name}_bucket", {**labels, "le": "+Inf"}, f"0+{total}x{STEPS}"))
    out.append(_series(f"{name}_count", labels, f"0+{total}x{STEPS}"))
    out.append(_series(f"{name}_sum", labels, f"0+{total}x{STEPS}"))
    return out


def _with_instance(name: str, has: bool) -> str:
    return f'count({name}{{instance{"!" if has else ""}=""}})'


# a control: two GPUs per node joined on the node alone must be an evaluation error
MANY_TO_MANY = "kvwatch_gpu_info * on (instance) kvwatch_gpu_info"
_RESULT = re.compile(r'expr: ("(?:[^"\\]|\\.)*"), time: [^,]+,\s*(err: .*|exp: .*\n\s*got: (.*))')


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict[str, str]:
    """expr -> "error: ..." | "data" for every query that did not come back empty."""
    exprs = sorted(
        {q.concrete for q in panel_queries()}
        | {f"count({name})" for name in recorded_series()}
        | {_with_instance(name, has) for name in recorded_series() for has in (True, False)}
        | {MANY_TO_MANY}
    )
    rule_files = [str(ALERTS / f) for f in LEVELS]
    groups = [g["name"] for f in rule_files for g in yaml.safe_load(Path(f).read_text())["groups"]]
    doc = {
        "rule_files": rule_files,
        "evaluation_interval": "30s",
        "group_eval_order": groups,
        "tests": [
            {
                "interval": "30s",
                "input_series": _input_series(),
                "promql_expr_test": [{"expr": e, "eval_time": EVAL, "exp_samples": []} for e in exprs],
            }
        ],
    }
    path = tmp_path_factory.mktemp("queries") / "queries.test.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=10_000))
    result = run_tool(tool("promtool"), "test", "rules", path, timeout=600)
    found = {}
    for m in _RESULT.finditer(result.stdout + result.stderr):
        expr = json.loads(m.group(1))
        found[expr] = "data" if m.group(3) and m.group(3).strip() != "nil" else f"error: {m.group(2)}"
    assert found or result.returncode == 0, result.stdout + result.stderr
    return found


def test_evaluation_errors_are_detected(outcome) -> None:
    assert outcome[MANY_TO_MANY].startswith("error") and "many-to-many" in outcome[MANY_TO_MANY]


def test_every_dashboard_query_evaluates_without_error(outcome) -> None:
    errors = {e: o for e, o in outcome.items() if o.startswith("error") and e != MANY_TO_MANY}
    assert not errors, "\n".join(f"{e}\n  {o}" for e, o in errors.items())


def test_every_dashboard_query_has_data_where_kvwatch_exports_it(outcome) -> None:
    empty = [
        f"{q.dashboard} / {q.panel} / {q.ref_id}: {q.concrete}"
        for q in panel_queries()
        if not (q.sparse or q.external) and outcome.get(q.concrete) != "data"
    ]
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_every_recording_rule_produces_series(outcome) -> None:
    missing = [n for n in sorted(recorded_series()) if outcome.get(f"count({n})") != "data"]
    assert not missing, missing


def test_node_level_recordings_keep_instance_and_fleet_level_ones_aggregate_it_away(outcome) -> None:
    """The file a recording is in says where it can run: node rules keep each node's ``instance``
    (any Prometheus that scrapes the node), fleet and SLO rules sum across nodes."""
    levels = {
        rule["record"]: level
        for file, level in LEVELS.items()
        for group in yaml.safe_load((ALERTS / file).read_text())["groups"]
        for rule in group["rules"]
        if "record" in rule
    }
    assert set(levels) == recorded_series() and {"node", "fleet"} == set(levels.values())
    wrong = [
        f"{name} ({level})"
        for name, level in sorted(levels.items())
        if (outcome.get(_with_instance(name, True)) == "data") != (level == "node")
        or (outcome.get(_with_instance(name, False)) == "data") != (level == "fleet")
    ]
    assert not wrong, wrong


def test_burn_rate_panels_evaluate_on_a_global_prometheus_that_federates_clusters(tmp_path) -> None:
    """Each cluster's Prometheus records the objective as a constant; federated upward, each copy
    carries its cluster's label, so the budget side of a burn rate holds one series per cluster and
    a plain ``on (slo)`` join is many-to-many (the panels errored on the docs' global Prometheus)."""
    exprs = sorted({q.concrete for q in panel_queries() if q.panel.startswith("Burn rate")})
    assert exprs
    series = []
    for cluster in ("east", "west"):
        series.append(
            _series("kvwatch:slo_objective:ratio", {"cluster": cluster, "slo": "s"}, f"0.5x{STEPS}")
        )
        for window in ("1h", "6h"):
            labels = {"cluster": cluster, "slo": "s", "model_name": "m", "length_band": "0-1k"}
            series.append(_series(f"kvwatch:slo_errors:ratio_rate{window}", labels, f"0.25x{STEPS}"))
    doc = {
        "evaluation_interval": "30s",
        "tests": [
            {
                "interval": "30s",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": e,
                        "eval_time": EVAL,
                        "exp_samples": [
                            {
                                "labels": f'{{cluster="{c}", length_band="0-1k", model_name="m", slo="s"}}',
                                "value": 0.5,
                            }
                            for c in ("east", "west")
                        ],
                    }
                    for e in exprs
                ],
            }
        ],
    }
    path = tmp_path / "federated.test.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=10_000))
    result = run_tool(tool("promtool"), "test", "rules", path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
