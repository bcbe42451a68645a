"""A proxied vLLM replica scraped into a NodeState, and the derived families as /metrics renders them:
the derive export tests and the plugin tests (whose exact recompute replaces the estimate) read the
same series through the same steps as the agent."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.agent.derived import update_derived
from kvwatch.config import Config
from kvwatch.export.derived import DerivedCollector
from kvwatch.state import NodeState
from tests.configs import proxied_replica

from .factories import decoding

PROXIED = Config(replicas=(proxied_replica("r0", 1),))


def scraped(state: NodeState, t: float, config: Config = PROXIED, **fields) -> None:
    """What the scraper does after a good scrape, then what the agent calls."""
    target = state.target("r0")
    target.up, target.backend, target.samples = True, "vllm", (decoding(t, **fields),)
    target.in_flight = tuple(state.in_flight.current("r0"))  # as the page is read
    update_derived(state, config, now=t)


def exposition(state: NodeState, config: Config = PROXIED) -> dict[str, list]:
    class Wrapper:
        def collect(self):
            return DerivedCollector(state, config).collect()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Wrapper())
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}
