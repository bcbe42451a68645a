"""NvmlCollector against the fake NVML: every field, per-call failure handling, lost GPUs, retry."""

from __future__ import annotations

import logging
import threading

import pynvml
import pytest

from kvwatch.gpu.fake import MIB, FakeNvml
from kvwatch.gpu.nvml import CLOCK_EVENT_REASONS, NvmlCollector
from kvwatch.model import GpuProcess, GpuSample

from .fakes import Clock


def fields_of(sample: GpuSample) -> dict[str, object]:
    return {name: getattr(sample, name) for name in GpuSample.__slots__ if name != "sampled_at"}


def by_index(samples: list[GpuSample]) -> dict[int, GpuSample]:
    return {s.index: s for s in samples}


# ------------------------------------------------------------------------------------------------
# every field, with units converted
# ------------------------------------------------------------------------------------------------


def test_every_field_is_read_with_units_converted(fake: FakeNvml, collector: NvmlCollector, clock: Clock):
    g = fake.gpu(0)
    g.utilization_gpu, g.utilization_memory = 57, 31
    g.power_mw, g.temperature_c, g.memory_temperature_c = 350_000, 61, 70
    g.sm_clock_mhz, g.memory_clock_mhz = 1980, 3201
    fake.add_energy(0, 123_456)
    fake.add_pcie_traffic(0, tx_bytes=5_000, rx_bytes=7_000)
    fake.add_pcie_replays(0, 3)
    fake.add_nvlink_traffic(0, link=3, tx_bytes=10 * 1024, rx_bytes=2 * 1024)
    fake.set_nvlink_active(0, 5, False)
    fake.add_ecc_errors(0, corrected=4, uncorrected=1)
    fake.set_remapped_rows(0, correctable=2, uncorrectable=1, pending=True, failure=False)
    fake.add_process(0, 4242, 20 * 1024 * MIB)
    fake.set_link(0, gen=4, width=8)

    s = by_index(collector.poll())[0]

    assert s.uuid == g.uuid and s.name == "NVIDIA H200" and s.pci_bus_id == "00000000:19:00.0"
    assert s.sampled_at == clock.now and not s.lost
    assert s.memory_total_bytes == 143_771 * MIB
    assert s.memory_reserved_bytes == 700 * MIB
    assert s.memory_used_bytes == 1 * MIB + 20 * 1024 * MIB
    assert s.memory_total_bytes == s.memory_used_bytes + s.memory_reserved_bytes + s.memory_free_bytes
    assert (s.utilization_gpu_ratio, s.utilization_memory_ratio) == (0.57, 0.31)
    assert (s.pcie_tx_bytes_total, s.pcie_rx_bytes_total, s.pcie_replay_total) == (5_000, 7_000, 3)
    assert (s.pcie_link_gen_current, s.pcie_link_gen_max) == (4, 5)
    assert (s.pcie_link_width_current, s.pcie_link_width_max) == (8, 16)
    assert len(s.nvlinks) == 18
    assert (s.nvlinks[3].tx_bytes_total, s.nvlinks[3].rx_bytes_total) == (10 * 1024, 2 * 1024)
    assert s.nvlinks[5].active is False and s.nvlinks[4].active is True
    assert s.power_watts == 350.0 and s.power_limit_watts == 700.0
    assert s.energy_joules_total == pytest.approx(123.456)
    assert (s.temperature_gpu_celsius, s.temperature_memory_celsius) == (61, 70)
    assert (s.sm_clock_hz, s.memory_clock_hz) == (1.98e9, 3.201e9)
    assert dict(s.clock_event_reasons)["gpu_idle"] is True
    assert (s.ecc_corrected_volatile_total, s.ecc_uncorrected_volatile_total) == (4, 1)
    assert (s.remapped_rows_correctable, s.remapped_rows_uncorrectable) == (2, 1)
    assert s.remap_pending is True and s.remap_failure is False
    assert s.processes == (GpuProcess(4242, 20 * 1024 * MIB),)
    assert collector.report.success and collector.report.call_errors == ()
    assert collector.driver_version() == "550.90.12"


