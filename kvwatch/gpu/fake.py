"""A fake NVML backend for tests and ``kvwatch demo``: a module-like object with pynvml's names.

``FakeNvml`` answers the same functions the collector calls on the real ``pynvml`` module
(nvidia-ml-py), returns the same ctypes structures (``c_nvmlMemory_v2_t``, ``c_nvmlFieldValue_t``
arrays with a per-field ``nvmlReturn``, ``c_nvmlEventData_t`` whose ``device`` is a
``c_nvmlDevice_t``) and raises the real ``pynvml.NVMLError_*`` classes, so code that works here
works against a driver. Semantics kept from NVML:

* every call before ``nvmlInit`` (or after the last ``nvmlShutdown``; init is reference counted)
  raises ``NVMLError_Uninitialized``; ``library_missing`` makes ``nvmlInit`` raise
  ``NVMLError_LibraryNotFound`` as it does on a host without ``libnvidia-ml.so.1``;
* a lost GPU answers ``NVMLError_GpuIsLost`` to every device call, handle lookup included;
* memory v2 splits ``reserved`` out of ``used`` (total = used + reserved + free); v1 ``used``
  includes the reserved part;
* cumulative counters (PCIe bytes, NVLink KiB, energy mJ, ECC, replays, remapped rows) only go up:
  the control API refuses to lower them;
* events reach an event set only for GPUs and event types registered on it; registering a type the
  GPU does not support fails the whole registration with ``NVMLError_NotSupported``.

Defaults model one HGX H200 GPU as a public ``nvidia-smi -a`` capture (driver 550.90.12) shows it:
"NVIDIA H200", 143771 MiB total with 700 MiB reserved, PCIe Gen5 x16, 700 W limit, ~74.6 W and
345 MHz SM / 3199 MHz memory clock when idle, 28 C GPU / 25 C HBM, "Idle" clock event active. It has
18 NVLink 4 links (H200 SXM spec). Field support is an assumption until ``bench/nvml_smoke.py`` runs
on a real H200: PCIe byte counters (197/198), HBM temperature (82), link count (91) and per-link
THROUGHPUT_DATA (138/139) answer; the newer NVLink byte counters (202/204) are NOT_SUPPORTED.
"""

# The NVML API below keeps pynvml's camelCase names and argument names on purpose.
# ruff: noqa: N802, N803

from __future__ import annotations

import ctypes
import functools
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

MIB = 1024 * 1024

# Names of pynvml constants and classes the fake re-exports with the real module's values, so a
# constant can never drift from the driver's.
_REEXPORTED = (
    "NVMLError",
    "NVMLLibraryMismatchError",
    "NVML_SUCCESS",
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_INVALID_ARGUMENT",
    "NVML_VALUE_TYPE_DOUBLE",
    "NVML_VALUE_TYPE_UNSIGNED_INT",
    "NVML_VALUE_TYPE_UNSIGNED_LONG",
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG",
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG",
    "NVML_VALUE_TYPE_SIGNED_INT",
    "NVML_VALUE_TYPE_UNSIGNED_SHORT",
    "nvmlMemory_v2",
    "NVML_TEMPERATURE_GPU",
    "NVML_CLOCK_SM",
    "NVML_CLOCK_MEM",
    "NVML_MEMORY_ERROR_TYPE_CORRECTED",
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
    "NVML_VOLATILE_ECC",
    "NVML_NVLINK_MAX_LINKS",
    "NVML_FI_DEV_PCIE_COUNT_TX_BYTES",
    "NVML_FI_DEV_PCIE_COUNT_RX_BYTES",
    "NVML_FI_DEV_MEMORY_TEMP",
    "NVML_FI_DEV_NVLINK_LINK_COUNT",
    "NVML_FI_DEV_PCIE_REPLAY_COUNTER",
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
    "NVML_FI_DEV_NVLINK_COUNT_XMIT_BYTES",
    "NVML_FI_DEV_NVLINK_COUNT_RCV_BYTES",
    "nvmlClocksEventReasonGpuIdle",
    "nvmlClocksEventReasonApplicationsClocksSetting",
    "nvmlClocksEventReasonSwPowerCap",
    "nvmlClocksEventReasonHwSlowdown",
    "nvmlClocksEventReasonSyncBoost",
    "nvmlClocksEventReasonSwThermalSlowdown",
    "nvmlClocksEventReasonHwThermalSlowdown",
    "nvmlClocksEventReasonHwPowerBrakeSlowdown",
    "nvmlClocksEventReasonDisplayClockSetting",
    "nvmlEventTypeSingleBitEccError",
    "nvmlEventTypeDoubleBitEccError",
    "nvmlEventTypePState",
    "nvmlEventTypeXidCriticalError",
    "nvmlEventTypeClock",
    "nvmlEventTypeGpuUnavailableError",
    "nvmlEventTypeGpuRecoveryAction",
)

