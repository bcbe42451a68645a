"""Scale: the series budget of one node, the fleet view on Prometheus federation, memory over a long run.

* **Budget.** ``series_budget(shape)`` is the formula of docs/scale.md, derived from the catalog and the
  bucket lists; a full 8-replica x 8-GPU node (every band and outcome seen, every GPU family, tier
  traffic, XIDs) served by a real in-process agent stays within it family by family, and the number
  docs/scale.md states is the formula's.
* **Soak and fleet.** The demo's simulated node (8 vLLM-speaking engines and its reasoning workload)
  in this process, ``kvwatch run`` as a subprocess in front of it (proxies on, fake GPUs), a
  "cluster" Prometheus scraping it every second with the shipped rules, and a "global" Prometheus
  federating from that one and evaluating the fleet-level rules. The agent's RSS is sampled the
  whole time; after warm-up it must stay flat.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web

from kvwatch import buckets
from kvwatch.catalog import CATALOG, REJECTED_SAMPLE_REASONS
from kvwatch.export.profile import ENGINE_SIDE_ONLY_FAMILIES, PER_NODE_REQUEST_FAMILIES
from kvwatch.model import OUTCOMES, LengthBands
from kvwatch.state import HISTOGRAM_FAMILIES
from tests.local import serve_app

from .reference_node import reference_node
from .stack import (
    ROOT,
    KvwatchRun,
    Prometheus,
    Sample,
    cpu_seconds,
    family_of,
    free_port,
    parse,
    rss_bytes,
)

SCALE_DOC = ROOT / "docs/scale.md"

# -- the budget formula (docs/scale.md) ---------------------------------------------------------------


@dataclass(frozen=True)
class NodeShape:
    """What a node's series count depends on. Defaults: the reference node (docs/scale.md)."""

    replicas: int = 8
    dp_ranks: int = 1  # per replica
    gpus: int = 8
    gpus_per_replica: int = 1
    models_per_replica: int = 1  # served model names a replica's requests are labelled with
    node_models: int = 1  # distinct served model names on the node (lean's per-node request series)
    profile: str = "lean"  # metrics.profile
    proxied: bool = True  # the proxy reports requests (no queue time)
    relay_workers: bool = True  # proxy.workers resolves to more than 1 (auto on the reference node: 8)
    engine_request_sources: int = 0  # OTLP span / SGLang file sources per replica (with queue time)
    band_edges: tuple[int, ...] = LengthBands().edges
    finish_reasons: int = 5  # vLLM: stop, length, abort, error, repetition
    tier_pairs: int = 4  # (engine family, src tier, dst tier) per replica, e.g. LMCache + KVBM
    nvlinks: int = 18  # per GPU (H100 / H200)
    clock_event_reasons: int = 9
    xid_codes: int = 2  # distinct XID codes seen per GPU since the agent started
    processes_per_gpu: int = 2
    nvml_error_kinds: int = 0  # (call, error) pairs; 0 on a healthy node
    config_reloads: bool = True  # kvwatch run watches its config file (reload status series)
    discovery: bool = False  # Kubernetes discovery on (its self series)
    discovery_event_types: int = 4  # ADDED, MODIFIED, DELETED, BOOKMARK
    discovery_error_reasons: int = 0  # watch error reasons seen; 0 while the API is healthy
    annotation_errors: int = 0  # (pod, annotation) pairs with a malformed annotation
    refusal_statuses: int = 0  # statuses the proxy answered a request with itself; 0 on a healthy node
    out_of_range_fields: int = 0  # request fields a source sent over 2^31; 0 on a healthy node
    plugin_refusal_reasons: int = 0  # reasons the plugin receiver refused a finished request; 0 healthy
    plugin_units: int = 0  # replica units reporting through the vLLM stat-logger plugin
    datagram_results: int = 1  # vllm_plugin datagram results seen per plugin replica ("ok")
    step_batch_buckets: int = 0  # batch-token buckets the plugin's step histogram has filled per unit

    @property
    def units(self) -> int:
        return self.replicas * self.dp_ranks

    @property
    def bands(self) -> int:
        return len(self.band_edges) + 2  # the bands, and "unknown"

    @property
    def proxy_keys(self) -> int:
        return self.replicas * self.models_per_replica * int(self.proxied)

    @property
    def engine_keys(self) -> int:
        return self.replicas * self.models_per_replica * self.engine_request_sources

    @property
    def lean(self) -> bool:
        return self.profile == "lean"

    def keys_of(self, family: str, proxy: bool = True, engine: bool = True) -> int:
        """Request keys (replica x model x source) of a family: per node (node models x source) for
        the families lean folds."""
        if self.lean and family in PER_NODE_REQUEST_FAMILIES:
            sources = int(proxy and self.proxied) + int(engine) * self.engine_request_sources
            return self.node_models * sources
        return int(proxy) * self.proxy_keys + int(engine) * self.engine_keys

    @property
    def nvlink_series(self) -> int:
        """NVLink series per GPU and family: one per link, or their sum (lean)."""
        return min(self.nvlinks, 1) if self.lean else self.nvlinks

    @property
    def collectors(self) -> int:
        """engine:<replica>, nvml, gpu_mapping, export_<area> x 5, otlp / SGLang followers."""
        return self.sources + 5

    @property
    def sources(self) -> int:
        """Collectors with a last success time: all but the export areas (they run in the scrape)."""
        return self.replicas + 2 + self.engine_request_sources