def test_clock_event_reasons_name_every_bit(fake: FakeNvml, collector: NvmlCollector):
    fake.set_throttle(
        0, pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    )
    reasons = dict(by_index(collector.poll())[0].clock_event_reasons)
    assert list(reasons) == [name for name, _ in CLOCK_EVENT_REASONS]
    assert {name for name, active in reasons.items() if active} == {"sw_power_cap", "hw_thermal_slowdown"}


def test_process_memory_not_available_reads_none(fake: FakeNvml, collector: NvmlCollector):
    fake.add_process(1, 77, None)
    assert by_index(collector.poll())[1].processes == (GpuProcess(77, None),)


def test_process_gpus_maps_pids_to_uuids(fake: FakeNvml, collector: NvmlCollector):
    fake.add_process(0, 100, MIB)
    fake.add_process(1, 100, MIB)
    fake.add_process(1, 200, MIB)
    assert collector.process_gpus() == {100: [fake.gpu(0).uuid, fake.gpu(1).uuid], 200: [fake.gpu(1).uuid]}


# ------------------------------------------------------------------------------------------------
# each call on its own: NOT_SUPPORTED is normal, any other error costs only its own value
# ------------------------------------------------------------------------------------------------

#: call -> the sample fields it feeds
CALL_FIELDS = {
    "nvmlDeviceGetMemoryInfo": (
        "memory_total_bytes",
        "memory_used_bytes",
        "memory_reserved_bytes",
        "memory_free_bytes",
    ),
    "nvmlDeviceGetUtilizationRates": ("utilization_gpu_ratio", "utilization_memory_ratio"),
    "nvmlDeviceGetFieldValues": (
        "pcie_tx_bytes_total",
        "pcie_rx_bytes_total",
        "temperature_memory_celsius",
        "nvlinks",
    ),
    "nvmlDeviceGetPcieReplayCounter": ("pcie_replay_total",),
    "nvmlDeviceGetCurrPcieLinkGeneration": ("pcie_link_gen_current",),
    "nvmlDeviceGetMaxPcieLinkGeneration": ("pcie_link_gen_max",),
    "nvmlDeviceGetCurrPcieLinkWidth": ("pcie_link_width_current",),
    "nvmlDeviceGetMaxPcieLinkWidth": ("pcie_link_width_max",),
    "nvmlDeviceGetNvLinkState": ("nvlinks",),
    "nvmlDeviceGetPowerUsage": ("power_watts",),
    "nvmlDeviceGetEnforcedPowerLimit": ("power_limit_watts",),
    "nvmlDeviceGetTotalEnergyConsumption": ("energy_joules_total",),
    "nvmlDeviceGetTemperature": ("temperature_gpu_celsius",),
    "nvmlDeviceGetClockInfo": ("sm_clock_hz", "memory_clock_hz"),
    "nvmlDeviceGetCurrentClocksEventReasons": ("clock_event_reasons",),
    "nvmlDeviceGetTotalEccErrors": ("ecc_corrected_volatile_total", "ecc_uncorrected_volatile_total"),
    "nvmlDeviceGetRemappedRows": (
        "remapped_rows_correctable",
        "remapped_rows_uncorrectable",
        "remap_pending",
        "remap_failure",
    ),
    "nvmlDeviceGetComputeRunningProcesses": ("processes",),
}


def _baseline(fake: FakeNvml) -> dict[str, object]:
    fake.add_process(0, 4242, MIB)
    fake.add_pcie_traffic(0, 1, 1)
    c = NvmlCollector(fake)
    assert c.start()
    sample = by_index(c.poll())[0]
    c.stop()
    base = fields_of(sample)
    assert all(v is not None and v != () for v in base.values()), base  # everything answered
    return base


def _check_only_fed_fields_changed(sample: GpuSample, base: dict[str, object], call: str) -> None:
    now = fields_of(sample)
    changed = {k for k in base if now[k] != base[k]}
    assert changed == set(CALL_FIELDS[call])
    for name in CALL_FIELDS[call]:
        if name == "nvlinks":
            continue
        assert now[name] in (None, ()), name


