"""KV offload over PCIe uplinks at the measured host bandwidth, shared by the GPUs behind one switch."""

import pytest

from kvwatch.sim.engine import EngineConfig, SimEngine
from kvwatch.sim.hostlink import HostLink, node_host_paths
from kvwatch.sim.models import MEASURED_GEN5_HOST_BANDWIDTH, gpu_preset, model_preset

GB = 1e9


def test_transfers_that_overlap_share_the_link_and_later_ones_do_not_delay_earlier_ones():
    link = HostLink(50 * GB)
    assert link.transfer(1.0, 5 * GB) == pytest.approx(1.1)  # alone: 5 GB at 50 GB/s
    assert link.transfer(1.0, 5 * GB) == pytest.approx(1.2)  # queued behind the first
    # booked after those but earlier in simulated time: it takes the idle time before them
    assert link.transfer(0.5, 1 * GB) == pytest.approx(0.52)
    # and where it does not fit in that idle time, it waits for the booked transfers to end
    assert link.transfer(0.95, 5 * GB) == pytest.approx(1.2 + 0.05)
    assert link.transfer(3.0, 1 * GB) == pytest.approx(3.02)  # the link is free again


def test_replicas_share_an_uplink_only_behind_one_switch():
    paths = node_host_paths(replicas=8, gpus_per_replica=1, gpus_per_switch=2, bytes_per_second=50 * GB)
    # replicas 0 and 1 sit behind switch 0: a store by each at the same time takes twice as long
    assert paths[0].move(0.0, 5 * GB, 0.0) == pytest.approx(0.1)
    assert paths[1].move(0.0, 5 * GB, 0.0) == pytest.approx(0.2)
    assert paths[2].move(0.0, 5 * GB, 0.0) == pytest.approx(0.1)  # switch 1: not shared with them
    # stores and loads go opposite ways on a full-duplex link
    assert paths[3].move(0.0, 0.0, 5 * GB) == pytest.approx(0.1)
    # a TP=2 replica's KV is split over its two GPUs; behind one switch both halves share the uplink
    [own] = node_host_paths(1, 2, 1, 50 * GB)
    [shared] = node_host_paths(1, 2, 2, 50 * GB)
    assert own.move(0.0, 10 * GB, 0.0) == pytest.approx(0.1)
    assert shared.move(0.0, 10 * GB, 0.0) == pytest.approx(0.2)


def test_presets_use_the_measured_host_bandwidth_not_the_datasheet_link_rate():
    for name in ("h100", "h200", "b200"):
        gpu = gpu_preset(name)
        assert gpu.host_bandwidth == MEASURED_GEN5_HOST_BANDWIDTH < gpu.pcie_bandwidth
        assert gpu.gpus_per_host_link == 1


def _preempting_engine(path=None) -> SimEngine:
    cfg = EngineConfig(
        model=model_preset("llama-3.1-8b"),
        num_gpu_blocks_override=600,
        max_model_len=8000,
        kv_offload_bytes=200 * GB,
    )
    e = SimEngine(cfg, host_path=path)
    for i in range(4):
        e.submit(f"r{i}", 2000, 1500, 1500, arrival=0.0)
    return e


def _until_preempted(e: SimEngine) -> float:
    while True:
        e.step()
        if e.last_step.preempted:
            return e.last_step.duration


def test_a_step_that_stores_kv_waits_for_the_shared_uplink():
    alone = _until_preempted(_preempting_engine())
    a_path, b_path = node_host_paths(2, 1, 2, MEASURED_GEN5_HOST_BANDWIDTH)
    a, b = _preempting_engine(a_path), _preempting_engine(b_path)
    first = _until_preempted(a)
    second = _until_preempted(b)  # the same store at the same simulated time, behind the same switch
    assert first == pytest.approx(alone)
    stored = b.stats.offload_store_bytes
    assert stored > 0
    assert second - first == pytest.approx(stored / MEASURED_GEN5_HOST_BANDWIDTH, rel=0.05)
    assert b.stats.offload_queue_seconds == pytest.approx(second - first, rel=0.05)
    assert a.stats.offload_queue_seconds == 0.0
