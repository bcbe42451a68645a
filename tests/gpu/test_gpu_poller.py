"""The agent-facing glue: NVML poll -> NodeState, and /proc + NVML -> replica GPU mapping."""

from __future__ import annotations

import logging
from pathlib import Path

import pynvml
import pytest

from kvwatch.agent.gpu import nvml_backend, refresh_gpu_state, refresh_mapping, xid_recorder
from kvwatch.config import Config, NvmlConfig, ReplicaConfig
from kvwatch.gpu.fake import MIB, FakeNvml
from kvwatch.gpu.nvml import NvmlCollector
from kvwatch.gpu.processes import ProcReader
from kvwatch.model import LengthBands
from kvwatch.state import NodeState

from .fakes import Clock, FakeProc


@pytest.fixture
def state() -> NodeState:
    return NodeState("node-a", LengthBands())


def replica(name: str, **kw) -> ReplicaConfig:
    return ReplicaConfig(name=name, metrics_url=f"http://127.0.0.1:8000/{name}/metrics", **kw)


def test_refresh_stores_samples_and_reports_success(state: NodeState, collector: NvmlCollector, clock: Clock):
    report = refresh_gpu_state(collector, state, now=clock.now)
    assert report.success and len(state.gpus) == 2 and state.driver_version == "550.90.12"
    status = state.collectors["nvml"]
    assert status.success and status.last_success_ts == clock.now and status.last_error is None


def test_refresh_counts_call_errors_without_failing_the_collector(
    state: NodeState, fake: FakeNvml, collector: NvmlCollector
):
    fake.fail("nvmlDeviceGetTemperature", pynvml.NVMLError_Unknown)
    refresh_gpu_state(collector, state)
    refresh_gpu_state(collector, state)
    assert state.collectors["nvml"].success
    assert state.counters_for("kvwatch_gpu_nvml_errors") == [(("nvmlDeviceGetTemperature", "Unknown"), 4.0)]


def test_refresh_without_nvml_empties_gpus_and_reports_failure(
    state: NodeState, fake: FakeNvml, collector: NvmlCollector
):
    refresh_gpu_state(collector, state)
    assert state.gpus
    fake.nvmlShutdown()  # the driver went away
    refresh_gpu_state(collector, state)
    assert state.gpus == ()  # nothing stale served as fresh
    status = state.collectors["nvml"]
    assert not status.success and "stopped answering" in status.last_error


def test_xid_recorder_counts_per_gpu_and_code(state: NodeState, caplog: pytest.LogCaptureFixture):
    on_xid = xid_recorder(state)
    with caplog.at_level(logging.WARNING):
        on_xid(3, "GPU-x", 79)
        on_xid(3, "GPU-x", 79)
        on_xid(3, "GPU-x", 48)
    assert state.xid_counts == {("3", "GPU-x", 79): 2, ("3", "GPU-x", 48): 1}
    assert "XID 79" in caplog.text


def test_nvml_backend_follows_config():
    assert nvml_backend(NvmlConfig(enabled=False)) is None
    assert nvml_backend(NvmlConfig()) is pynvml
    fake = nvml_backend(NvmlConfig(fake_gpus=3))
    assert isinstance(fake, FakeNvml) and fake.gpu(2).name == "NVIDIA H200"


def test_refresh_mapping_end_to_end(
    state: NodeState, proc: FakeProc, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    # r0: vLLM engine 100 with TP workers 101, 102 on GPUs 0 and 1 (NVML lists host PIDs)
    proc.add(100, ppid=1, children=(101, 102))
    proc.add(101, ppid=100)
    proc.add(102, ppid=100)
    # r1: found through its pid file; NVML does not list it yet, its environment says GPU 3
    proc.add(200, ppid=1, environ={"CUDA_VISIBLE_DEVICES": "3", "HF_TOKEN": "secret"})
    (tmp_path / "r1.pid").write_text("200\n")
    config = Config(
        replicas=(
            replica("r0", pid=100),
            replica("r1", pid_file=str(tmp_path / "r1.pid")),
            replica("r2", gpus=("1",)),
            replica("r3", pid_file=str(tmp_path / "missing.pid")),
        )
    )
    fake = FakeNvml(gpus=4)
    for pid, gpu in ((101, 0), (102, 1)):
        fake.add_process(gpu, pid, 60 * 1024 * MIB)
    node = NvmlCollector(fake)
    assert node.start()
    refresh_gpu_state(node, state)
    seen: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="kvwatch.agent.gpu"):
        result = refresh_mapping(config, state, ProcReader(proc.root), seen)
        refresh_mapping(config, state, ProcReader(proc.root), seen)
    u = [fake.gpu(i).uuid for i in range(4)]
    assert state.replica_gpus == {
        "r0": (("0", u[0], "pid"), ("1", u[1], "pid")),
        "r1": (("3", u[3], "cuda_visible_devices"),),
        "r2": (("1", u[1], "config"),),
    }
    assert state.pid_replica == {100: "r0", 101: "r0", 102: "r0", 200: "r1"}
    assert result.replica_gpus == state.replica_gpus
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "replicas[3].pid_file (r3)" in notes[0]  # logged once, not every refresh
    assert "secret" not in caplog.text
