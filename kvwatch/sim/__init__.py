"""A simulated inference node for ``kvwatch demo`` and tests (docs/simulator.md).

``models``/``memory``: model and GPU presets, KV capacity. ``engine``: a continuous-batching engine
with a paged KV cache on a virtual clock. ``workload``/``routing``: request streams and routers.
``exposition``/``server``: vLLM's ``/metrics`` and OpenAI API over the engines. ``node``: replicas,
servers and the clock. ``loadgen``: the HTTP load generator. ``presets``: the demo's defaults.
"""

from kvwatch.sim.engine import EngineConfig, RequestView, SimEngine, TokenEvent
from kvwatch.sim.loadgen import LoadGenConfig, LoadGenerator, LoadReport, RequestResult
from kvwatch.sim.memory import ReplicaMemory, plan_replica
from kvwatch.sim.models import GpuSpec, ModelSpec, gpu_preset, model_preset
from kvwatch.sim.node import HeadlessReport, NodeConfig, SimNode, h200_node, run_headless
from kvwatch.sim.presets import demo_node, demo_router, demo_workload
from kvwatch.sim.routing import Router, RouterSpec
from kvwatch.sim.server import SimServer
from kvwatch.sim.workload import (
    Burst,
    LengthDist,
    Patience,
    RequestClass,
    Trace,
    TraceError,
    WorkloadRequest,
    WorkloadSpec,
    generate,
    load_trace,
)

__all__ = [
    "Burst",
    "EngineConfig",
    "GpuSpec",
    "HeadlessReport",
    "LengthDist",
    "LoadGenConfig",
    "LoadGenerator",
    "LoadReport",
    "ModelSpec",
    "NodeConfig",
    "Patience",
    "ReplicaMemory",
    "RequestClass",
    "RequestResult",
    "RequestView",
    "Router",
    "RouterSpec",
    "SimEngine",
    "SimNode",
    "SimServer",
    "TokenEvent",
    "Trace",
    "TraceError",
    "WorkloadRequest",
    "WorkloadSpec",
    "demo_node",
    "demo_router",
    "demo_workload",
    "generate",
    "gpu_preset",
    "h200_node",
    "load_trace",
    "model_preset",
    "plan_replica",
    "run_headless",
]
