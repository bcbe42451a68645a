"""NVML source: turns NVML device queries into ``GpuSample`` records.

``nvml`` is the ``pynvml`` module of nvidia-ml-py (or ``gpu.fake.FakeNvml``). Every call is handled
on its own: NOT_SUPPORTED is normal (the field stays ``None``, one debug line per call), any other
error leaves the field ``None`` and is counted in the poll's ``PollReport``, and GPU_IS_LOST marks the
GPU lost and skips its remaining calls. A host without a driver gets one clear log line from
``start()`` and retries with backoff from ``poll()``; nothing else in the agent depends on NVML.
Units are converted here, once: mW -> W, mJ -> J, MHz -> Hz, percent -> ratio, KiB -> bytes.
docs/nvml.md lists every call.
"""

# ruff: noqa: N802  (NvmlLibrary spells pynvml's function names as pynvml does)
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvwatch.model import GpuProcess, GpuSample, NvLinkSample

log = logging.getLogger(__name__)


class NvmlLibrary(Protocol):
    """What kvwatch needs of an NVML binding: nvidia-ml-py's ``pynvml`` module, or ``gpu.fake.FakeNvml``.

    These are the calls made by attribute. The per-device reads go through ``_DeviceReader.call`` by
    name (docs/nvml.md lists them), and the constants and exception classes (``NVMLError``,
    ``NVMLError_NotSupported``, ``NVML_SUCCESS``, ...) are read by name too: ``FakeNvml`` copies them
    from the real ``pynvml``, so they cannot drift.
    """

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None: ...

    def nvmlSystemGetDriverVersion(self) -> str: ...

    def nvmlDeviceGetCount(self) -> int: ...

    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> Any: ...

    def nvmlDeviceGetUUID(self, handle: Any, /) -> str: ...

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any, /) -> int: ...

    def nvmlEventSetCreate(self) -> Any: ...

    def nvmlDeviceRegisterEvents(self, handle: Any, _event_types: int, _event_set: Any, /) -> None: ...

    def nvmlEventSetWait_v2(self, _event_set: Any, _timeout_ms: int, /) -> Any: ...

    def nvmlEventSetFree(self, _event_set: Any, /) -> None: ...


#: (label value, pynvml constant) of every clock-event (throttle) reason kvwatch exports.
CLOCK_EVENT_REASONS: tuple[tuple[str, str], ...] = (
    ("gpu_idle", "nvmlClocksEventReasonGpuIdle"),
    ("applications_clocks_setting", "nvmlClocksEventReasonApplicationsClocksSetting"),
    ("sw_power_cap", "nvmlClocksEventReasonSwPowerCap"),
    ("hw_slowdown", "nvmlClocksEventReasonHwSlowdown"),
    ("sync_boost", "nvmlClocksEventReasonSyncBoost"),
    ("sw_thermal_slowdown", "nvmlClocksEventReasonSwThermalSlowdown"),
    ("hw_thermal_slowdown", "nvmlClocksEventReasonHwThermalSlowdown"),
    ("hw_power_brake_slowdown", "nvmlClocksEventReasonHwPowerBrakeSlowdown"),
    ("display_clock_setting", "nvmlClocksEventReasonDisplayClockSetting"),
)

#: What to tell the operator when ``nvmlInit`` fails, by pynvml error class.
_INIT_HINTS = {
    "NVMLError_LibraryNotFound": "libnvidia-ml.so.1 not found: no NVIDIA driver on this host, or the "
    "container does not run with the NVIDIA runtime",
    "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded",
    "NVMLError_NoPermission": "no permission to open /dev/nvidia* (see docs/deploy.md#device-permissions)",
    "NVMLError_LibRmVersionMismatch": "libnvidia-ml and the kernel driver differ in version "
    "(driver upgraded without a reboot?)",
}
#: Errors after a good init that mean NVML itself went away: re-init with backoff.
_GONE = ("NVMLError_Uninitialized", "NVMLError_DriverNotLoaded", "NVMLError_LibRmVersionMismatch")

