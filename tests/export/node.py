"""A full node's state for exporter tests: 8 replicas (a real vLLM capture) x 8 fake GPUs, requests
in every band and outcome, in-flight requests, derived signals. Deterministic."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from kvwatch.agent.derived import update_derived
from kvwatch.agent.gpu import refresh_gpu_state
from kvwatch.config import Config, MetricsConfig, ReplicaConfig
from kvwatch.engines.registry import parse_exposition
from kvwatch.export.derived import DerivedCollector
from kvwatch.export.gpus import GpuCollector
from kvwatch.export.plugin import PluginCollector
from kvwatch.export.replicas import ReplicaCollector
from kvwatch.export.requests import RequestCollector
from kvwatch.export.self_metrics import SelfCollector
from kvwatch.gpu.fake import FakeNvml
from kvwatch.gpu.nvml import NvmlCollector
from kvwatch.model import EngineStep, EvictionSample, InFlightRequest, Outcome, PluginLink, RequestRecord
from kvwatch.state import NodeState

CAPTURE = (
    Path(__file__).resolve().parent.parent
    / "fixtures"
    / "engines"
    / "captured"
    / "vllm-0.13-0.14-v1-lmcache-dynamo-2026-01-2.prom"
)
MODEL = "Qwen/Qwen3-0.6B"
T0 = 1_800_000_000.0


def full_node(replicas: int = 8, profile: str = "full") -> tuple[NodeState, Config]:
    reps = tuple(
        ReplicaConfig(
            name=f"replica-{i}",
            metrics_url=f"http://127.0.0.1:{8000 + i}/metrics",
            api_url=f"http://127.0.0.1:{8000 + i}",
            model_name=MODEL,
            gpus=(str(i),),
        )
        for i in range(replicas)
    )
    config = Config(replicas=reps, node="node-a", metrics=MetricsConfig(profile))
    state = NodeState("node-a", config.length_bands)
    fake = FakeNvml(replicas)
    nvml = NvmlCollector(fake, now=lambda: T0)
    nvml.start()
    text = CAPTURE.read_text()
    for i, rep in enumerate(reps):
        fake.add_process(i, 4000 + i, 100 << 30)
        result = parse_exposition(text, rep.name, "vllm", scraped_at=T0)
        target = state.target(rep.name)
        target.backend, target.up, target.samples, target.last_success_ts = (
            result.backend,
            True,
            tuple(result.samples),
            T0,
        )
        state.report(f"engine:{rep.name}", True, 0.002, now=T0)
    refresh_gpu_state(nvml, state, T0)
    state.collectors["nvml"].duration_s = 0.001
    state.replica_gpus = {r.name: ((str(i), fake.gpu(i).uuid, "config"),) for i, r in enumerate(reps)}
    state.pid_replica = {4000 + i: r.name for i, r in enumerate(reps)}
    gaps = state.requests.bounds["kvwatch_request_inter_chunk_seconds"]
    lengths = (300, 3000, 7000, 15000, 25000)
    for i in range(2000):
        out = lengths[i % len(lengths)]
        bins = [0] * (len(gaps) + 1)
        bins[i % len(bins)] = out - 1
        state.requests.observe(
            RequestRecord(
                replica=reps[i % replicas].name,
                model_name=MODEL,
                source="proxy",
                outcome=list(Outcome)[i % len(Outcome)],
                started_at=T0,
                prompt_tokens=900,
                output_tokens=out,
                max_tokens=32000,
                ttft_seconds=0.05 * (i % 40),
                e2e_seconds=30.0 + i % 300,
                gap_bounds=gaps,
                gap_counts=tuple(bins),
                gap_sum=0.03 * out,
            )
        )
    for i in range(500):  # the vLLM plugin's engine-side records and steps
        rep = reps[i % replicas].name
        out = lengths[i % len(lengths)]
        state.requests.observe(
            RequestRecord(
                replica=rep,
                model_name=MODEL,
                source="vllm_plugin",
                outcome=Outcome.COMPLETED,
                started_at=T0,
                prompt_tokens=900,
                output_tokens=out,
                max_tokens=32000,
                e2e_seconds=30.0 + i % 300,
                queue_seconds=0.01 * (i % 50),
                prefill_seconds=0.02 * (i % 30),
                decode_seconds=29.0 + i % 300,
                preemptions=i % 4,
                cached_prompt_tokens=128 * (i % 8),
            )
        )
        state.plugin.observe(
            PluginLink(rep, "0", 4000 + i % replicas, i, 0, per_admission=True),
            EngineStep(
                rep,
                "0",
                T0,
                ctx_tokens=(i % 3) * 900,
                gen_tokens=64,
                elapsed_ms=5.0 + i % 40,
                resumed_queried_tokens=(i % 4) * 100,
                resumed_hit_tokens=0,
                evictions=(EvictionSample(60.0 + i, 10.0, (1.0 + i % 5,)),),
            ),
        )
    bands = config.length_bands
    for i in range(32):
        handle = state.in_flight.start(
            InFlightRequest(
                reps[i % replicas].name, MODEL, bands.names[i % len(bands.names)], 1000, 0, T0, 16000
            )
        )
        state.in_flight.progress(handle, 100 + i)
    update_derived(state, config, T0)
    return state, config


def full_node_registry(replicas: int = 8, profile: str = "full") -> CollectorRegistry:
    return registry_for(*full_node(replicas, profile))


def registry_for(state: NodeState, config: Config) -> CollectorRegistry:
    """Every export area the agent serves, over ``state``."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in (
        ReplicaCollector(state, config),
        DerivedCollector(state, config),
        GpuCollector(state, config),
        RequestCollector(state, config),
        PluginCollector(state, config),
        SelfCollector(state, config),
    ):
        registry.register(collector)
    return registry