#: what only an engine-side source (OTLP spans, SGLang files, the vLLM plugin) knows; a proxy never does
ENGINE_SIDE_HISTOGRAMS = frozenset(
    {
        "kvwatch_request_queue_seconds",
        "kvwatch_request_prefill_seconds",
        "kvwatch_request_decode_seconds",
        "kvwatch_request_preemptions",
        "kvwatch_request_prefix_reuse_ratio",
    }
)


def _histogram_series(name: str, shape: NodeShape) -> int:
    bounds = (
        buckets.output_token_bounds(shape.band_edges)
        if name == "kvwatch_request_output_tokens"
        else HISTOGRAM_FAMILIES[name]
    )
    proxy = name not in ENGINE_SIDE_HISTOGRAMS and not (shape.lean and name in ENGINE_SIDE_ONLY_FAMILIES)
    keys = shape.keys_of(name, proxy=proxy)
    return keys * shape.bands * (len(bounds) + 3)  # buckets, +Inf, _sum, _count


#: family -> series for a node shape. Every catalog family has a rule (a new family fails the test).
RULES: dict[str, Callable[[NodeShape], int]] = {
    # kvwatch itself
    "kvwatch_build": lambda s: 1,
    # the agent process (prometheus_client's process and platform collectors): one series each
    **{spec.name: (lambda s: 1) for spec in CATALOG if spec.name.startswith(("process_", "python_"))},
    "kvwatch_collector_success": lambda s: s.collectors,
    "kvwatch_collector_duration_seconds": lambda s: s.collectors,
    "kvwatch_source_last_success_timestamp_seconds": lambda s: s.sources,
    "kvwatch_target_up": lambda s: s.replicas,
    "kvwatch_target_scrape_duration_seconds": lambda s: s.replicas,
    "kvwatch_target_scrape_errors": lambda s: s.replicas * 7,  # reasons, all pre-created
    "kvwatch_target_restarts": lambda s: s.replicas,
    "kvwatch_proxy_accounting_errors": lambda s: s.replicas * int(s.proxied),
    "kvwatch_proxy_connections_timed_out": lambda s: s.replicas * int(s.proxied),
    "kvwatch_otlp_spans": lambda s: 4 * int(s.engine_request_sources > 0),
    "kvwatch_otlp_exports_refused": lambda s: 3 * int(s.engine_request_sources > 0),
    "kvwatch_request_file_lines": lambda s: 2 * s.replicas * int(s.engine_request_sources > 0),
    "kvwatch_ledger_write_errors": lambda s: 1,
    "kvwatch_target_samples_rejected": lambda s: s.replicas * len(REJECTED_SAMPLE_REASONS),  # pre-created
    "kvwatch_proxy_requests_shed": lambda s: s.replicas * int(s.proxied) * 2,  # buffer, connections
    "kvwatch_proxy_accept_errors": lambda s: s.replicas * int(s.proxied),
    "kvwatch_proxy_usage_injection_refused": lambda s: s.replicas * int(s.proxied),
    "kvwatch_proxy_requests_refused": lambda s: s.replicas * int(s.proxied) * s.refusal_statuses,
    "kvwatch_proxy_refusals_undelivered": lambda s: s.replicas * int(s.proxied) * s.refusal_statuses,
    # relay worker processes: pre-created at 0 while workers relay (reasons worker_died, backlog)
    "kvwatch_proxy_worker_restarts": lambda s: int(s.proxied and s.relay_workers),
    "kvwatch_proxy_worker_datagrams_refused": lambda s: int(s.proxied and s.relay_workers),
    "kvwatch_proxy_worker_records_lost": lambda s: 2 * s.replicas * int(s.proxied and s.relay_workers),
    # only on an out-of-range count: per replica and source, x the request fields that were
    "kvwatch_request_values_dropped": lambda s: (
        (s.replicas * int(s.proxied) + s.engine_keys) * s.out_of_range_fields
    ),
    # terminal_pod, stale_duplicate, mig_unresolved, dra, unknown_device (with pod resources only)
    "kvwatch_gpu_grants_unattributed": lambda s: 5 * int(s.discovery),
    "kvwatch_config_last_reload_successful": lambda s: int(s.config_reloads),
    "kvwatch_config_last_reload_success_timestamp_seconds": lambda s: int(s.config_reloads),
    "kvwatch_discovery_stale": lambda s: int(s.discovery),
    "kvwatch_discovery_replicas": lambda s: int(s.discovery),
    "kvwatch_discovery_replica_ready": lambda s: s.replicas * int(s.discovery),
    "kvwatch_discovery_pod_annotation_errors": lambda s: s.annotation_errors * int(s.discovery),
    "kvwatch_discovery_watch_events": lambda s: s.discovery_event_types * int(s.discovery),
    "kvwatch_discovery_watch_errors": lambda s: s.discovery_error_reasons * int(s.discovery),
    "kvwatch_discovery_relists": lambda s: int(s.discovery),
    "kvwatch_vllm_plugin_datagrams": lambda s: s.datagram_results * s.plugin_units,
    # the vLLM stat-logger plugin (docs/vllm-plugin.md): per reporting unit
    "kvwatch_vllm_plugin_dropped_datagrams": lambda s: s.plugin_units,
    "kvwatch_vllm_plugin_dropped_steps": lambda s: s.plugin_units,
    "kvwatch_vllm_plugin_refused_requests": lambda s: s.plugin_units * s.plugin_refusal_reasons,
    "kvwatch_engine_step_seconds": lambda s: (
        s.plugin_units * s.step_batch_buckets * (len(buckets.STEP_SECONDS) + 3)
    ),
    **{
        name: (lambda s: s.plugin_units * (len(buckets.KV_BLOCK_SECONDS) + 3))
        for name in (
            "kvwatch_kv_block_lifetime_seconds",
            "kvwatch_kv_block_idle_seconds",
            "kvwatch_kv_block_reuse_gap_seconds",
        )
    },
    # engine replicas: one series per replica and DP rank, x finish reasons / tier pairs
    **{
        name: (lambda s: s.units)
        for name in (
            "kvwatch_replica",
            "kvwatch_kv_capacity_tokens",
            "kvwatch_kv_capacity_bytes",
            "kvwatch_kv_block_size_tokens",
            "kvwatch_kv_usage_ratio",
            "kvwatch_kv_used_blocks",
            "kvwatch_kv_used_tokens",
            "kvwatch_kv_evictable_tokens",
            "kvwatch_kv_free_tokens",
            "kvwatch_requests_running",
            "kvwatch_requests_waiting",
            "kvwatch_preemptions",
            "kvwatch_prompt_tokens",
            "kvwatch_generation_tokens",
            "kvwatch_prefix_cache_queried_tokens",
            "kvwatch_prefix_cache_hit_tokens",
            # derived, one per unit (one source each)
            "kvwatch_kv_live_tokens",
            "kvwatch_kv_fragmentation_ratio",
            "kvwatch_kv_headroom_seconds",
            "kvwatch_kv_overcommitted_requests",
            "kvwatch_recomputed_tokens",
        )
    },
    "kvwatch_engine_finished_requests": lambda s: s.units * s.finish_reasons,
    **{
        name: (lambda s: s.units * s.tier_pairs)
        for name in (
            "kvwatch_kv_tier_transfer_bytes",
            "kvwatch_kv_tier_transfer_tokens",
            "kvwatch_kv_tier_transfer_blocks",
            "kvwatch_kv_tier_transfer_seconds",
        )
    },
    "kvwatch_replica_gpu": lambda s: s.replicas * s.gpus_per_replica,
    "kvwatch_kv_stranded_tokens": lambda s: s.replicas * s.models_per_replica,  # per model: at most this
    "kvwatch_kv_tier_link_utilization_ratio": lambda s: s.replicas * 2,  # offload, onload
    "kvwatch_kv_tier_link_condition": lambda s: s.replicas * 2 * 3,  # x 3 conditions
    "kvwatch_kv_tier_recompute_avoided_tokens_per_byte": lambda s: s.replicas,
    # GPUs
    **{
        name: (lambda s: s.gpus)
        for name in (
            "kvwatch_gpu",
            "kvwatch_gpu_lost",
            "kvwatch_gpu_memory_total_bytes",
            "kvwatch_gpu_memory_used_bytes",
            "kvwatch_gpu_memory_reserved_bytes",
            "kvwatch_gpu_memory_free_bytes",
            "kvwatch_gpu_utilization_ratio",
            "kvwatch_gpu_memory_utilization_ratio",
            "kvwatch_gpu_pcie_tx_bytes",
            "kvwatch_gpu_pcie_rx_bytes",
            "kvwatch_gpu_pcie_replays",
            "kvwatch_gpu_pcie_link_generation",
            "kvwatch_gpu_pcie_link_generation_max",
            "kvwatch_gpu_pcie_link_width",
            "kvwatch_gpu_pcie_link_width_max",
            "kvwatch_gpu_power_watts",
            "kvwatch_gpu_power_limit_watts",
            "kvwatch_gpu_energy_joules",
            "kvwatch_gpu_row_remap_pending",
            "kvwatch_gpu_row_remap_failure",
            "kvwatch_gpu_pcie_link_max_bytes_per_second",
        )
    },
    **{
        name: (lambda s: s.gpus * 2)
        for name in (  # gpu/memory, sm/memory, corrected/uncorrected, ...
            "kvwatch_gpu_temperature_celsius",
            "kvwatch_gpu_clock_hertz",
            "kvwatch_gpu_ecc_errors",
            "kvwatch_gpu_remapped_rows",
        )
    },
    "kvwatch_gpu_clock_event_active": lambda s: s.gpus * s.clock_event_reasons,
    **{
        name: (lambda s: s.gpus * s.nvlink_series)
        for name in (
            "kvwatch_gpu_nvlink_tx_bytes",
            "kvwatch_gpu_nvlink_rx_bytes",
            "kvwatch_gpu_nvlink_active",
        )
    },
    "kvwatch_gpu_xid_errors": lambda s: s.gpus * s.xid_codes,
    "kvwatch_gpu_process_memory_bytes": lambda s: s.gpus * s.processes_per_gpu,
    "kvwatch_gpu_nvml_errors": lambda s: s.nvml_error_kinds,
    # requests: per (replica, model, source) key and length band
    **{name: (lambda s, name=name: _histogram_series(name, s)) for name in HISTOGRAM_FAMILIES},
    "kvwatch_request_output_tokens": lambda s: _histogram_series("kvwatch_request_output_tokens", s),
    "kvwatch_requests": lambda s: (s.proxy_keys + s.engine_keys) * s.bands * len(OUTCOMES),
    "kvwatch_request_preemption_stalls": lambda s: (
        s.keys_of("kvwatch_request_preemption_stalls", engine=False) * s.bands
    ),
    "kvwatch_request_output_tokens_estimated": lambda s: (
        s.keys_of("kvwatch_request_output_tokens_estimated") * s.bands
    ),
    **{
        name: (lambda s, name=name: s.keys_of(name, engine=False) * s.bands)  # by admission band
        for name in ("kvwatch_requests_in_flight", "kvwatch_in_flight_tokens")
    },
    "kvwatch_request_unused_max_tokens": lambda s: s.keys_of("kvwatch_request_unused_max_tokens") * s.bands,
}