#: HGX H200 bus ids (a typical 8-GPU board); more GPUs get synthetic ids.
_H200_BUS_IDS = ("19", "3B", "4C", "5D", "9B", "BB", "CB", "DB")
_NOT_AVAILABLE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId outside MIG

# field id -> (value type, reader of a FakeGpu); scoped NVLink fields are handled separately.
_DEVICE_FIELDS: dict[int, tuple[int, Callable[[FakeGpu], int]]] = {
    pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: (
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
        lambda g: g.pcie_tx_bytes,
    ),
    pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: (
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
        lambda g: g.pcie_rx_bytes,
    ),
    pynvml.NVML_FI_DEV_MEMORY_TEMP: (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, lambda g: g.memory_temperature_c),
    pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT: (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, lambda g: g.nvlink_links),
    pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER: (
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
        lambda g: g.pcie_replays,
    ),
}
_LINK_FIELDS = {
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: ("tx", 1024),  # KiB
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: ("rx", 1024),
    pynvml.NVML_FI_DEV_NVLINK_COUNT_XMIT_BYTES: ("tx", 1),  # bytes
    pynvml.NVML_FI_DEV_NVLINK_COUNT_RCV_BYTES: ("rx", 1),
}
_VALUE_MEMBER = {
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
}
_H200_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypePState
    | pynvml.nvmlEventTypeClock
)


def _uuid_for(index: int, prefix: str = "GPU", salt: str = "") -> str:
    digest = hashlib.sha256(f"kvwatch-fake-gpu-{index}{salt}".encode()).hexdigest()
    return f"{prefix}-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


@dataclass
class FakeGpu:
    """Mutable state of one fake GPU. Plain attributes may be set by tests; counters go through
    ``FakeNvml`` methods that refuse to lower them."""

    index: int
    uuid: str
    name: str = "NVIDIA H200"
    pci_bus_id: str = ""
    lost: bool = False

    memory_total_bytes: int = 143_771 * MIB
    memory_reserved_bytes: int = 700 * MIB
    memory_used_bytes: int = 1 * MIB
    utilization_gpu: int = 0  # percent
    utilization_memory: int = 0

    pcie_gen: int = 5
    pcie_gen_max: int = 5
    pcie_width: int = 16
    pcie_width_max: int = 16
    pcie_tx_bytes: int = 0
    pcie_rx_bytes: int = 0
    pcie_replays: int = 0

    nvlink_links: int = 18
    nvlink_active: list[bool] = field(default_factory=list)
    nvlink_tx_bytes: list[int] = field(default_factory=list)
    nvlink_rx_bytes: list[int] = field(default_factory=list)

    power_mw: int = 74_580
    power_limit_mw: int = 700_000
    energy_mj: int = 0
    temperature_c: int = 28
    memory_temperature_c: int = 25
    sm_clock_mhz: int = 345
    memory_clock_mhz: int = 3199
    clock_event_reasons: int = pynvml.nvmlClocksEventReasonGpuIdle

    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failure: bool = False

    processes: dict[int, int | None] = field(default_factory=dict)  # pid as NVML reports it -> bytes
    supported_events: int = _H200_EVENTS
    unsupported_fields: set[int] = field(
        default_factory=lambda: {
            pynvml.NVML_FI_DEV_NVLINK_COUNT_XMIT_BYTES,
            pynvml.NVML_FI_DEV_NVLINK_COUNT_RCV_BYTES,
        }
    )
    field_returns: dict[int, int] = field(default_factory=dict)  # field id -> forced nvmlReturn code
    memory_v2: bool = True  # False: a driver without nvmlDeviceGetMemoryInfo_v2

    # rates for ``FakeNvml.advance`` (bytes per second per direction)
    pcie_tx_bytes_per_s: float = 0.0
    pcie_rx_bytes_per_s: float = 0.0
    nvlink_bytes_per_s: float = 0.0  # per link, per direction, on active links

    def __post_init__(self) -> None:
        if not self.pci_bus_id:
            bus = _H200_BUS_IDS[self.index] if self.index < len(_H200_BUS_IDS) else f"{0xE0 + self.index:02X}"
            self.pci_bus_id = f"00000000:{bus}:00.0"
        self.set_link_count(self.nvlink_links)

    def set_link_count(self, links: int) -> None:
        self.nvlink_links = links
        self.nvlink_active = [True] * links
        self.nvlink_tx_bytes = [0] * links
        self.nvlink_rx_bytes = [0] * links

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            name == "memory_used_bytes"
            and hasattr(self, "memory_reserved_bytes")
            and not 0 <= value <= self.memory_total_bytes - self.memory_reserved_bytes
        ):
            raise ValueError(
                f"GPU {self.index}: used memory must be within 0..total - reserved "
                f"({self.memory_total_bytes - self.memory_reserved_bytes}), got {value}"
            )
        super().__setattr__(name, value)

    @property
    def memory_free_bytes(self) -> int:
        return self.memory_total_bytes - self.memory_reserved_bytes - self.memory_used_bytes


