"""Keep the node's derived KV signals current: the one writer of ``NodeState.derived``.

The agent calls ``update_derived(state, config, now)`` after every engine scrape (success or
failure) and after every GPU poll. It reads what the sources wrote, computes every derived signal
with ``kvwatch.derive.node.derive_node`` and replaces ``state.derived`` whole. ``/metrics`` only
reads that view (nothing is computed or mutated at scrape time), so the recompute estimate, which is
a counter kvwatch keeps, advances once per engine sample however often Prometheus scrapes.

Concurrent calls are harmless: each derives from a complete earlier view, and the estimate is kept
as counter readings, so a lost update is recomputed from the same readings by the next call.
"""

from __future__ import annotations

from kvwatch.config import Config
from kvwatch.derive.node import DerivedSettings, DerivedView, NodeInputs, derive_node
from kvwatch.derive.pcie import link_bytes_per_second
from kvwatch.state import NodeState


def node_inputs(state: NodeState, config: Config) -> NodeInputs:
    """A snapshot of what the derived signals read (samples of targets that are up only, and the
    in-flight requests as of each one's page).

    KV bytes per token (per GPU, which turns token- and block-counted tier traffic into bytes) are
    the replica's configured ``kv_bytes_per_token`` where set, else what its engine reports.
    """
    samples = tuple(state.live_samples())
    kv_bytes: dict[str, float] = {}
    for sample in samples:
        value = config.kv_bytes_per_token(sample)
        if value is not None:
            kv_bytes.setdefault(sample.replica, value)
    return NodeInputs(
        samples=samples,
        gpus=state.gpus,
        replica_gpus=dict(state.replica_gpus),
        in_flight=tuple(state.in_flight_at_scrape()),
        proxied=frozenset(r.name for r in config.replicas if r.proxy_listen is not None),
        kv_bytes_per_token=kv_bytes,
        link_bandwidth=link_bytes_per_second,
    )


def update_derived(
    state: NodeState, config: Config, now: float, settings: DerivedSettings | None = None
) -> DerivedView:
    """Recompute the derived view from the current state and store it; returns the new view."""
    view = derive_node(state.derived, node_inputs(state, config), now, settings or DerivedSettings())
    state.derived = view
    return view