GROUPS = {
    "self": "kvwatch itself",
    "replica": "engine replicas",
    "derived": "derived KV signals",
    "gpu": "GPUs (NVML)",
    "request": "requests by band",
    "plugin": "vLLM plugin",
}


def series_budget(shape: NodeShape) -> dict[str, int]:
    return {spec.name: RULES[spec.name](shape) for spec in CATALOG}


def budget_by_area(shape: NodeShape) -> dict[str, int]:
    totals: Counter[str] = Counter()
    for spec in CATALOG:
        totals[spec.area] += RULES[spec.name](shape)
    return dict(totals)


def count_by_family(samples: list[Sample]) -> Counter[str]:
    """Series per catalog family (``x_bucket``/``_sum``/``_count`` all count: each is a series)."""
    return Counter(family_of(s.name) for s in samples)


#: the lean default's target on the reference node (docs/scale.md)
LEAN_MAX_SERIES = 2_000
LEAN_MAX_BYTES = 300 * 1024


def test_every_catalog_family_has_a_budget_rule_and_the_documented_number_is_the_formulas():
    assert {s.name for s in CATALOG} <= set(RULES), (
        f"families without a series budget: {sorted({s.name for s in CATALOG} - set(RULES))}; "
        "add them to RULES here and to the tables of docs/scale.md"
    )
    doc = SCALE_DOC.read_text()
    lean, full = NodeShape(), NodeShape(profile="full")
    documented = re.search(
        r"Budget: ([\d,]+) series per node in the lean default, ([\d,]+) in the full "
        r"profile",
        doc,
    )
    assert documented, "docs/scale.md states no 'Budget: N series per node in the lean default, M in ...'"
    for shape, number in zip((lean, full), documented.groups(), strict=True):
        total = sum(series_budget(shape).values())
        assert int(number.replace(",", "")) == total, (
            f"docs/scale.md says {number} series ({shape.profile}), the formula gives {total:,}: update it"
        )
    assert sum(series_budget(lean).values()) <= LEAN_MAX_SERIES
    by_lean, by_full = budget_by_area(lean), budget_by_area(full)
    for area, title in GROUPS.items():
        row = f"| {title} | {by_lean[area]:,} | {by_full[area]:,} |"
        assert row in doc, row