#: newer call -> (older call, keep keyword args) for drivers that lack the newer one. Memory info
#: is asked with ``version=nvmlMemory_v2`` (reserved split out); without it, v1.
_OLDER_CALL: dict[str, tuple[str, bool]] = {
    "nvmlDeviceGetMemoryInfo": ("nvmlDeviceGetMemoryInfo", False),
    "nvmlDeviceGetCurrentClocksEventReasons": ("nvmlDeviceGetCurrentClocksThrottleReasons", True),
    "nvmlDeviceGetComputeRunningProcesses": ("nvmlDeviceGetComputeRunningProcesses_v2", True),
}
_OLD_DRIVER_ERRORS = (
    "NVMLError_FunctionNotFound",
    "NVMLError_ArgumentVersionMismatch",
    "NVMLLibraryMismatchError",
)

RETRY_INITIAL_S = 5.0
RETRY_MAX_S = 300.0
_NVLINK_KIB = 1024


class _GpuLostError(Exception):
    """Internal: a call answered GPU_IS_LOST; stop querying this GPU for this poll."""


@dataclass(frozen=True, slots=True)
class PollReport:
    """What one poll went through, so the agent can report collector success honestly.

    ``success``: NVML is up and every GPU answered (identity plus at least one reading, or an
    explicit GPU_IS_LOST: a lost GPU is a metric, not a collector failure). ``call_errors`` are the
    unexpected per-call errors as ``(call, error)`` pairs, one per occurrence; NOT_SUPPORTED is not
    an error.
    """

    success: bool
    available: bool
    duration_s: float = 0.0
    gpus: int = 0
    lost: tuple[int, ...] = ()
    silent: tuple[int, ...] = ()  # GPUs that answered nothing
    call_errors: tuple[tuple[str, str], ...] = ()
    error: str | None = None


@dataclass(slots=True)
class _Identity:
    uuid: str
    name: str | None
    pci_bus_id: str | None


@dataclass(slots=True)
class _Device:
    """What the collector remembers about one GPU between polls (valid until NVML re-inits)."""

    index: int
    handle: Any = None
    identity: _Identity | None = None
    link_count: int | None = None  # None = not probed yet
    nvlink_fields: tuple[int, int, int] | None = None  # (tx field, rx field, bytes per unit)
    nvlink_fields_probed: bool = False


def error_name(exc: BaseException) -> str:
    """Short, bounded label value for an NVML error (``NotSupported``, ``NoPermission``, ...)."""
    name = type(exc).__name__
    if name == "NVMLError":
        return f"code_{getattr(exc, 'value', 'unknown')}"
    return name.removeprefix("NVMLError_")


def binding(nvml: NvmlLibrary | None) -> Any:
    """``nvml``, else nvidia-ml-py's ``pynvml`` (imported only then: a host without it can pass a fake).

    Typed ``Any``: the constants and ``NVMLError_*`` classes are read by name (``NvmlLibrary``).
    """
    if nvml is not None:
        return nvml
    import pynvml  # nvidia-ml-py's module

    return pynvml


