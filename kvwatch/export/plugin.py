"""What kvwatch's vLLM plugin reported per DP rank: step time by batch size, KV block lifetimes, drops.

Read from ``NodeState.plugin`` (``PluginStats``), written by the plugin receiver. Histograms appear
once they have an observation (step times need vLLM's ``--enable-logging-iteration-details``, block
lifetimes ``--kv-cache-metrics``); the drop counters (datagrams, and the steps in them) appear with
the first datagram of a rank. The exact recompute counter is rendered with the estimate it replaces
(``export/derived.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from kvwatch.buckets import le_labels
from kvwatch.catalog import MetricSpec, spec_rows
from kvwatch.config import Config
from kvwatch.export.encode import HistogramRows
from kvwatch.export.families import (
    ENGINE_STEP_SECONDS,
    VLLM_PLUGIN_DROPPED_DATAGRAMS,
    VLLM_PLUGIN_DROPPED_STEPS,
)
from kvwatch.state import NodeState

#: (family, PluginUnit histogram attribute)
BLOCK_HISTOGRAMS: tuple[tuple[MetricSpec, str], ...] = spec_rows(
    ("kvwatch_kv_block_lifetime_seconds", "block_lifetime"),
    ("kvwatch_kv_block_idle_seconds", "block_idle"),
    ("kvwatch_kv_block_reuse_gap_seconds", "block_reuse_gap"),
)


class PluginCollector:
    def __init__(self, state: NodeState, config: Config) -> None:
        self.state = state
        self.config = config

    def collect(self) -> Iterator[Metric]:
        units = sorted(self.state.plugin.snapshot().items())
        steps = HistogramRows.of(ENGINE_STEP_SECONDS)
        for (replica, dp_rank), unit in units:
            for band, h in sorted(unit.step_seconds.items()):
                steps.add_row((replica, dp_rank, band), le_labels(h.bounds), h.cumulative_counts(), h.sum)
        yield steps
        for catalog, attr in BLOCK_HISTOGRAMS:
            family = HistogramRows.of(catalog)
            for key, unit in units:
                h = getattr(unit, attr)
                if h.count:
                    family.add_row(key, le_labels(h.bounds), h.cumulative_counts(), h.sum)
            yield family
        dropped = VLLM_PLUGIN_DROPPED_DATAGRAMS.counter()
        dropped_steps = VLLM_PLUGIN_DROPPED_STEPS.counter()
        for key, unit in units:
            dropped.add_metric(list(key), float(unit.dropped_datagrams.total))
            dropped_steps.add_metric(list(key), float(unit.dropped_steps.total))
        yield dropped
        yield dropped_steps