# -- the reference node, served by the real agent ------------------------------------------------------


@pytest.mark.parametrize("profile", ["lean", "full"])
async def test_the_reference_node_stays_within_the_series_budget(profile: str):
    shape = NodeShape(profile=profile)
    async with (
        reference_node(
            profile, shape.replicas, shape.gpus, shape.processes_per_gpu, (13, 79)[: shape.xid_codes]
        ) as agent,
        httpx.AsyncClient() as client,
    ):
        text = (await client.get(f"http://127.0.0.1:{agent.port}/metrics", timeout=10)).text
    counts = count_by_family(parse(text))
    size = len(text.encode())
    budget = series_budget(shape)
    over = {name: (n, budget[name]) for name, n in counts.items() if n > budget[name]}
    assert not over, f"families over their budget (series, budget): {over}"
    total, allowed = sum(counts.values()), sum(budget.values())
    assert total <= allowed
    # the formula is a bound, not a guess: the request area (most of a node) is filled to 90% of it
    request_budget = budget_by_area(shape)["request"]
    request_used = sum(n for name, n in counts.items() if _area(name) == "request")
    assert request_used >= 0.9 * request_budget, (request_used, request_budget)
    print(
        f"{profile} 8x8 node: {total:,} series (budget {allowed:,}), {size / 1024:.0f} KiB; requests "
        f"{request_used:,} of {request_budget:,}; by area {_by_area(counts)}"
    )
    if profile == "lean":
        assert total <= LEAN_MAX_SERIES, total
        assert size <= LEAN_MAX_BYTES, f"{size / 1024:.0f} KiB"


