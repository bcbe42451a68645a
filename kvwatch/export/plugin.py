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
from kvwatch.catalog import spec
from kvwatch.config import Config
from kvwatch.export.encode import HistogramRows
from kvwatch.state import NodeState

BLOCK_HISTOGRAMS = (
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
        catalog = spec("kvwatch_engine_step_seconds")
        steps = HistogramRows(catalog.name, catalog.help, catalog.labels)
        for (replica, dp_rank), unit in units:
            for band, h in sorted(unit.step_seconds.items()):
                steps.add_row((replica, dp_rank, band), le_labels(h.bounds), h.cumulative_counts(), h.sum)
        yield steps
        for name, attr in BLOCK_HISTOGRAMS:
            catalog = spec(name)
            family = HistogramRows(catalog.name, catalog.help, catalog.labels)
            for key, unit in units:
                h = getattr(unit, attr)
                if h.count:
                    family.add_row(key, le_labels(h.bounds), h.cumulative_counts(), h.sum)
            yield family
        dropped = spec("kvwatch_vllm_plugin_dropped_datagrams").counter()
        dropped_steps = spec("kvwatch_vllm_plugin_dropped_steps").counter()
        for key, unit in units:
            dropped.add_metric(list(key), float(unit.dropped_datagrams.total))
            dropped_steps.add_metric(list(key), float(unit.dropped_steps.total))
        yield dropped
        yield dropped_steps
