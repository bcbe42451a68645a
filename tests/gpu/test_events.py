"""XidWatcher: XIDs delivered from the event set wait, per code; partial support; clean stop."""

from __future__ import annotations

import logging
import time
from collections import Counter

import pynvml
import pytest

from kvwatch.gpu.events import XidWatcher
from kvwatch.gpu.fake import FakeNvml
from tests.local import wait_until

XID_ONLY = pynvml.nvmlEventTypeXidCriticalError


class Recorder:
    def __init__(self) -> None:
        self.xids: Counter[tuple[int, str, int]] = Counter()
        self.events: list[tuple[int, str, str, int]] = []

    def on_xid(self, index: int, uuid: str, xid: int) -> None:
        self.xids[(index, uuid, xid)] += 1

    def on_event(self, index: int, uuid: str, label: str, data: int) -> None:
        self.events.append((index, uuid, label, data))


@pytest.fixture
def watched():
    fake = FakeNvml(gpus=2)
    rec = Recorder()
    watcher = XidWatcher(rec.on_xid, nvml=fake, on_event=rec.on_event, wait_timeout_ms=100)
    assert watcher.start()
    yield fake, rec, watcher
    watcher.stop()


def test_xids_are_counted_per_gpu_and_code(watched):
    fake, rec, _ = watched
    for index, xid in ((1, 79), (1, 79), (0, 13), (1, 48)):
        fake.inject_xid(index, xid)
    assert wait_until(lambda: sum(rec.xids.values()) == 4)
    uuid0, uuid1 = fake.gpu(0).uuid, fake.gpu(1).uuid
    assert rec.xids == Counter({(1, uuid1, 79): 2, (0, uuid0, 13): 1, (1, uuid1, 48): 1})


def test_xid_of_a_lost_gpu_still_arrives(watched):
    fake, rec, _ = watched
    fake.set_lost(1)
    fake.inject_xid(1, 79)  # "GPU has fallen off the bus"
    assert wait_until(lambda: rec.xids[(1, fake.gpu(1).uuid, 79)] == 1)


def test_ecc_events_go_to_on_event_not_to_the_xid_count(watched):
    fake, rec, _ = watched
    fake.inject_event(0, pynvml.nvmlEventTypeDoubleBitEccError, 0)
    assert wait_until(lambda: rec.events == [(0, fake.gpu(0).uuid, "ecc_double_bit", 0)])
    assert not rec.xids


def test_only_the_supported_subset_is_registered():
    fake = FakeNvml(gpus=2)
    fake.gpu(1).supported_events = XID_ONLY
    watcher = XidWatcher(lambda *_: None, nvml=fake, wait_timeout_ms=50)
    assert watcher.start()
    try:
        assert watcher.registered == {0: ("xid", "ecc_double_bit", "ecc_single_bit"), 1: ("xid",)}
    finally:
        watcher.stop()


def test_each_type_is_tried_alone_when_supported_types_cannot_be_asked():
    fake = FakeNvml(gpus=1)
    fake.gpu(0).supported_events = XID_ONLY | pynvml.nvmlEventTypeSingleBitEccError
    fake.unsupported("nvmlDeviceGetSupportedEventTypes")
    rec = Recorder()
    watcher = XidWatcher(rec.on_xid, nvml=fake, wait_timeout_ms=50)
    assert watcher.start()
    try:
        assert watcher.registered == {0: ("xid", "ecc_single_bit")}
        fake.inject_xid(0, 31)
        assert wait_until(lambda: sum(rec.xids.values()) == 1)
    finally:
        watcher.stop()


def test_no_gpu_supporting_events_means_no_thread(caplog: pytest.LogCaptureFixture):
    fake = FakeNvml(gpus=1)
    fake.gpu(0).supported_events = pynvml.nvmlEventTypePState
    watcher = XidWatcher(lambda *_: None, nvml=fake)
    with caplog.at_level(logging.INFO, logger="kvwatch.gpu.events"):
        assert watcher.start() is False
    assert not watcher.running and not fake.initialized
    assert "XID events off" in caplog.text


def test_stop_joins_within_about_one_wait_and_frees_everything():
    fake = FakeNvml(gpus=2)
    watcher = XidWatcher(lambda *_: None, nvml=fake)  # default 500 ms wait
    assert watcher.start() and watcher.running
    time.sleep(0.05)  # let the thread block in the wait
    started = time.monotonic()
    watcher.stop()
    elapsed = time.monotonic() - started
    # one 500 ms wait at most; 2.5 s allows for a loaded 2-core machine without hiding a hang
    assert elapsed < 2.5
    assert not watcher.running
    assert fake.calls["nvmlEventSetFree"] == 1 and not fake.initialized