def test_call_table_covers_every_sample_field():
    fed = {f for fields in CALL_FIELDS.values() for f in fields}
    identity = {"index", "uuid", "name", "pci_bus_id", "lost", "sampled_at"}
    assert fed | identity == set(GpuSample.__slots__)


@pytest.mark.parametrize("call", sorted(CALL_FIELDS))
def test_not_supported_leaves_only_that_call_out(call: str, caplog: pytest.LogCaptureFixture):
    fake = FakeNvml(gpus=1)
    base = _baseline(fake)
    fake.unsupported(call)
    c = NvmlCollector(fake)
    assert c.start()
    with caplog.at_level(logging.DEBUG, logger="kvwatch.gpu.nvml"):
        sample = c.poll()[0]
        c.poll()
    _check_only_fed_fields_changed(sample, base, call)
    assert c.report.success and c.report.call_errors == ()
    debug = [r for r in caplog.records if "not supported" in r.getMessage() and call in r.getMessage()]
    assert len(debug) == 1  # once, not every poll
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("call", sorted(CALL_FIELDS))
def test_one_failing_call_does_not_lose_the_others(call: str):
    fake = FakeNvml(gpus=1)
    base = _baseline(fake)
    fake.fail(call, pynvml.NVMLError_Unknown)
    c = NvmlCollector(fake)
    assert c.start()
    sample = c.poll()[0]
    _check_only_fed_fields_changed(sample, base, call)
    assert c.report.success  # the GPU answered its other calls
    assert c.report.call_errors and set(c.report.call_errors) == {(call, "Unknown")}


def test_failure_on_one_gpu_leaves_the_other_whole(fake: FakeNvml, collector: NvmlCollector):
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVMLError_NoPermission, gpu=1)
    samples = by_index(collector.poll())
    assert samples[0].power_watts == pytest.approx(74.58)
    assert samples[1].power_watts is None and samples[1].memory_total_bytes is not None
    assert collector.report.call_errors == (("nvmlDeviceGetPowerUsage", "NoPermission"),)


def test_failing_field_is_counted_and_its_neighbours_kept(fake: FakeNvml, collector: NvmlCollector):
    fake.gpu(0).field_returns[pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES] = pynvml.NVML_ERROR_UNKNOWN
    fake.gpu(0).unsupported_fields.add(pynvml.NVML_FI_DEV_MEMORY_TEMP)
    s = by_index(collector.poll())[0]
    assert s.pcie_tx_bytes_total is None and s.temperature_memory_celsius is None
    assert s.pcie_rx_bytes_total == 0.0
    label = f"nvmlDeviceGetFieldValues:{pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES}"
    assert collector.report.call_errors == ((label, "Unknown"),)


def test_warning_for_a_failing_call_is_logged_once(
    fake: FakeNvml, collector: NvmlCollector, caplog: pytest.LogCaptureFixture
):
    fake.fail("nvmlDeviceGetTemperature", pynvml.NVMLError_Unknown)
    with caplog.at_level(logging.WARNING, logger="kvwatch.gpu.nvml"):
        for _ in range(3):
            collector.poll()
    assert len([r for r in caplog.records if "nvmlDeviceGetTemperature" in r.getMessage()]) == 1
    assert collector.report.call_errors == (("nvmlDeviceGetTemperature", "Unknown"),) * 2  # two GPUs


# ------------------------------------------------------------------------------------------------
# older drivers: v2 memory, clock "throttle" reasons, _v2 process lists
# ------------------------------------------------------------------------------------------------


def test_memory_falls_back_to_v1_once_and_keeps_reserved_inside_used(
    fake: FakeNvml, collector: NvmlCollector
):
    for i in range(2):
        fake.gpu(i).memory_v2 = False
    s = by_index(collector.poll())[0]
    assert s.memory_reserved_bytes is None
    assert s.memory_used_bytes == (1 + 700) * MIB  # v1 "used" includes the reserved part
    assert s.memory_total_bytes == s.memory_used_bytes + s.memory_free_bytes
    assert collector.report.call_errors == ()
    before = fake.calls["nvmlDeviceGetMemoryInfo"]
    collector.poll()
    assert fake.calls["nvmlDeviceGetMemoryInfo"] - before == 2  # v1 only: one call per GPU


