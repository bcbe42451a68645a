"""Which replica a request goes to: the router in front of a data-parallel deployment.

The same policies drive the headless simulation (loads = the engines' running + waiting) and the
HTTP load generator (loads = its own in-flight requests per replica), so both tell the same story.

``skewed`` is the demo's knob for stranded capacity. It stands for a session-affinity router
(sticky sessions, prefix-aware routing) where the tenant that sends long reasoning requests keeps
landing on one replica: a share ``hot_share`` of the requests whose output will exceed
``long_threshold`` tokens goes to ``hot_replica``; everything else goes to the least-loaded replica.
That replica's KV fills, it preempts and queues, while its peers hold free KV the router never uses.
(A real router cannot see the output length; affinity achieves the same correlation.)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvwatch.sim.workload import WorkloadRequest

POLICIES = ("round_robin", "least_loaded", "weighted", "skewed")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    policy: str = "least_loaded"
    weights: tuple[float, ...] = ()  # weighted: one weight per replica
    hot_replica: int = 0  # skewed
    hot_share: float = 0.8  # skewed: share of long requests pinned to the hot replica
    long_threshold: int = 5000  # skewed: output tokens that make a request "long"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if not 0 <= self.hot_share <= 1:
            raise ValueError(f"hot_share must be within [0, 1], got {self.hot_share}")


class Router:
    """Stateful (round-robin position, seeded RNG); one per driver."""

    def __init__(self, spec: RouterSpec, replicas: int) -> None:
        if replicas < 1:
            raise ValueError("a router needs at least one replica")
        if spec.policy == "weighted" and len(spec.weights) != replicas:
            raise ValueError(f"weighted routing needs {replicas} weights, got {len(spec.weights)}")
        if spec.policy == "skewed" and not 0 <= spec.hot_replica < replicas:
            raise ValueError(f"hot_replica {spec.hot_replica} is not one of the {replicas} replicas")
        self.spec = spec
        self.replicas = replicas
        self._next = 0
        self._rng = random.Random(spec.seed)

    def route(self, request: WorkloadRequest, loads: Sequence[int]) -> int:
        """Replica index for ``request``; ``loads`` are outstanding requests per replica."""
        spec = self.spec
        policy = spec.policy
        if policy == "round_robin":
            i = self._next
            self._next = (i + 1) % self.replicas
            return i
        if policy == "weighted":
            return self._rng.choices(range(self.replicas), spec.weights)[0]
        if (
            policy == "skewed"
            and request.output_tokens > spec.long_threshold
            and self._rng.random() < spec.hot_share
        ):
            return spec.hot_replica
        return self._least_loaded(loads)

    def _least_loaded(self, loads: Sequence[int]) -> int:
        """Fewest outstanding requests; ties rotate so an idle fleet fills round-robin."""
        n = self.replicas
        start = self._next
        best, best_load = start, loads[start]
        for k in range(1, n):
            i = (start + k) % n
            if loads[i] < best_load:
                best, best_load = i, loads[i]
        self._next = (start + 1) % n
        return best