def test_a_failing_callback_does_not_end_the_watcher(caplog: pytest.LogCaptureFixture):
    fake = FakeNvml(gpus=1)
    seen = []

    def on_xid(index: int, uuid: str, xid: int) -> None:
        seen.append(xid)
        if xid == 1:
            raise RuntimeError("bug in the callback")

    watcher = XidWatcher(on_xid, nvml=fake, wait_timeout_ms=50)
    assert watcher.start()
    try:
        with caplog.at_level(logging.ERROR, logger="kvwatch.gpu.events"):
            fake.inject_xid(0, 1)
            fake.inject_xid(0, 2)
            assert wait_until(lambda: seen == [1, 2])
        assert watcher.errors == 1 and watcher.running
    finally:
        watcher.stop()


def test_wait_errors_are_survived(caplog: pytest.LogCaptureFixture):
    fake = FakeNvml(gpus=1)
    rec = Recorder()
    fake.fail("nvmlEventSetWait_v2", pynvml.NVMLError_Unknown, times=1)
    watcher = XidWatcher(rec.on_xid, nvml=fake, wait_timeout_ms=50)
    assert watcher.start()
    try:
        fake.inject_xid(0, 43)
        assert wait_until(lambda: sum(rec.xids.values()) == 1)
        assert watcher.errors == 1
    finally:
        watcher.stop()


def test_watcher_and_collector_hold_separate_nvml_references():
    from kvwatch.gpu.nvml import NvmlCollector

    fake = FakeNvml(gpus=1)
    collector = NvmlCollector(fake)
    assert collector.start()
    watcher = XidWatcher(lambda *_: None, nvml=fake, wait_timeout_ms=50)
    assert watcher.start()
    watcher.stop()
    assert fake.initialized and len(collector.poll()) == 1  # the collector still works
    collector.stop()
    assert not fake.initialized


def test_a_lasting_wait_failure_is_logged_once(caplog: pytest.LogCaptureFixture):
    fake = FakeNvml(gpus=1)
    fake.fail("nvmlEventSetWait_v2", pynvml.NVMLError_Unknown)  # until cleared
    watcher = XidWatcher(lambda *_: None, nvml=fake, wait_timeout_ms=50)
    with caplog.at_level(logging.WARNING, logger="kvwatch.gpu.events"):
        assert watcher.start()
        try:
            assert wait_until(lambda: watcher.errors >= 2)  # failed, paused 1 s, failed again
        finally:
            watcher.stop()
    assert len([r for r in caplog.records if "event wait failed" in r.getMessage()]) == 1


def test_event_types_an_older_nvidia_ml_py_does_not_name_are_skipped_not_fatal():
    """nvidia-ml-py before 12.570 has no nvmlEventTypeGpuUnavailableError or ...GpuRecoveryAction
    (12.560.30, the least vLLM asks for, among them): the watcher's start raised AttributeError, and
    with it the agent's start on every GPU node."""
    fake = FakeNvml(gpus=1)
    for name in ("nvmlEventTypeGpuUnavailableError", "nvmlEventTypeGpuRecoveryAction"):
        delattr(fake, name)
    rec = Recorder()
    watcher = XidWatcher(rec.on_xid, nvml=fake, wait_timeout_ms=100)
    assert watcher.start()
    try:
        assert watcher.registered[0] == ("xid", "ecc_double_bit", "ecc_single_bit")
        fake.inject_xid(0, 79)
        assert wait_until(lambda: rec.xids[(0, fake.gpu(0).uuid, 79)] == 1)
    finally:
        watcher.stop()


def test_each_gpus_ecc_events_are_logged_at_warning_once(caplog: pytest.LogCaptureFixture):
    """The agent passes no on_event: every single-bit ECC event was a warning line, and a GPU with a
    weak row sends them by the thousand (their counts are the polled ECC counters)."""
    fake = FakeNvml(gpus=2)
    watcher = XidWatcher(Recorder().on_xid, nvml=fake, wait_timeout_ms=100)
    assert watcher.start()
    try:
        with caplog.at_level(logging.DEBUG, logger="kvwatch.gpu.events"):
            for _ in range(50):
                fake.inject_event(0, pynvml.nvmlEventTypeSingleBitEccError, 0)
            fake.inject_event(1, pynvml.nvmlEventTypeSingleBitEccError, 0)
            wait_until(lambda: sum("ecc_single_bit" in r.getMessage() for r in caplog.records) == 51)
    finally:
        watcher.stop()
    warned = [
        r for r in caplog.records if r.levelno == logging.WARNING and "ecc_single_bit" in r.getMessage()
    ]
    assert [r.getMessage().split(" ")[1] for r in warned] == ["0", "1"]  # once per GPU
