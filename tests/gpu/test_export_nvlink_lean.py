"""The lean profile's per-GPU NVLink sums through the real collector: one link's failed read is a gap
in the folded counter, never a drop that Prometheus would take for a counter reset."""

from __future__ import annotations

from typing import Any

import pynvml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.agent.gpu import refresh_gpu_state
from kvwatch.config import Config, MetricsConfig
from kvwatch.export.gpus import GpuCollector
from kvwatch.gpu.fake import FakeNvml
from kvwatch.gpu.nvml import NvmlCollector
from kvwatch.model import LengthBands
from kvwatch.state import NodeState

TB = 10**12
TX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX


class _LinkFieldFails(FakeNvml):
    """A fake whose next field read fails for one link only: each field has its own status in NVML,
    so one link's counter can fail while its neighbours answer."""

    failing_link: int | None = None

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:  # noqa: N803
        values = super().nvmlDeviceGetFieldValues(handle, fieldIds)
        failing = [fv for fv in values if (fv.fieldId, fv.scopeId) == (TX, self.failing_link)]
        for fv in failing:
            fv.nvmlReturn = pynvml.NVML_ERROR_UNKNOWN
            self.failing_link = None  # once
        return values


class _Twin:
    """One H200 with two NVLink links, polled into NodeState and rendered in a chosen profile."""

    def __init__(self) -> None:
        self.fake = _LinkFieldFails(gpus=1)
        self.fake.gpu(0).set_link_count(2)
        self.collector = NvmlCollector(self.fake)
        assert self.collector.start()
        self.state = NodeState("node-a", LengthBands())

    def poll(self, link_tx: int, failing_link: int | None = None) -> None:
        for link in (0, 1):
            self.fake.add_nvlink_traffic(0, link, tx_bytes=link_tx)
        self.fake.failing_link = failing_link
        refresh_gpu_state(self.collector, self.state)

    def tx_series(self, profile: str) -> dict[str, float]:
        """``link`` label -> kvwatch_gpu_nvlink_tx_bytes_total of GPU 0."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(GpuCollector(self.state, Config(metrics=MetricsConfig(profile))))
        text = generate_latest(registry).decode()
        return {
            s.labels.get("link", ""): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "kvwatch_gpu_nvlink_tx_bytes_total"
        }


def test_lean_nvlink_sum_never_decreases_when_one_link_read_fails() -> None:
    node = _Twin()
    lean: list[float] = []
    for failing in (None, 1, None, 0, None):
        node.poll(7 * TB // 1024 * 1024, failing_link=failing)
        lean += node.tx_series("lean").values()
    assert lean == sorted(lean), lean
    assert len(lean) == 3  # the two polls with a failed link read left the series out: a gap


def test_lean_nvlink_sum_is_left_out_for_the_poll_a_link_failed_and_full_keeps_the_other_link() -> None:
    node = _Twin()
    node.poll(1024, failing_link=1)
    assert node.tx_series("lean") == {}
    assert node.tx_series("full") == {"0": 1024}
    node.poll(1024)
    assert node.tx_series("lean") == {"": 4096}