def test_a_driver_upgraded_while_nvml_was_gone_is_asked_for_memory_v2_again(fake: FakeNvml) -> None:
    """The fall-back to v1 memory held for the collector's life, not until NVML re-initialised as
    promised: after a driver upgrade, reserved memory stayed missing and inside "used"."""
    now = [1000.0]
    collector = NvmlCollector(fake, now=lambda: now[0])
    assert collector.start()
    for i in range(2):
        fake.gpu(i).memory_v2 = False
    assert by_index(collector.poll())[0].memory_reserved_bytes is None
    fake.fail("nvmlDeviceGetUtilizationRates", pynvml.NVMLError_DriverNotLoaded, times=1)
    collector.poll()  # the driver went away (it is being upgraded)
    assert not collector.available
    for i in range(2):
        fake.gpu(i).memory_v2 = True
    now[0] += 60.0  # past the retry
    s = by_index(collector.poll())[0]
    assert collector.available
    assert s.memory_reserved_bytes == 700 * MIB
    assert s.memory_used_bytes == 1 * MIB


def test_a_gpu_name_that_failed_once_is_asked_again_not_blank_for_the_session(
    fake: FakeNvml, collector: NvmlCollector
) -> None:
    fake.fail("nvmlDeviceGetName", pynvml.NVMLError_Unknown, times=1)
    first = by_index(collector.poll())
    assert {first[0].name, first[1].name} == {None, fake.gpu(1).name}  # one GPU's call failed
    again = by_index(collector.poll())
    assert [again[i].name for i in range(2)] == [fake.gpu(0).name, fake.gpu(1).name]
    asked = fake.calls["nvmlDeviceGetName"]
    collector.poll()
    assert fake.calls["nvmlDeviceGetName"] == asked  # once whole, remembered


