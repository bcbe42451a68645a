"""The demo's default node, workload and router: the story ``kvwatch demo`` tells.

8x H200, Qwen3-32B (a reasoning model) as 8 data-parallel replicas with prefix caching: each replica
holds ~211k KV tokens, so about 50 reasoning requests fill it (the paper's DP "capacity trap"). The
reasoning workload arrives at 1 request/s with a 1.5x burst for 10 minutes of every simulated hour.
The router is session-affine: half the long (>5k-token) requests stick to replica 0.

What it shows (headless check, first 40 simulated minutes): replica 0 reaches ~100% KV usage,
preempts (~960 times) and queues (~70 waiting); its clients' mean TTFT climbs to ~50 s and the
impatient ones abort, while replicas 1-7 sit at 40-60% KV usage with empty queues and 0.1 s TTFT:
free KV the router strands. Long-band requests get slower (preemptions, larger batches), the 0-1k
band stays fast on the other replicas.
"""

from __future__ import annotations

from typing import Any

from kvwatch.sim.node import NodeConfig, h200_node
from kvwatch.sim.routing import RouterSpec
from kvwatch.sim.workload import Burst, Patience, WorkloadSpec

DEMO_MODEL = "qwen3-32b"
DEMO_RATE = 1.0  # requests per simulated second, whole node


def demo_node(speed: float = 20.0, **engine_options: Any) -> NodeConfig:  # EngineConfig fields
    """8x H200, Qwen3-32B DP=8, one server per replica (so stranded capacity is per target)."""
    options = {"enable_prefix_caching": True, **engine_options}
    return h200_node(DEMO_MODEL, tp=1, gpus=8, speed=speed, **options)


def demo_workload(seed: int = 0, hours: int = 24) -> WorkloadSpec:
    """Reasoning profile at ``DEMO_RATE`` with a 1.5x burst from minute 30 to 40 of every hour;
    clients give up after 120 s without a first token."""
    bursts = tuple(Burst(3600 * h + 1800, 3600 * h + 2400, 1.5) for h in range(hours))
    return WorkloadSpec.profile(
        "reasoning", rate=DEMO_RATE, bursts=bursts, patience=Patience(first_token_s=120.0), seed=seed
    )


def demo_router(seed: int = 0) -> RouterSpec:
    """Session affinity that pins half the long requests to replica 0 (see ``routing.py``)."""
    return RouterSpec("skewed", hot_replica=0, hot_share=0.5, long_threshold=5000, seed=seed)