def _area(family: str) -> str:
    return next(s.area for s in CATALOG if s.name == family)


def _by_area(counts: Counter[str]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for name, n in counts.items():
        out[_area(name)] += n
    return dict(out)


# -- soak: the demo node, the agent as a subprocess, two Prometheus servers ---------------------------

SOAK_S = 75.0
WARMUP_S = 25.0
RSS_SAMPLE_S = 1.0
CLUSTER = "soak-cluster"


class SimulatedNode:
    """The demo's simulated node and reasoning workload on an event loop in a thread of this process."""

    def __init__(self, replicas: int = 8, speed: float = 20.0) -> None:
        from kvwatch.demo import DemoSettings

        self.settings = DemoSettings(replicas=replicas, speed=speed)
        self.replica_urls: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
        self.model: str = ""
        self._targets: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
        self._stop = threading.Event()
        self.sent = 0
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main()), name="sim-node", daemon=True
        )

    def start(self) -> list[str]:
        self._thread.start()
        return self.replica_urls.result(timeout=60)

    def send_load_to(self, base_urls: list[str]) -> None:
        self._targets.set_result(base_urls)

    def stop(self) -> None:
        self._stop.set()
        if not self._targets.done():
            self._targets.set_result([])
        if self._thread.ident is not None:
            self._thread.join(30)

    async def _main(self) -> None:
        from kvwatch.demo import node_config, router_spec
        from kvwatch.sim.loadgen import LoadGenConfig, LoadGenerator
        from kvwatch.sim.node import SimNode
        from kvwatch.sim.presets import demo_workload
        from kvwatch.sim.workload import generate

        node = SimNode(node_config(self.settings))
        await node.start()
        self.model = node.config.model_name
        self.replica_urls.set_result(list(node.replica_urls))
        try:
            targets = await asyncio.to_thread(self._targets.result)
            if not targets:
                return
            loadgen = LoadGenerator(
                targets,
                model=self.model,
                router=router_spec(self.settings),
                config=LoadGenConfig(speed=self.settings.speed, seed=0),
            )
            requests = generate(demo_workload(0), duration=24 * 3600.0)
            load = asyncio.create_task(loadgen.run(requests, duration=None, drain=False))
            await asyncio.to_thread(self._stop.wait)
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
            self.sent = loadgen.report.sent
            await loadgen.close()
        finally:
            await node.stop()