def test_clock_reasons_use_the_deprecated_call_on_drivers_without_the_new_one(
    fake: FakeNvml, collector: NvmlCollector
):
    fake.fail("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVMLError_FunctionNotFound)
    fake.set_throttle(0, pynvml.nvmlClocksEventReasonSwPowerCap)
    reasons = dict(by_index(collector.poll())[0].clock_event_reasons)
    assert reasons["sw_power_cap"] is True and reasons["gpu_idle"] is False
    assert collector.report.call_errors == ()


def test_process_list_uses_v2_when_pynvml_reports_a_library_mismatch(
    fake: FakeNvml, collector: NvmlCollector
):
    fake.fail("nvmlDeviceGetComputeRunningProcesses", pynvml.NVMLLibraryMismatchError)
    fake.add_process(0, 9, MIB)
    assert by_index(collector.poll())[0].processes == (GpuProcess(9, MIB),)
    assert collector.report.call_errors == ()


# ------------------------------------------------------------------------------------------------
# NVLink variants
# ------------------------------------------------------------------------------------------------


def test_nvlink_byte_counters_are_used_where_throughput_fields_are_not_supported(
    fake: FakeNvml, collector: NvmlCollector
):
    g = fake.gpu(0)
    g.unsupported_fields = {
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
    }
    fake.add_nvlink_traffic(0, 2, tx_bytes=1000, rx_bytes=1)
    link = by_index(collector.poll())[0].nvlinks[2]
    assert (link.tx_bytes_total, link.rx_bytes_total) == (1000, 1)  # bytes, not KiB-truncated


def test_nvlink_source_is_chosen_once_so_a_counter_never_switches(fake: FakeNvml, collector: NvmlCollector):
    fake.add_nvlink_traffic(0, 0, tx_bytes=3000)
    assert by_index(collector.poll())[0].nvlinks[0].tx_bytes_total == 2 * 1024  # KiB field: floor(3000/1024)
    fake.gpu(0).unsupported_fields = set()  # the byte counters start answering too
    assert by_index(collector.poll())[0].nvlinks[0].tx_bytes_total == 2 * 1024


def test_nvlink_traffic_absent_when_no_field_is_supported_and_not_asked_again(
    fake: FakeNvml, collector: NvmlCollector
):
    for i in range(2):
        fake.gpu(i).unsupported_fields |= {
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        }
    links = by_index(collector.poll())[0].nvlinks
    assert len(links) == 18 and all(li.tx_bytes_total is None and li.active for li in links)
    before = fake.calls["nvmlDeviceGetFieldValues"]
    collector.poll()
    assert fake.calls["nvmlDeviceGetFieldValues"] - before == 2  # the device batch only, per GPU


def test_gpu_without_nvlink_has_no_links_and_is_probed_once(fake: FakeNvml, collector: NvmlCollector):
    for i in range(2):
        fake.gpu(i).set_link_count(0)
    assert all(s.nvlinks == () for s in collector.poll())
    assert collector.report.success and collector.report.call_errors == ()
    before = fake.calls["nvmlDeviceGetNvLinkState"]
    collector.poll()
    assert fake.calls["nvmlDeviceGetNvLinkState"] == before


def test_links_are_probed_when_the_link_count_field_is_missing(fake: FakeNvml, collector: NvmlCollector):
    fake.gpu(0).unsupported_fields.add(pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT)
    assert len(by_index(collector.poll())[0].nvlinks) == 18


# ------------------------------------------------------------------------------------------------
# lost GPUs
# ------------------------------------------------------------------------------------------------


def test_lost_gpu_keeps_its_identity_and_skips_its_other_calls(fake: FakeNvml, collector: NvmlCollector):
    collector.poll()
    fake.set_lost(1)
    before = fake.calls["nvmlDeviceGetPowerUsage"]
    samples = by_index(collector.poll())
    lost = samples[1]
    assert lost.lost and lost.uuid == fake.gpu(1).uuid and lost.name == "NVIDIA H200"
    assert lost.memory_total_bytes is None and lost.nvlinks == () and lost.processes == ()
    assert fake.calls["nvmlDeviceGetPowerUsage"] - before == 1  # GPU 0 only
    assert not samples[0].lost and samples[0].power_watts is not None
    assert collector.report.success and collector.report.lost == (1,)  # lost is a metric, not a failure


def test_gpu_lost_in_the_middle_of_its_poll_reports_nothing_half_read(
    fake: FakeNvml, collector: NvmlCollector
):
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVMLError_GpuIsLost, gpu=0)
    s = by_index(collector.poll())[0]
    assert s.lost and s.memory_total_bytes is None  # memory was read before, but the GPU is gone


def test_gpu_lost_in_a_field_value_marks_it_lost(fake: FakeNvml, collector: NvmlCollector):
    fake.gpu(0).field_returns[pynvml.NVML_FI_DEV_MEMORY_TEMP] = pynvml.NVML_ERROR_GPU_IS_LOST
    assert by_index(collector.poll())[0].lost


def test_gpu_lost_before_start_is_reported_without_identity(clock: Clock):
    fake = FakeNvml(gpus=2)
    fake.set_lost(1)
    c = NvmlCollector(fake, now=clock)
    assert c.start()
    samples = by_index(c.poll())
    assert samples[1].lost and samples[1].uuid == "unknown"
    assert c.report.success


def test_gpu_that_answers_nothing_fails_the_collector(fake: FakeNvml, collector: NvmlCollector):
    fake.fail("nvmlDeviceGetUUID", pynvml.NVMLError_Unknown, gpu=1)
    samples = collector.poll()
    assert [s.index for s in samples] == [0]  # no sample without an identity
    assert not collector.report.success and collector.report.silent == (1,)
    assert "1" in collector.report.error


# ------------------------------------------------------------------------------------------------
# no NVML: one line, backoff, recovery
# ------------------------------------------------------------------------------------------------


