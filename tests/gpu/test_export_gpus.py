"""GpuCollector output through prometheus_client's real exposition, checked by promtool."""

from __future__ import annotations

import subprocess

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.agent.gpu import refresh_gpu_state
from kvwatch.catalog import CATALOG
from kvwatch.config import Config, MetricsConfig
from kvwatch.export.gpus import GpuCollector
from kvwatch.gpu.fake import MIB, FakeNvml
from kvwatch.gpu.nvml import NvmlCollector
from kvwatch.model import LengthBands
from kvwatch.state import NodeState
from tests.local import require_tool


class _Registered:
    def __init__(self, collector: GpuCollector) -> None:
        self.collector = collector

    def collect(self):
        return self.collector.collect()


def render(state: NodeState, profile: str = "full") -> str:
    """The GPU families; ``full``: NVLink per link (lean sums them: tests/export/test_profiles.py)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Registered(GpuCollector(state, Config(metrics=MetricsConfig(profile)))))
    return generate_latest(registry).decode()


def samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """series name -> sorted label pairs -> value"""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(series: dict, **labels: str) -> float:
    matches = [v for key, v in series.items() if set(labels.items()) <= set(key)]
    assert len(matches) == 1, (labels, series)
    return matches[0]


@pytest.fixture
def node() -> tuple[FakeNvml, NodeState]:
    """Two H200s with everything exercised: a process of a mapped replica, XIDs, NVML errors."""
    fake = FakeNvml(gpus=2)
    fake.add_process(0, 4242, 60 * 1024 * MIB)
    fake.add_process(1, 777, None)
    fake.add_pcie_traffic(0, tx_bytes=10_000, rx_bytes=20_000)
    fake.add_nvlink_traffic(0, 17, tx_bytes=4096)
    fake.set_throttle(1, pynvml.nvmlClocksEventReasonSwPowerCap)
    fake.add_ecc_errors(1, corrected=5)
    fake.set_link(1, gen=4, width=8)
    collector = NvmlCollector(fake)
    assert collector.start()
    state = NodeState("node-a", LengthBands())
    fake.fail("nvmlDeviceGetTemperature", pynvml.NVMLError_Unknown, gpu=1, times=1)
    refresh_gpu_state(collector, state)
    u0, u1 = fake.gpu(0).uuid, fake.gpu(1).uuid
    state.xid_counts[("0", u0, 79)] += 2
    state.xid_counts[("1", u1, 13)] += 1
    state.replica_gpus = {"r0": (("0", u0, "pid"),)}
    state.pid_replica = {4242: "r0"}
    return fake, state, collector


def test_every_gpu_family_of_the_catalog_is_exported(node):
    _, state, _ = node
    names = {f.name for f in text_string_to_metric_families(render(state))}  # counters without _total
    specs = [
        s
        for s in CATALOG
        if s.area == "gpu" or s.name in ("kvwatch_replica_gpu", "kvwatch_gpu_pcie_link_max_bytes_per_second")
    ]
    wanted = {f"{s.name}_info" if s.kind == "info" else s.name for s in specs}
    assert names == wanted


def test_values_are_in_base_units_with_identity_labels(node):
    fake, state, _ = node
    out = samples(render(state))
    u0, u1 = fake.gpu(0).uuid, fake.gpu(1).uuid
    assert (
        value(
            out["kvwatch_gpu_info"],
            gpu="0",
            uuid=u0,
            name="NVIDIA H200",
            pci_bus_id="00000000:19:00.0",
            driver_version="550.90.12",
        )
        == 1
    )
    assert value(out["kvwatch_gpu_memory_total_bytes"], gpu="0") == 143_771 * MIB
    assert value(out["kvwatch_gpu_power_watts"], gpu="1") == pytest.approx(74.58)
    assert value(out["kvwatch_gpu_temperature_celsius"], gpu="0", sensor="gpu") == 28
    assert value(out["kvwatch_gpu_temperature_celsius"], gpu="0", sensor="memory") == 25
    assert value(out["kvwatch_gpu_clock_hertz"], gpu="0", clock="memory") == 3199e6
    assert value(out["kvwatch_gpu_pcie_tx_bytes_total"], gpu="0", uuid=u0) == 10_000
    assert value(out["kvwatch_gpu_nvlink_tx_bytes_total"], gpu="0", link="17") == 4096
    assert value(out["kvwatch_gpu_nvlink_active"], gpu="0", link="17") == 1
    assert value(out["kvwatch_gpu_clock_event_active"], gpu="1", reason="sw_power_cap") == 1
    assert value(out["kvwatch_gpu_clock_event_active"], gpu="1", reason="gpu_idle") == 0
    assert value(out["kvwatch_gpu_ecc_errors_total"], gpu="1", type="corrected") == 5
    assert value(out["kvwatch_gpu_remapped_rows"], gpu="1", type="uncorrectable") == 0
    assert value(out["kvwatch_gpu_xid_errors_total"], gpu="0", xid="79") == 2
    assert value(out["kvwatch_gpu_xid_errors_total"], gpu="1", uuid=u1, xid="13") == 1
    process_memory = out["kvwatch_gpu_process_memory_bytes"]
    assert value(process_memory, gpu="0", pid="4242", replica="r0") == 60 * 1024 * MIB
    assert len(process_memory) == 1  # pid 777's memory is not available: left out
    assert value(out["kvwatch_replica_gpu_info"], replica="r0", gpu="0", uuid=u0, mapped_by="pid") == 1
    assert value(out["kvwatch_gpu_nvml_errors_total"], call="nvmlDeviceGetTemperature", error="Unknown") == 1
    link_max = out["kvwatch_gpu_pcie_link_max_bytes_per_second"]
    assert value(link_max, gpu="0") == pytest.approx(63.015e9, rel=1e-4)  # Gen5 x16
    assert value(link_max, gpu="1") == pytest.approx(15.754e9, rel=1e-4)  # Gen4 x8
    assert len(out["kvwatch_gpu_temperature_celsius"]) == 3  # GPU 1's gpu sensor failed: left out, not 0


def test_lost_gpu_exports_only_identity_lost_and_xids(node):
    fake, state, collector = node  # the collector learned both identities in its first poll
    fake.set_lost(1)
    refresh_gpu_state(collector, state)
    out = samples(render(state))
    gpu1 = {name for name, series in out.items() if any(("gpu", "1") in key for key in series)}
    assert gpu1 == {"kvwatch_gpu_info", "kvwatch_gpu_lost", "kvwatch_gpu_xid_errors_total"}
    assert value(out["kvwatch_gpu_info"], gpu="1", uuid=fake.gpu(1).uuid, name="NVIDIA H200") == 1
    assert value(out["kvwatch_gpu_lost"], gpu="1", uuid=fake.gpu(1).uuid) == 1
    assert value(out["kvwatch_gpu_lost"], gpu="0") == 0


def test_gpus_that_vanish_drop_out(node):
    _, state, _ = node
    state.gpus = state.gpus[:1]
    out = samples(render(state))
    assert not [name for name, series in out.items() if any(("gpu", "1") in key for key in series)]


def test_without_nvml_no_gpu_series_remain(node):
    fake, state, collector = node
    fake.nvmlShutdown()  # the driver went away; the collector sees it on its next poll
    refresh_gpu_state(collector, state)
    out = samples(render(state))
    assert set(out) <= {"kvwatch_replica_gpu_info", "kvwatch_gpu_nvml_errors_total"}


def test_empty_state_renders_nothing():
    assert render(NodeState("n", LengthBands())) == ""


@pytest.mark.prometheus
def test_promtool_accepts_the_exposition(node):
    fake, state, collector = node
    fake.set_lost(1)
    refresh_gpu_state(collector, state)
    text = render(state)
    promtool = require_tool("promtool")
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout + done.stderr == ""