def fleet_rule_files() -> list[Path]:
    """The fleet-level rule files as shipped, loaded whole (docs/scale.md): fleet recordings and
    alerts, and the SLO rules."""
    return [ROOT / "alerts/kvwatch-fleet.rules.yaml", ROOT / "alerts/kvwatch-slo.rules.yaml"]


def raw_families_read_by(rule_files: list[Path]) -> list[str]:
    """The kvwatch series names (wire names) the rules read: what a global Prometheus must receive."""
    names: set[str] = set()
    for path in rule_files:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                names |= set(re.findall(r"\b(kvwatch_[a-z0-9_]+)", rule["expr"]))
    return sorted(names)


def federation_selectors(rule_files: list[Path]) -> list[str]:
    """``match[]`` selectors for exactly what the rules read: whole families, except histogram
    buckets, of which only the ``le`` boundaries the SLO thresholds name are needed."""
    les: dict[str, set[str]] = {}
    for path in rule_files:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                for name, labels in re.findall(r"\b(kvwatch_[a-z0-9_]+_bucket)\{([^}]*)\}", rule["expr"]):
                    les.setdefault(name, set()).update(re.findall(r'le="([^"]+)"', labels))
    whole = [n for n in raw_families_read_by(rule_files) if not n.endswith("_bucket")]
    selectors = ['{__name__=~"' + "|".join(whole) + '"}']
    for name, values in sorted(les.items()):
        pattern = "|".join(v.replace(".", "\\\\.") for v in sorted(values, key=float))
        selectors.append(f'{name}{{le=~"{pattern}"}}')
    return selectors


@dataclass
class SoakRun:
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    series: list[int] = field(default_factory=list)
    last_metrics: list[Sample] = field(default_factory=list)
    requests_sent: int = 0
    cluster_values: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    global_values: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    federated_recordings: list[Sample] = field(default_factory=list)
    global_rule_errors: list[str] = field(default_factory=list)
    cluster_rule_errors: list[str] = field(default_factory=list)
    global_groups: dict[str, bool] = field(default_factory=dict)  # group -> evaluated yet
    remote_write: dict[str, float] = field(default_factory=dict)
    federated_raw: list[str] = field(default_factory=list)
    selectors: list[str] = field(default_factory=list)
    federated_series: int = 0