class _EventSet:
    """What ``nvmlEventSetCreate`` hands out: registrations and a queue of pending events."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # gpu index -> event type mask
        self.pending: list[tuple[int, int, int]] = []  # (gpu index, event type, event data)
        self.freed = False


@dataclass
class _Failure:
    error_cls: type[Exception]
    gpu: int | None
    times: int | None  # None = until cleared


#: names of the FakeNvml methods marked with @_api (the NVML functions it answers)
_API_NAMES: set[str] = set()


def _api(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an NVML function of the fake: lock, init check, injected failures."""
    _API_NAMES.add(fn.__name__)

    @functools.wraps(fn)
    def call(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls[fn.__name__] += 1
            if fn.__name__ not in ("nvmlInit", "nvmlInitWithFlags") and self._refcount == 0:
                raise pynvml.NVMLError_Uninitialized()
            self._maybe_fail(fn.__name__, args[0] if args else None)
            return fn(self, *args, **kwargs)

    return call


class FakeNvml:
    """NVML for ``gpus`` fake GPUs; pass it where the ``pynvml`` module would go. Thread-safe."""

    def __init__(
        self, gpus: int = 8, *, driver_version: str = "550.90.12", library_missing: bool = False
    ) -> None:
        for name in _REEXPORTED:
            setattr(self, name, getattr(pynvml, name))
        for name in dir(pynvml):
            if name.startswith("NVMLError_"):
                setattr(self, name, getattr(pynvml, name))
        self._lock = threading.RLock()
        self._events = threading.Condition(self._lock)
        self._refcount = 0
        self._gpus = [FakeGpu(i, _uuid_for(i)) for i in range(gpus)]
        self._handles = [
            ctypes.cast(ctypes.c_void_p(0x7F00_0000 + 0x1000 * i), pynvml.c_nvmlDevice_t) for i in range(gpus)
        ]
        #: MIG device handle address -> (parent GPU index, MIG UUID), from ``add_mig_device``
        self._mig: dict[int, tuple[int, str]] = {}
        self._failures: dict[str, list[_Failure]] = {}
        self._event_sets: list[_EventSet] = []
        self.driver_version = driver_version
        self.library_missing = library_missing
        self.calls: dict[str, int] = dict.fromkeys(self.api_names(), 0)

    # ---------------------------------------------------------------------------------------------
    # control API (tests, demo)
    # ---------------------------------------------------------------------------------------------

    @classmethod
    def api_names(cls) -> tuple[str, ...]:
        """The NVML function names this fake answers (each exists in pynvml: a test checks)."""
        return tuple(sorted(_API_NAMES))

    @property
    def initialized(self) -> bool:
        return self._refcount > 0

    def gpu(self, index: int) -> FakeGpu:
        return self._gpus[index]

    def fail(
        self, call_name: str, error_cls: type[Exception], gpu: int | None = None, times: int | None = None
    ) -> None:
        """Make ``call_name`` raise ``error_cls`` (on one GPU's handle, or for every call), ``times``
        times or until ``clear_failures``. ``error_cls``: a ``pynvml.NVMLError_*`` class, or
        ``pynvml.NVMLLibraryMismatchError`` (what pynvml's unversioned calls raise on old drivers)."""
        if call_name not in self.calls:
            raise ValueError(f"FakeNvml has no NVML call {call_name!r} (known: {', '.join(self.calls)})")
        if not (
            isinstance(error_cls, type)
            and issubclass(error_cls, pynvml.NVMLError | pynvml.NVMLLibraryMismatchError)
        ):
            raise TypeError("error_cls must be a pynvml.NVMLError_* class or NVMLLibraryMismatchError")
        with self._lock:
            self._failures.setdefault(call_name, []).append(_Failure(error_cls, gpu, times))

    def unsupported(self, call_name: str, gpu: int | None = None) -> None:
        """Make ``call_name`` answer NOT_SUPPORTED, as NVML does for a feature a GPU lacks."""
        self.fail(call_name, pynvml.NVMLError_NotSupported, gpu)

    def clear_failures(self) -> None:
        with self._lock:
            self._failures.clear()

    def add_mig_device(self, index: int) -> str:
        """Carve a MIG device out of GPU ``index``; its UUID (``MIG-<uuid>``, drivers >= R470)."""
        with self._lock:
            slot = sum(1 for parent, _ in self._mig.values() if parent == index)
            uuid = _uuid_for(index, "MIG", f"/mig{slot}")
            self._mig[0x7E00_0000 + 0x1000 * index + 0x10 * (slot + 1)] = (index, uuid)
            return uuid

    def _mig_device(self, handle: Any) -> tuple[int, str] | None:
        try:
            address = ctypes.cast(handle, ctypes.c_void_p).value
        except (ctypes.ArgumentError, TypeError):
            return None
        return self._mig.get(address or 0)

    def set_lost(self, index: int, lost: bool = True) -> None:
        with self._lock:
            self._gpus[index].lost = lost

    def set_link(self, index: int, gen: int, width: int) -> None:
        g = self._gpus[index]
        if not (1 <= gen <= g.pcie_gen_max and 1 <= width <= g.pcie_width_max):
            raise ValueError(
                f"link Gen{gen} x{width} exceeds GPU {index}'s max Gen{g.pcie_gen_max} x{g.pcie_width_max}"
            )
        with self._lock:
            g.pcie_gen, g.pcie_width = gen, width

    def set_throttle(self, index: int, reasons: int) -> None:
        """Set the clock-event reason bitmask (``pynvml.nvmlClocksEventReason*`` OR-ed)."""
        with self._lock:
            self._gpus[index].clock_event_reasons = int(reasons)

    def add_pcie_traffic(self, index: int, tx_bytes: int = 0, rx_bytes: int = 0) -> None:
        _non_negative(tx_bytes=tx_bytes, rx_bytes=rx_bytes)
        with self._lock:
            g = self._gpus[index]
            g.pcie_tx_bytes += int(tx_bytes)
            g.pcie_rx_bytes += int(rx_bytes)

    def add_pcie_replays(self, index: int, count: int = 1) -> None:
        _non_negative(count=count)
        with self._lock:
            self._gpus[index].pcie_replays += int(count)

    def add_nvlink_traffic(self, index: int, link: int, tx_bytes: int = 0, rx_bytes: int = 0) -> None:
        _non_negative(tx_bytes=tx_bytes, rx_bytes=rx_bytes)
        with self._lock:
            g = self._gpus[index]
            g.nvlink_tx_bytes[link] += int(tx_bytes)
            g.nvlink_rx_bytes[link] += int(rx_bytes)

    def set_nvlink_active(self, index: int, link: int, active: bool) -> None:
        with self._lock:
            self._gpus[index].nvlink_active[link] = bool(active)

    def add_energy(self, index: int, millijoules: int) -> None:
        _non_negative(millijoules=millijoules)
        with self._lock:
            self._gpus[index].energy_mj += int(millijoules)

    def add_ecc_errors(self, index: int, corrected: int = 0, uncorrected: int = 0) -> None:
        _non_negative(corrected=corrected, uncorrected=uncorrected)
        with self._lock:
            g = self._gpus[index]
            g.ecc_corrected += int(corrected)
            g.ecc_uncorrected += int(uncorrected)

    def set_remapped_rows(
        self,
        index: int,
        correctable: int | None = None,
        uncorrectable: int | None = None,
        pending: bool | None = None,
        failure: bool | None = None,
    ) -> None:
        with self._lock:
            g = self._gpus[index]
            if correctable is not None:
                _not_lower("correctable remapped rows", g.remapped_correctable, correctable)
                g.remapped_correctable = correctable
            if uncorrectable is not None:
                _not_lower("uncorrectable remapped rows", g.remapped_uncorrectable, uncorrectable)
                g.remapped_uncorrectable = uncorrectable
            if pending is not None:
                g.remap_pending = pending
            if failure is not None:
                g.remap_failure = failure

    def add_process(self, index: int, pid: int, used_bytes: int | None) -> None:
        """A compute process on GPU ``index``, with ``pid`` as NVML should report it (host or
        namespaced, the test decides). Its memory counts into the GPU's used memory, as in NVML;
        ``used_bytes=None`` models NVML_VALUE_NOT_AVAILABLE."""
        with self._lock:
            g = self._gpus[index]
            old = g.processes.get(pid) or 0
            extra = (used_bytes or 0) - old
            if extra > g.memory_free_bytes:
                raise ValueError(f"GPU {index} has {g.memory_free_bytes} bytes free, process needs {extra}")
            g.processes[pid] = used_bytes
            g.memory_used_bytes += extra

    def inject_xid(self, index: int, xid: int) -> None:
        """An XID critical error on GPU ``index``, delivered through ``nvmlEventSetWait_v2``."""
        self.inject_event(index, pynvml.nvmlEventTypeXidCriticalError, xid)

    def inject_event(self, index: int, event_type: int, data: int = 0) -> None:
        with self._lock:
            for es in self._event_sets:
                if not es.freed and es.registered.get(index, 0) & event_type:
                    es.pending.append((index, event_type, int(data)))
            self._events.notify_all()

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass: energy accrues from power, traffic from the configured rates."""
        _non_negative(seconds=seconds)
        with self._lock:
            for g in self._gpus:
                g.energy_mj += int(g.power_mw * seconds)
                g.pcie_tx_bytes += int(g.pcie_tx_bytes_per_s * seconds)
                g.pcie_rx_bytes += int(g.pcie_rx_bytes_per_s * seconds)
                step = int(g.nvlink_bytes_per_s * seconds)
                for link, active in enumerate(g.nvlink_active):
                    if active:
                        g.nvlink_tx_bytes[link] += step
                        g.nvlink_rx_bytes[link] += step

    # ---------------------------------------------------------------------------------------------
    # internals
    # ---------------------------------------------------------------------------------------------

    def _maybe_fail(self, name: str, first_arg: Any) -> None:
        failures = self._failures.get(name)
        if not failures:
            return
        index = self._index_of(first_arg) if first_arg is not None else None
        for f in failures:
            if f.gpu is not None and f.gpu != index:
                continue
            if f.times is not None:
                f.times -= 1
                if f.times <= 0:
                    failures.remove(f)
            raise f.error_cls()

    def _index_of(self, handle: Any) -> int | None:
        if isinstance(handle, int):
            return handle  # nvmlDeviceGetHandleByIndex(index)
        try:
            address = ctypes.cast(handle, ctypes.c_void_p).value
        except (ctypes.ArgumentError, TypeError):
            return None
        for i, h in enumerate(self._handles):
            if ctypes.cast(h, ctypes.c_void_p).value == address:
                return i
        return None

    def _device(self, handle: Any) -> FakeGpu:
        index = self._index_of(handle)
        if index is None or isinstance(handle, int):
            raise pynvml.NVMLError_InvalidArgument()
        g = self._gpus[index]
        if g.lost:
            raise pynvml.NVMLError_GpuIsLost()
        return g

    # ---------------------------------------------------------------------------------------------
    # NVML API (names and signatures as in pynvml; the one-field reads are _DEVICE_READS, below)
    # ---------------------------------------------------------------------------------------------

    @_api
    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    @_api
    def nvmlInitWithFlags(self, flags: int) -> None:
        if self.library_missing:
            raise pynvml.NVMLError_LibraryNotFound()
        self._refcount += 1

    @_api
    def nvmlShutdown(self) -> None:
        self._refcount -= 1
        if self._refcount == 0:
            self._events.notify_all()  # waiters see Uninitialized

    @_api
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    @_api
    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus)

    @_api
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < len(self._gpus):
            raise pynvml.NVMLError_InvalidArgument()
        if self._gpus[index].lost:
            raise pynvml.NVMLError_GpuIsLost()
        return self._handles[index]

    @_api
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        mig = self._mig_device(handle)
        return mig[1] if mig is not None else self._device(handle).uuid

    @_api
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        """A GPU's handle or, for a ``MIG-`` UUID, the MIG device's (as NVML does from R470)."""
        text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        for i, g in enumerate(self._gpus):
            if g.uuid == text:
                if g.lost:
                    raise pynvml.NVMLError_GpuIsLost()
                return self._handles[i]
        for address, (_, mig_uuid) in self._mig.items():
            if mig_uuid == text:
                return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlDevice_t)
        raise pynvml.NVMLError_NotFound()

    @_api
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        mig = self._mig_device(migDevice)
        if mig is None:
            raise pynvml.NVMLError_InvalidArgument()  # not a MIG device handle
        self._device(self._handles[mig[0]])  # a lost parent answers GPU_IS_LOST
        return self._handles[mig[0]]

    @_api
    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> pynvml.nvmlPciInfo_t:
        g = self._device(handle)
        domain, bus, rest = g.pci_bus_id.split(":")
        return pynvml.nvmlPciInfo_t(
            busIdLegacy=g.pci_bus_id[4:].encode(),
            domain=int(domain, 16),
            bus=int(bus, 16),
            device=int(rest.split(".")[0], 16),
            pciDeviceId=0x233510DE,
            pciSubSystemId=0x18BE10DE,
            busId=g.pci_bus_id.encode(),
        )

    @_api
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        g = self._device(handle)
        if not version:
            return pynvml.c_nvmlMemory_t(
                total=g.memory_total_bytes,
                free=g.memory_free_bytes,
                used=g.memory_used_bytes + g.memory_reserved_bytes,
            )
        if not g.memory_v2:
            raise pynvml.NVMLError_FunctionNotFound()
        if version != pynvml.nvmlMemory_v2:
            raise pynvml.NVMLError_ArgumentVersionMismatch()
        return pynvml.c_nvmlMemory_v2_t(
            version=version,
            total=g.memory_total_bytes,
            reserved=g.memory_reserved_bytes,
            free=g.memory_free_bytes,
            used=g.memory_used_bytes,
        )

    @_api
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        g = self._device(handle)
        return pynvml.c_nvmlUtilization_t(gpu=g.utilization_gpu, memory=g.utilization_memory)

    @_api
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        g = self._device(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        stamp = int(time.time() * 1e6)
        for fv, requested in zip(values, fieldIds, strict=True):
            field_id, scope = requested if isinstance(requested, tuple) else (requested, 0)
            fv.fieldId, fv.scopeId, fv.timestamp, fv.latencyUsec = field_id, scope, stamp, 0
            fv.nvmlReturn = self._field(g, fv, field_id, scope)
        return values

    def _field(self, g: FakeGpu, fv: Any, field_id: int, scope: int) -> int:
        if field_id in g.field_returns:
            return g.field_returns[field_id]
        if field_id in g.unsupported_fields:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        if field_id in _LINK_FIELDS:
            if g.nvlink_links == 0:
                return pynvml.NVML_ERROR_NOT_SUPPORTED
            if scope >= g.nvlink_links:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            direction, unit = _LINK_FIELDS[field_id]
            counter = g.nvlink_tx_bytes if direction == "tx" else g.nvlink_rx_bytes
            fv.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            fv.value.ullVal = counter[scope] // unit
            return pynvml.NVML_SUCCESS
        if field_id not in _DEVICE_FIELDS or (
            field_id == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT and g.nvlink_links == 0
        ):
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        value_type, read = _DEVICE_FIELDS[field_id]
        fv.valueType = value_type
        setattr(fv.value, _VALUE_MEMBER[value_type], read(g))
        return pynvml.NVML_SUCCESS

    @_api
    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        g = self._device(device)
        if not 0 <= link < pynvml.NVML_NVLINK_MAX_LINKS:
            raise pynvml.NVMLError_InvalidArgument()
        if link >= g.nvlink_links:
            raise pynvml.NVMLError_NotSupported()
        return int(g.nvlink_active[link])

    @_api
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        g = self._device(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError_InvalidArgument()
        return g.temperature_c

    @_api
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        g = self._device(handle)
        if type == pynvml.NVML_CLOCK_SM:
            return g.sm_clock_mhz
        if type == pynvml.NVML_CLOCK_MEM:
            return g.memory_clock_mhz
        raise pynvml.NVMLError_InvalidArgument()

    @_api
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        g = self._device(handle)
        if counterType != pynvml.NVML_VOLATILE_ECC:
            raise pynvml.NVMLError_NotSupported()  # the fake keeps volatile counts only
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return g.ecc_corrected
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return g.ecc_uncorrected
        raise pynvml.NVMLError_InvalidArgument()

    @_api
    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        g = self._device(device)
        return (g.remapped_correctable, g.remapped_uncorrectable, int(g.remap_pending), int(g.remap_failure))

    @_api
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return self._processes(handle)

    @_api
    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        return self._processes(handle)

    def _processes(self, handle: Any) -> list[Any]:
        g = self._device(handle)
        return [
            pynvml.nvmlFriendlyObject(
                {
                    "pid": pid,
                    "usedGpuMemory": used,
                    "gpuInstanceId": _NOT_AVAILABLE,
                    "computeInstanceId": _NOT_AVAILABLE,
                }
            )
            for pid, used in g.processes.items()
        ]

    @_api
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        return self._device(handle).supported_events

    @_api
    def nvmlEventSetCreate(self) -> _EventSet:
        es = _EventSet()
        self._event_sets.append(es)
        return es

    @_api
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: _EventSet) -> None:
        g = self._device(handle)
        if eventTypes & ~g.supported_events:
            raise pynvml.NVMLError_NotSupported()  # NVML: "or some of requested event types"
        eventSet.registered[g.index] = eventSet.registered.get(g.index, 0) | eventTypes

    @_api
    def nvmlEventSetWait_v2(self, eventSet: _EventSet, timeoutms: int) -> Any:
        if eventSet.freed:
            raise pynvml.NVMLError_InvalidArgument()
        self._events.wait_for(lambda: eventSet.pending or self._refcount == 0, timeout=timeoutms / 1000)
        if self._refcount == 0:
            raise pynvml.NVMLError_Uninitialized()
        if not eventSet.pending:
            raise pynvml.NVMLError_Timeout()
        index, event_type, data = eventSet.pending.pop(0)
        return pynvml.c_nvmlEventData_t(
            device=self._handles[index],
            eventType=event_type,
            eventData=data,
            gpuInstanceId=_NOT_AVAILABLE,
            computeInstanceId=_NOT_AVAILABLE,
        )

    @_api
    def nvmlEventSetFree(self, eventSet: _EventSet) -> None:
        eventSet.freed = True
        if eventSet in self._event_sets:
            self._event_sets.remove(eventSet)


#: pynvml calls that answer one field of the device and nothing else: call name -> reader of a FakeGpu
_DEVICE_READS: dict[str, Callable[[FakeGpu], int | str]] = {
    "nvmlDeviceGetName": lambda g: g.name,
    "nvmlDeviceGetPcieReplayCounter": lambda g: g.pcie_replays,
    "nvmlDeviceGetCurrPcieLinkGeneration": lambda g: g.pcie_gen,
    "nvmlDeviceGetMaxPcieLinkGeneration": lambda g: g.pcie_gen_max,
    "nvmlDeviceGetCurrPcieLinkWidth": lambda g: g.pcie_width,
    "nvmlDeviceGetMaxPcieLinkWidth": lambda g: g.pcie_width_max,
    "nvmlDeviceGetPowerUsage": lambda g: g.power_mw,
    "nvmlDeviceGetEnforcedPowerLimit": lambda g: g.power_limit_mw,
    "nvmlDeviceGetTotalEnergyConsumption": lambda g: g.energy_mj,
    "nvmlDeviceGetCurrentClocksEventReasons": lambda g: g.clock_event_reasons,
    "nvmlDeviceGetCurrentClocksThrottleReasons": lambda g: g.clock_event_reasons,
}


def _device_read(name: str, field: Callable[[FakeGpu], int | str]) -> Callable[..., Any]:
    """The fake of one ``_DEVICE_READS`` call, with pynvml's name and ``handle`` parameter."""

    def read(self: FakeNvml, handle: Any) -> int | str:
        return field(self._device(handle))

    read.__name__ = name
    return _api(read)


for _call, _field in _DEVICE_READS.items():
    setattr(FakeNvml, _call, _device_read(_call, _field))


def _non_negative(**values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0 (NVML counters only go up), got {value}")


def _not_lower(what: str, old: int, new: int) -> None:
    if new < old:
        raise ValueError(f"{what} only go up: {old} -> {new}")
