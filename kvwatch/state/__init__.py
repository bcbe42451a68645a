"""The agent's current view of the node: what sources wrote last, and cumulative request stats.

One concern a module: ``node`` (``NodeState``, collector and target status), ``request_stats``
(``RequestStats``), ``in_flight`` (``InFlightTracker``) and ``plugin`` (``PluginStats``). The names
are re-exported here, so ``from kvwatch.state import NodeState`` reads as it always did.
"""

from kvwatch.state.in_flight import InFlightTracker
from kvwatch.state.node import (
    CollectorStatus,
    ConfigReloadStatus,
    DiscoveryStatus,
    NodeState,
    TargetState,
)
from kvwatch.state.plugin import (
    BATCH_TOKEN_BANDS,
    MAX_SENDER_PIDS,
    STEP_RING_SIZE,
    PluginStats,
    PluginUnit,
    SenderCounts,
)
from kvwatch.state.request_stats import (
    HISTOGRAM_FAMILIES,
    PREBINNED_FAMILIES,
    DualHistogram,
    RequestStats,
)

__all__ = [
    "BATCH_TOKEN_BANDS",
    "HISTOGRAM_FAMILIES",
    "MAX_SENDER_PIDS",
    "PREBINNED_FAMILIES",
    "STEP_RING_SIZE",
    "CollectorStatus",
    "ConfigReloadStatus",
    "DiscoveryStatus",
    "DualHistogram",
    "InFlightTracker",
    "NodeState",
    "PluginStats",
    "PluginUnit",
    "RequestStats",
    "SenderCounts",
    "TargetState",
]