class RemoteWriteSink:
    """A remote-write receiver that only counts what arrives (bytes after snappy, requests)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.requests = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="remote-write-sink")

    def start(self) -> RemoteWriteSink:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()

        async def write(request: web.Request) -> web.Response:
            body = await request.read()
            self.bytes += len(body)
            self.requests += 1
            return web.Response(status=204)

        async def setup() -> None:
            app = web.Application(client_max_size=64 << 20)
            app.add_routes([web.post("/write", write)])
            self._runner, self.port = await serve_app(app, access_log=None)

        self._loop.run_until_complete(setup())
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()  # an unclosed loop warns from __del__, at some random later moment

    def stop(self) -> None:
        if self._loop is not None and self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _prometheus_counter(prom: Prometheus, name: str) -> float:
    text = httpx.get(f"{prom.url}/metrics", timeout=10).text
    return sum(s.value for s in parse(text) if s.name == name)


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> Iterator[SoakRun]:
    workdir = tmp_path_factory.mktemp("soak")
    sim = SimulatedNode()
    sink = RemoteWriteSink().start()
    agent = cluster = global_ = None
    run = SoakRun()
    try:
        urls = sim.start()
        proxy_ports = [free_port() for _ in urls]
        agent = KvwatchRun(
            {
                "node": "soak-node",
                "log_level": "warning",
                "intervals": {"engine": "1s", "gpu": "1s"},
                "nvml": {"fake_gpus": len(urls)},
                "replicas": [
                    {
                        "name": f"replica-{i}",
                        "backend": "vllm",
                        "metrics_url": f"{url}/metrics",
                        "api_url": url,
                        "proxy_listen": f"127.0.0.1:{port}",
                        "model_name": sim.model,
                        "gpus": [str(i)],
                    }
                    for i, (url, port) in enumerate(zip(urls, proxy_ports, strict=True))
                ],
            },
            workdir,
        ).start()
        sim.send_load_to([f"http://127.0.0.1:{port}" for port in proxy_ports])
        cluster = Prometheus(
            workdir,
            [],
            external_labels={"cluster": CLUSTER},
            name="cluster",
            extra_scrape_configs=[
                {
                    "job_name": "kvwatch",
                    "static_configs": [
                        {"targets": [f"127.0.0.1:{agent.port}"], "labels": {"node": "soak-node"}}
                    ],
                }
            ],
            extra_config={
                "remote_write": [
                    {
                        "url": f"http://127.0.0.1:{sink.port}/write",
                        "queue_config": {"batch_send_deadline": "1s"},
                    }
                ]
            },
        )
        cluster.start()
        run.federated_raw = raw_families_read_by(fleet_rule_files())
        run.selectors = federation_selectors(fleet_rule_files())
        global_ = Prometheus(
            workdir,
            [],
            rule_files=fleet_rule_files(),
            name="global",
            extra_scrape_configs=[
                {
                    "job_name": "federate-kvwatch",
                    "honor_labels": True,
                    "metrics_path": "/federate",
                    "params": {"match[]": run.selectors},
                    "static_configs": [{"targets": [f"127.0.0.1:{cluster.port}"]}],
                }
            ],
        ).start()

        started = time.monotonic()
        cpu0 = cpu_seconds(agent.pid)
        next_count = started
        while time.monotonic() - started < SOAK_S:
            run.rss.append((time.monotonic() - started, rss_bytes(agent.pid)))
            if time.monotonic() >= next_count:  # the exposition's size over time, every 5 s
                run.last_metrics = agent.metrics()
                run.series.append(len(run.last_metrics))
                next_count += 5
            time.sleep(RSS_SAMPLE_S)
        run.wall_s = time.monotonic() - started
        run.cpu_s = cpu_seconds(agent.pid) - cpu0
        run.last_metrics = agent.metrics()
        for name, expr in QUERIES.items():  # the cluster's own results have no cluster label yet:
            run.cluster_values[name] = cluster.query(expr)  # external labels are added on the way out
            run.global_values[name] = global_.query(expr.replace("{}", f'{{cluster="{CLUSTER}"}}'))
        federate = httpx.get(
            f"{cluster.url}/federate", params={"match[]": '{__name__=~"kvwatch:.+"}'}, timeout=30
        )
        run.federated_recordings = parse(federate.text) if federate.status_code == 200 else []
        run.federated_series = len(
            parse(
                httpx.get(
                    f"{cluster.url}/federate", params=[("match[]", m) for m in run.selectors], timeout=30
                ).text
            )
        )
        run.cluster_rule_errors = cluster.rule_errors()
        run.global_rule_errors = global_.rule_errors()
        run.global_groups = {
            g["name"]: not g.get("lastEvaluation", "0001").startswith("0001")
            for g in global_.api("rules")["groups"]
        }
        run.remote_write = {
            "samples": _prometheus_counter(cluster, "prometheus_remote_storage_samples_total"),
            "bytes": _prometheus_counter(cluster, "prometheus_remote_storage_bytes_total"),
            "sink_bytes": float(sink.bytes),
        }
        sim.stop()
        run.requests_sent = sim.sent
        yield run
    finally:
        sim.stop()
        for proc in (global_, cluster, agent):
            if proc is not None:
                proc.stop()
        sink.stop()


QUERIES = {  # "{}" becomes the cluster matcher in the global Prometheus
    "capacity": "kvwatch:kv_capacity_tokens:sum{}",
    "requests": "kvwatch:requests:rate5m{}",
    "completion": "kvwatch:request_completion:ratio_rate5m{}",
    "stranded": "kvwatch:kv_stranded:ratio{}",
    "slo_requests": "kvwatch:slo_requests:rate5m{}",
}


@pytest.mark.slow
@pytest.mark.prometheus
def test_agent_memory_stays_flat_over_a_long_run_under_load(soak: SoakRun):
    """RSS after warm-up: the last 15 s (median) within 10 MiB of the first 15 s after warm-up,
    and no steady climb (the second half's median within 4 MiB of the first half's)."""
    after = [(t, rss) for t, rss in soak.rss if t >= WARMUP_S]
    assert len(after) >= 20, f"only {len(after)} RSS samples after warm-up"  # ~1 a second, fewer under load
    mib = 1 << 20
    early = statistics.median(r for t, r in after if t < WARMUP_S + 15)
    late = statistics.median(r for t, r in after if t >= soak.rss[-1][0] - 15)
    half = len(after) // 2
    first_half = statistics.median(r for _, r in after[:half])
    second_half = statistics.median(r for _, r in after[half:])
    print(
        f"agent RSS (with its relay workers): start {soak.rss[0][1] / mib:.1f} MiB, "
        f"after warm-up {early / mib:.1f} MiB, "
        f"end {late / mib:.1f} MiB, max {max(r for _, r in soak.rss) / mib:.1f} MiB; "
        f"CPU {soak.cpu_s:.1f} s over {soak.wall_s:.0f} s "
        f"({100 * soak.cpu_s / soak.wall_s:.1f}% of a core); "
        f"series {soak.series}; requests sent {soak.requests_sent}"
    )
    assert late - early < 10 * mib, (early / mib, late / mib)
    assert second_half - first_half < 4 * mib, (first_half / mib, second_half / mib)
    assert soak.requests_sent > 50, "the workload did not flow"
    assert sum(s.value for s in soak.last_metrics if s.name == "kvwatch_requests_total") > 50


@pytest.mark.slow
@pytest.mark.prometheus
def test_demo_node_series_stay_within_the_budget(soak: SoakRun):
    counts = count_by_family(soak.last_metrics)
    shape = NodeShape(tier_pairs=0, xid_codes=0, processes_per_gpu=0)
    budget = series_budget(shape)
    over = {name: (n, budget[name]) for name, n in counts.items() if n > budget[name]}
    assert not over, over
    assert sum(counts.values()) <= sum(budget.values())
    assert max(soak.series) <= sum(series_budget(NodeShape()).values())


@pytest.mark.slow
@pytest.mark.prometheus
def test_fleet_rules_evaluate_on_a_global_prometheus_fed_by_federation(soak: SoakRun):
    """The global Prometheus gets only the raw families the fleet rules read (computed from the
    shipped rule files), with the cluster Prometheus' external label, and evaluates the whole fleet
    and SLO rule files there: the results match the cluster Prometheus' own."""
    assert not soak.cluster_rule_errors, soak.cluster_rule_errors
    assert not soak.global_rule_errors, soak.global_rule_errors
    # the fleet files load whole, the fleet alerts included (the 2m budget group may not have run yet)
    shipped = [g["name"] for path in fleet_rule_files() for g in yaml.safe_load(path.read_text())["groups"]]
    assert "kvwatch-node.recording" not in shipped
    assert sorted(soak.global_groups) == sorted(shipped)
    assert soak.global_groups["kvwatch-fleet.recording"] and soak.global_groups["kvwatch-fleet.alerts"]
    assert "kvwatch_requests_total" in soak.federated_raw
    assert not [n for n in soak.federated_raw if n.startswith("kvwatch_gpu")], "fleet rules read GPU series"
    print(
        f"federated for the fleet rules: {soak.federated_series} series of {len(soak.last_metrics)}; "
        f"selectors {soak.selectors}"
    )
    assert 0 < soak.federated_series < len(soak.last_metrics) / 2

    def values(result: list[dict[str, Any]]) -> dict[tuple, float]:
        return {
            tuple(sorted((k, v) for k, v in r["metric"].items() if k not in ("__name__", "cluster"))): float(
                r["value"][1]
            )
            for r in result
        }

    for name in QUERIES:
        assert soak.global_values[name], f"{name}: nothing in the global Prometheus"
        assert all(r["metric"]["cluster"] == CLUSTER for r in soak.global_values[name])
    assert values(soak.global_values["capacity"]) == values(soak.cluster_values["capacity"])  # a constant
    assert values(soak.global_values["requests"]).keys() == values(soak.cluster_values["requests"]).keys()
    assert sum(values(soak.global_values["requests"]).values()) > 0
    # the recipe of docs/alerting.md: recorded series federate with the cluster label
    recorded = {s.name for s in soak.federated_recordings}
    assert {"kvwatch:requests:rate5m", "kvwatch:kv_capacity_tokens:sum"} <= recorded
    assert all(s.labels.get("cluster") == CLUSTER for s in soak.federated_recordings)


@pytest.mark.slow
@pytest.mark.prometheus
def test_remote_write_cost_per_node_is_within_the_documented_budget(soak: SoakRun):
    """Bytes on the wire per sample (remote-write 1.0: snappy-compressed protobuf in which every
    sample carries its series' labels, as Prometheus 2.42 sends it). docs/scale.md's per-node budget
    assumes at most 25 bytes per sample (measured: about 19)."""
    rw = soak.remote_write
    assert rw["samples"] > 10_000 and rw["bytes"] > 0, rw
    per_sample = rw["bytes"] / rw["samples"]
    series = len(soak.last_metrics)
    print(
        f"remote write: {rw['samples']:.0f} samples, {rw['bytes'] / 1e6:.2f} MB "
        f"({rw['sink_bytes'] / 1e6:.2f} MB received), {per_sample:.2f} bytes/sample; "
        f"{series} series -> {series / 15 * per_sample / 1024:.1f} KiB/s per node at 15 s"
    )
    assert per_sample <= 25.0, per_sample
    assert abs(rw["sink_bytes"] - rw["bytes"]) <= 0.05 * rw["bytes"] + 65536
    assert rw["samples"] >= soak.series[0] * 20