def test_library_missing_gives_one_clear_line_and_retries_with_backoff(
    clock: Clock, caplog: pytest.LogCaptureFixture
):
    fake = FakeNvml(gpus=2, library_missing=True)
    c = NvmlCollector(fake, now=clock)
    with caplog.at_level(logging.DEBUG, logger="kvwatch.gpu.nvml"):
        assert c.start() is False
        assert c.poll() == []  # before the retry is due: NVML is not even asked
        assert fake.calls["nvmlInitWithFlags"] == 1
        tries = []
        for _ in range(8):  # keep failing: each wait doubles, up to the cap
            clock.now += 1000
            c.poll()
            tries.append(c._next_retry - clock.now)
        assert tries == [10, 20, 40, 80, 160, 300, 300, 300]
        assert fake.calls["nvmlInitWithFlags"] == 9
        fake.library_missing = False
        clock.now += 1000
        samples = c.poll()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "libnvidia-ml.so.1 not found" in warnings[0].getMessage()
    assert "Everything else keeps working" in warnings[0].getMessage()
    assert len(samples) == 2 and c.report.success and c.available


def test_unavailable_poll_reports_failure_and_no_samples(clock: Clock):
    c = NvmlCollector(FakeNvml(library_missing=True), now=clock)
    c.start()
    assert c.poll() == []
    assert not c.report.success and not c.report.available and "libnvidia-ml" in c.report.error


def test_host_without_gpus_is_unavailable(clock: Clock, caplog: pytest.LogCaptureFixture):
    fake = FakeNvml(gpus=0)
    with caplog.at_level(logging.WARNING, logger="kvwatch.gpu.nvml"):
        assert NvmlCollector(fake, now=clock).start() is False
    assert ["no GPU" in r.getMessage() for r in caplog.records] == [True]
    assert not fake.initialized  # the reference taken by nvmlInit was given back


def test_driver_going_away_mid_run_drops_samples_then_recovers(
    fake: FakeNvml, collector: NvmlCollector, clock: Clock
):
    assert len(collector.poll()) == 2
    fake.nvmlShutdown()  # as if the driver were unloaded: every call answers Uninitialized
    assert collector.poll() == []
    assert not collector.report.available and "stopped answering" in collector.report.error
    clock.now += 6.0  # past the first backoff (5 s)
    assert len(collector.poll()) == 2 and collector.report.success


def test_stop_gives_back_the_nvml_reference(fake: FakeNvml, collector: NvmlCollector):
    assert fake.initialized
    collector.stop()
    assert not fake.initialized


# ------------------------------------------------------------------------------------------------
# counters
# ------------------------------------------------------------------------------------------------

COUNTERS = (
    "pcie_tx_bytes_total",
    "pcie_rx_bytes_total",
    "pcie_replay_total",
    "energy_joules_total",
    "ecc_corrected_volatile_total",
    "ecc_uncorrected_volatile_total",
)


def test_counters_only_go_up_and_by_what_happened(fake: FakeNvml, collector: NvmlCollector):
    first = by_index(collector.poll())[0]
    fake.gpu(0).pcie_tx_bytes_per_s = 1e9
    fake.gpu(0).nvlink_bytes_per_s = 2**20
    fake.advance(2.0)  # 2 s at 74.58 W
    fake.add_ecc_errors(0, corrected=3)
    fake.add_pcie_replays(0, 1)
    second = by_index(collector.poll())[0]
    for name in COUNTERS:
        assert getattr(second, name) >= getattr(first, name), name
    assert second.pcie_tx_bytes_total - first.pcie_tx_bytes_total == 2e9
    assert second.energy_joules_total - first.energy_joules_total == pytest.approx(2 * 74.58)
    assert second.ecc_corrected_volatile_total - first.ecc_corrected_volatile_total == 3
    assert second.nvlinks[0].tx_bytes_total - first.nvlinks[0].tx_bytes_total == 2 * 2**20


def test_concurrent_polls_and_process_lists_are_consistent(fake: FakeNvml, collector: NvmlCollector):
    errors: list[BaseException] = []
    seen: list[list[float]] = [[] for _ in range(3)]

    def poller(k: int) -> None:
        try:
            for _ in range(15):
                seen[k].append(by_index(collector.poll())[0].pcie_tx_bytes_total)
                collector.process_gpus()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def traffic() -> None:
        for _ in range(200):
            fake.add_pcie_traffic(0, tx_bytes=10)

    threads = [threading.Thread(target=poller, args=(k,)) for k in range(3)]
    threads.append(threading.Thread(target=traffic))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for values in seen:
        assert values == sorted(values)  # each thread sees the counter only go up