class NvmlCollector:
    """Polls every GPU through NVML. ``poll()`` and ``process_gpus()`` may be called from worker
    threads; they serialize on one lock."""

    def __init__(
        self,
        nvml: NvmlLibrary | None = None,
        now: Callable[[], float] = time.time,
        retry_initial_s: float = RETRY_INITIAL_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        self.nvml = binding(nvml)
        self._now = now
        self._lock = threading.Lock()
        self._started = False
        self._devices: list[_Device] = []
        self._driver_version: str | None = None
        self._downgraded: set[str] = set()  # calls replaced by their older form (_OLDER_CALL)
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._retry_delay_s = retry_initial_s
        self._next_retry: float | None = None
        self._warned_reason: str | None = None
        self._unavailable_reason: str | None = "NVML not started"
        self._logged_unsupported: set[str] = set()
        self._logged_errors: set[tuple[str, str]] = set()
        self.report = PollReport(success=False, available=False, error="NVML not started")

    # ---------------------------------------------------------------------------------------------
    # lifecycle
    # ---------------------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._started

    def start(self) -> bool:
        """Initialize NVML and enumerate GPUs. False (one log line) when there is no driver or
        no GPU; ``poll()`` then retries with backoff."""
        with self._lock:
            return self._start()

    def stop(self) -> None:
        """Release NVML (reference counted: other users such as the event thread keep theirs)."""
        with self._lock:
            if self._started:
                self._started = False
                self._devices = []
                try:
                    self.nvml.nvmlShutdown()
                except self.nvml.NVMLError as exc:
                    log.debug("nvmlShutdown: %s", exc)

    def mig_parent(self, mig_uuid: str) -> str | None:
        """The UUID of the GPU a ``MIG-`` device belongs to, asked of NVML as dcgm-exporter does for
        drivers >= R470 (``nvmlDeviceGetHandleByUUID`` then
        ``nvmlDeviceGetDeviceHandleFromMigDeviceHandle``); None when NVML cannot say."""
        with self._lock:
            if not self._started:
                return None
            try:
                handle = self.nvml.nvmlDeviceGetHandleByUUID(mig_uuid)
                parent = self.nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
                return _text(self.nvml.nvmlDeviceGetUUID(parent))
            except Exception as exc:  # NVML or ctypes: the device stays unattributed, never the poll
                log.debug("MIG device %s: no parent GPU from NVML: %s", mig_uuid[:48], exc)
                return None

    def _start(self) -> bool:
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as exc:
            return self._unavailable(_INIT_HINTS.get(type(exc).__name__, f"nvmlInit failed: {exc}"))
        try:
            count = self.nvml.nvmlDeviceGetCount()
            driver = self.nvml.nvmlSystemGetDriverVersion()
        except self.nvml.NVMLError as exc:
            self._shutdown_quietly()
            return self._unavailable(f"NVML answered nvmlInit but not the device count ({exc})")
        if count == 0:
            self._shutdown_quietly()
            return self._unavailable("NVML sees no GPU on this host")
        self._devices = [_Device(i) for i in range(count)]
        self._driver_version = _text(driver)
        self._downgraded.clear()  # the driver may be another one now (upgraded while NVML was gone)
        self._started = True
        self._retry_delay_s = self._retry_initial_s
        self._next_retry = None
        self._warned_reason = None
        self._unavailable_reason = None
        log.info("NVML: %d GPU(s), driver %s", count, self._driver_version)
        return True

    def _unavailable(self, reason: str) -> bool:
        self._started = False
        self._devices = []
        self._unavailable_reason = reason
        self.report = PollReport(success=False, available=False, error=reason)
        now = self._now()
        self._next_retry = now + self._retry_delay_s
        if reason != self._warned_reason:
            log.warning(
                "GPU metrics off: %s. Everything else keeps working; retrying NVML every %.0f-%.0f s.",
                reason,
                self._retry_initial_s,
                self._retry_max_s,
            )
            self._warned_reason = reason
        else:
            log.debug("NVML still unavailable: %s (next try in %.0f s)", reason, self._retry_delay_s)
        self._retry_delay_s = min(self._retry_delay_s * 2, self._retry_max_s)
        return False

    def _shutdown_quietly(self) -> None:
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()

    def driver_version(self) -> str | None:
        return self._driver_version

    # ---------------------------------------------------------------------------------------------
    # polling
    # ---------------------------------------------------------------------------------------------

    def poll(self) -> list[GpuSample]:
        """One sample per GPU; ``[]`` while NVML is unavailable. ``self.report`` describes it."""
        started = time.perf_counter()
        with self._lock:
            if not self._started and not self._retry_due():
                self.report = PollReport(success=False, available=False, error=self._unavailable_reason)
                return []
            if not self._started and not self._start():
                self.report = PollReport(
                    success=False,
                    available=False,
                    error=self._unavailable_reason,
                    duration_s=time.perf_counter() - started,
                )
                return []
            samples, errors, lost, silent = [], [], [], []
            for dev in self._devices:
                sample, answered, dev_errors = self._poll_device(dev)
                errors += dev_errors
                if sample is not None:
                    samples.append(sample)
                if sample is not None and sample.lost:
                    lost.append(dev.index)
                elif not answered:
                    silent.append(dev.index)
            gone = [err for _, err in errors if f"NVMLError_{err}" in _GONE]
            if gone:
                self._shutdown_quietly()
                self._unavailable(f"NVML stopped answering ({gone[0]})")
                samples = []
            self.report = _report(samples, errors, lost, silent, gone, time.perf_counter() - started)
            return samples

    def _retry_due(self) -> bool:
        return self._next_retry is None or self._now() >= self._next_retry

    def _poll_device(self, dev: _Device) -> tuple[GpuSample | None, bool, list[tuple[str, str]]]:
        """(sample, answered, errors). No sample for a GPU whose identity NVML never gave."""
        reader = _DeviceReader(self, dev)
        try:
            ident = reader.identify()
            if ident is None:
                return None, False, reader.errors
            values = reader.readings()
        except _GpuLostError:
            return self._blank(dev, lost=True), True, reader.errors
        sample = GpuSample(
            index=dev.index,
            uuid=ident.uuid,
            name=ident.name,
            pci_bus_id=ident.pci_bus_id,
            sampled_at=self._now(),
            **values,
        )
        return sample, reader.answered > 0, reader.errors

    def _blank(self, dev: _Device, lost: bool) -> GpuSample:
        ident = dev.identity or _Identity("unknown", None, None)
        return GpuSample(
            index=dev.index,
            uuid=ident.uuid,
            name=ident.name,
            pci_bus_id=ident.pci_bus_id,
            sampled_at=self._now(),
            lost=lost,
        )

    # ---------------------------------------------------------------------------------------------
    # processes
    # ---------------------------------------------------------------------------------------------

    def process_gpus(self) -> dict[int, list[str]]:
        """PID (as NVML reports it: host or namespaced, see docs/nvml.md) -> GPU UUIDs it runs on."""
        with self._lock:
            out: dict[int, list[str]] = {}
            if not self._started:
                return out
            for dev in self._devices:
                reader = _DeviceReader(self, dev)
                try:
                    ident = reader.identify()
                    if ident is None:
                        continue
                    procs = reader.processes()
                except _GpuLostError:
                    continue
                for proc in procs:
                    out.setdefault(proc.pid, []).append(ident.uuid)
            return out

    # ---------------------------------------------------------------------------------------------
    # logging helpers (once per call name, so eight GPUs do not log eight lines)
    # ---------------------------------------------------------------------------------------------

    def _note_unsupported(self, call: str) -> None:
        if call not in self._logged_unsupported:
            self._logged_unsupported.add(call)
            log.debug("NVML %s: not supported on this GPU/driver; its metric is left out", call)

    def _downgrade(self, call: str) -> None:
        self._downgraded.add(call)
        log.info("NVML: this driver lacks the current form of %s; using %s", call, _OLDER_CALL[call][0])

    def _note_error(self, call: str, exc: BaseException) -> str:
        name = error_name(exc)
        if type(exc).__name__ in _GONE:  # the driver went away: poll() says so once for all calls
            log.debug("NVML %s: %s", call, name)
            return name
        if (call, name) not in self._logged_errors:
            self._logged_errors.add((call, name))
            log.warning(
                "NVML %s failed: %s (%s); that value is left out and counted in "
                "kvwatch_gpu_nvml_errors_total",
                call,
                exc,
                name,
                exc_info=not isinstance(exc, self.nvml.NVMLError),
            )
        return name


def _report(
    samples: list[GpuSample],
    errors: list[tuple[str, str]],
    lost: list[int],
    silent: list[int],
    gone: list[str],
    duration_s: float,
) -> PollReport:
    if gone:
        return PollReport(
            success=False,
            available=False,
            duration_s=duration_s,
            call_errors=tuple(errors),
            error=f"NVML stopped answering ({gone[0]})",
        )
    error = None
    if silent:
        error = f"GPU(s) {', '.join(map(str, silent))} answered no NVML call"
    return PollReport(
        success=not silent,
        available=True,
        duration_s=duration_s,
        gpus=len(samples),
        lost=tuple(lost),
        silent=tuple(silent),
        call_errors=tuple(errors),
        error=error,
    )


def _old_driver(exc: BaseException) -> bool:
    return type(exc).__name__ in _OLD_DRIVER_ERRORS


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _DeviceReader:
    """All NVML reads of one GPU in one poll."""

    def __init__(self, collector: NvmlCollector, dev: _Device) -> None:
        self.c = collector
        self.nvml = collector.nvml
        self.dev = dev
        self.errors: list[tuple[str, str]] = []
        self.answered = 0

    def call(self, name: str, *args: Any, handle: bool = True, **kwargs: Any) -> Any:
        """One NVML call; ``None`` when unsupported or failed. Raises ``_GpuLostError``.

        A call listed in ``_OLDER_CALL`` that the driver lacks is replaced by its older form, once
        and for all (until NVML re-initializes).
        """
        if name in self.c._downgraded:
            name, keep_kwargs = _OLDER_CALL[name]
            kwargs = kwargs if keep_kwargs else {}
        try:
            fn = getattr(self.nvml, name)
            result = fn(self.dev.handle, *args, **kwargs) if handle else fn(*args, **kwargs)
        except self.nvml.NVMLError_NotSupported:
            self.c._note_unsupported(name)
            return None
        except self.nvml.NVMLError_GpuIsLost:
            raise _GpuLostError from None
        except Exception as exc:  # any error (NVML or a ctypes surprise) costs one value, never the poll
            if name in _OLDER_CALL and name not in self.c._downgraded and _old_driver(exc):
                self.c._downgrade(name)
                return self.call(name, *args, handle=handle, **kwargs)
            self.errors.append((name, self.c._note_error(name, exc)))
            return None
        self.answered += 1
        return result

    # -- identity ------------------------------------------------------------------------------
    def identify(self) -> _Identity | None:
        """Handle and identity, asked until every part answered (or is not supported) and then
        remembered; None while NVML does not give the UUID. A part that failed once is asked again
        next poll, not left blank in ``kvwatch_gpu_info`` until NVML re-initializes."""
        dev = self.dev
        if dev.handle is None:
            dev.handle = self.call("nvmlDeviceGetHandleByIndex", dev.index, handle=False)
        if dev.handle is None:
            return None
        if dev.identity is not None:
            return dev.identity
        failed_before = len(self.errors)
        identity = self.identity()
        if len(self.errors) == failed_before:
            dev.identity = identity
        return identity

    def identity(self) -> _Identity | None:
        uuid = self.call("nvmlDeviceGetUUID")
        if uuid is None:
            return None
        name = self.call("nvmlDeviceGetName")
        pci = self.call("nvmlDeviceGetPciInfo_v3")
        bus_id = _text(pci.busId) if pci is not None else None
        return _Identity(_text(uuid), _text(name) if name is not None else None, bus_id)

    # -- everything else ---------------------------------------------------------------------------
    def readings(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        values.update(self.memory())
        values.update(self.utilization())
        values.update(self.device_fields())
        values.update(self.pcie_link())
        values["nvlinks"] = self.nvlinks(values.pop("_link_count"))
        values.update(self.power())
        values.update(self.clocks())
        values.update(self.ecc())
        values["processes"] = tuple(self.processes())
        return values

    def memory(self) -> dict[str, float | None]:
        mem = self.call("nvmlDeviceGetMemoryInfo", version=self.nvml.nvmlMemory_v2)
        if mem is None:
            return {}
        # v1 (older drivers) has no "reserved": its "used" includes what the driver sets aside
        return {
            "memory_total_bytes": float(mem.total),
            "memory_used_bytes": float(mem.used),
            "memory_reserved_bytes": _float(getattr(mem, "reserved", None)),
            "memory_free_bytes": float(mem.free),
        }

    def utilization(self) -> dict[str, float]:
        util = self.call("nvmlDeviceGetUtilizationRates")
        if util is None:
            return {}
        return {"utilization_gpu_ratio": util.gpu / 100.0, "utilization_memory_ratio": util.memory / 100.0}

    def device_fields(self) -> dict[str, Any]:
        n = self.nvml
        ids = [
            n.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
            n.NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
            n.NVML_FI_DEV_MEMORY_TEMP,
            n.NVML_FI_DEV_NVLINK_LINK_COUNT,
        ]
        got, _ = self.fields(ids)
        tx, rx, mem_temp, links = (got.get(i) for i in ids)
        return {
            "pcie_tx_bytes_total": tx,
            "pcie_rx_bytes_total": rx,
            "temperature_memory_celsius": mem_temp,
            "_link_count": None if links is None else int(links),
        }

    def fields(self, ids: list[Any]) -> tuple[dict[Any, float], bool]:
        """``nvmlDeviceGetFieldValues`` with each field's own status checked.

        Returns requested id (or ``(id, scope)``) -> value, and whether every field was NOT_SUPPORTED.
        """
        result = self.call("nvmlDeviceGetFieldValues", ids)
        if result is None:
            return {}, False
        out: dict[Any, float] = {}
        unsupported = 0
        for requested, fv in zip(ids, result, strict=False):
            label = f"nvmlDeviceGetFieldValues:{fv.fieldId}"
            if fv.nvmlReturn == self.nvml.NVML_SUCCESS:
                out[requested] = _field_value(self.nvml, fv)
            elif fv.nvmlReturn == self.nvml.NVML_ERROR_NOT_SUPPORTED:
                unsupported += 1
                self.c._note_unsupported(label)
            elif fv.nvmlReturn == self.nvml.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLostError
            else:
                self.errors.append((label, self.c._note_error(label, self.nvml.NVMLError(fv.nvmlReturn))))
        return out, unsupported == len(ids)

    def pcie_link(self) -> dict[str, Any]:
        return {
            "pcie_replay_total": _float(self.call("nvmlDeviceGetPcieReplayCounter")),
            "pcie_link_gen_current": self.call("nvmlDeviceGetCurrPcieLinkGeneration"),
            "pcie_link_gen_max": self.call("nvmlDeviceGetMaxPcieLinkGeneration"),
            "pcie_link_width_current": self.call("nvmlDeviceGetCurrPcieLinkWidth"),
            "pcie_link_width_max": self.call("nvmlDeviceGetMaxPcieLinkWidth"),
        }

    # -- NVLink ------------------------------------------------------------------------------------
    def nvlinks(self, link_count_field: int | None) -> tuple[NvLinkSample, ...]:
        dev = self.dev
        if dev.link_count is None:
            dev.link_count = link_count_field if link_count_field is not None else self._probe_links()
        if dev.link_count == 0:
            return ()
        links = range(dev.link_count)
        states = [self.call("nvmlDeviceGetNvLinkState", link) for link in links]
        tx, rx = self._nvlink_traffic(links)
        return tuple(
            NvLinkSample(
                link=link,
                active=None if state is None else bool(state),
                tx_bytes_total=tx.get(link),
                rx_bytes_total=rx.get(link),
            )
            for link, state in zip(links, states, strict=True)
        )

    def _probe_links(self) -> int:
        """Links answering nvmlDeviceGetNvLinkState, for drivers without the link-count field."""
        for link in range(self.nvml.NVML_NVLINK_MAX_LINKS):
            try:
                self.nvml.nvmlDeviceGetNvLinkState(self.dev.handle, link)
            except self.nvml.NVMLError_GpuIsLost:
                raise _GpuLostError from None
            except self.nvml.NVMLError:
                return link
        return self.nvml.NVML_NVLINK_MAX_LINKS

    def _nvlink_traffic(self, links: range) -> tuple[dict[int, float], dict[int, float]]:
        """Per-link data bytes: THROUGHPUT_DATA (KiB) first, the newer byte counters where only
        those answer. The choice is made once per GPU so a counter never switches source."""
        n, dev = self.nvml, self.dev
        if not dev.nvlink_fields_probed:
            all_unsupported = True
            for fields in (
                (
                    n.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                    n.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
                    _NVLINK_KIB,
                ),
                (n.NVML_FI_DEV_NVLINK_COUNT_XMIT_BYTES, n.NVML_FI_DEV_NVLINK_COUNT_RCV_BYTES, 1),
            ):
                tx, rx, unsupported = self._link_fields(fields, links)
                if tx or rx:
                    dev.nvlink_fields, dev.nvlink_fields_probed = fields, True
                    return tx, rx
                all_unsupported = all_unsupported and unsupported
            dev.nvlink_fields_probed = all_unsupported  # errors: try again next poll
            return {}, {}
        if dev.nvlink_fields is None:
            return {}, {}
        tx, rx, _ = self._link_fields(dev.nvlink_fields, links)
        return tx, rx

    def _link_fields(
        self, fields: tuple[int, int, int], links: range
    ) -> tuple[dict[int, float], dict[int, float], bool]:
        tx_id, rx_id, unit = fields
        got, unsupported = self.fields([(fid, link) for link in links for fid in (tx_id, rx_id)])
        tx = {link: got[(tx_id, link)] * unit for link in links if (tx_id, link) in got}
        rx = {link: got[(rx_id, link)] * unit for link in links if (rx_id, link) in got}
        return tx, rx, unsupported

    # -- power, thermal, clocks ---------------------------------------------------------------------
    def power(self) -> dict[str, float | None]:
        n = self.nvml
        return {
            "power_watts": _scaled(self.call("nvmlDeviceGetPowerUsage"), 1e-3),
            "power_limit_watts": _scaled(self.call("nvmlDeviceGetEnforcedPowerLimit"), 1e-3),
            "energy_joules_total": _scaled(self.call("nvmlDeviceGetTotalEnergyConsumption"), 1e-3),
            "temperature_gpu_celsius": _float(self.call("nvmlDeviceGetTemperature", n.NVML_TEMPERATURE_GPU)),
        }

    def clocks(self) -> dict[str, Any]:
        n = self.nvml
        out: dict[str, Any] = {
            "sm_clock_hz": _scaled(self.call("nvmlDeviceGetClockInfo", n.NVML_CLOCK_SM), 1e6),
            "memory_clock_hz": _scaled(self.call("nvmlDeviceGetClockInfo", n.NVML_CLOCK_MEM), 1e6),
        }
        mask = self.call("nvmlDeviceGetCurrentClocksEventReasons")
        if mask is not None:
            out["clock_event_reasons"] = tuple(
                (reason, bool(mask & getattr(n, const))) for reason, const in CLOCK_EVENT_REASONS
            )
        return out

    # -- health --------------------------------------------------------------------------------------
    def ecc(self) -> dict[str, Any]:
        n = self.nvml
        out: dict[str, Any] = {
            "ecc_corrected_volatile_total": _float(
                self.call(
                    "nvmlDeviceGetTotalEccErrors", n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC
                )
            ),
            "ecc_uncorrected_volatile_total": _float(
                self.call(
                    "nvmlDeviceGetTotalEccErrors", n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
                )
            ),
        }
        rows = self.call("nvmlDeviceGetRemappedRows")
        if rows is not None:
            correctable, uncorrectable, pending, failure = rows
            out.update(
                remapped_rows_correctable=float(correctable),
                remapped_rows_uncorrectable=float(uncorrectable),
                remap_pending=bool(pending),
                remap_failure=bool(failure),
            )
        return out

    def processes(self) -> list[GpuProcess]:
        procs = self.call("nvmlDeviceGetComputeRunningProcesses")
        if procs is None:
            return []
        out = []
        for proc in procs:
            used = getattr(proc, "usedGpuMemory", None)
            out.append(GpuProcess(pid=int(proc.pid), used_memory_bytes=_float(used)))
        return out


def _field_value(nvml: Any, fv: Any) -> float:
    member = {
        nvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        nvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
    }.get(fv.valueType, "ullVal")
    return float(getattr(fv.value, member))


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _scaled(value: Any, factor: float) -> float | None:
    return None if value is None else float(value) * factor
