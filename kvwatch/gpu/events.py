"""XID and health events from NVML, in a daemon thread of their own.

``nvmlEventSetWait_v2`` blocks, so it cannot share the poller's schedule. The watcher registers
every GPU for the event types kvwatch cares about (the subset each GPU supports), waits with a short
timeout so ``stop()`` is prompt, and hands each XID to ``on_xid(gpu_index, uuid, xid)``. The agent
counts them per XID code (dcgm-exporter keeps only the last XID as a gauge, so two different XIDs
between scrapes lose one). Other event types go to ``on_event`` when given, else to the log.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvwatch.gpu.nvml import NvmlLibrary, binding

log = logging.getLogger(__name__)

#: Event types kvwatch registers, by pynvml constant name, with a short label.
EVENT_TYPES: tuple[tuple[str, str], ...] = (
    ("nvmlEventTypeXidCriticalError", "xid"),
    ("nvmlEventTypeDoubleBitEccError", "ecc_double_bit"),
    ("nvmlEventTypeSingleBitEccError", "ecc_single_bit"),
    ("nvmlEventTypeGpuUnavailableError", "gpu_unavailable"),
    ("nvmlEventTypeGpuRecoveryAction", "gpu_recovery_action"),
)

WAIT_TIMEOUT_MS = 500  # stop() returns within about this long
_ERROR_PAUSE_S = 1.0  # after a failed wait; doubles while failures last
_ERROR_PAUSE_MAX_S = 30.0


def event_bits(nvml: Any) -> list[tuple[int, str]]:
    """(bit, label) of each type in ``EVENT_TYPES`` this nvidia-ml-py names: the two newest came in
    12.570, and a type the library does not know is one no GPU is registered for, not a failed start."""
    named = ((getattr(nvml, const, None), label) for const, label in EVENT_TYPES)
    return [(bit, label) for bit, label in named if isinstance(bit, int)]


@dataclass(frozen=True, slots=True)
class _Gpu:
    index: int
    uuid: str
    key: Any  # what identifies its handle inside event data


def handle_key(handle: Any) -> Any:
    """A hashable identity for an NVML device handle (a ctypes pointer; anything for fakes)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return handle


class XidWatcher:
    """Watches XID / ECC / availability events on every GPU until ``stop()``.

    Takes its own NVML reference (``nvmlInit`` is reference counted), so it lives independently of
    ``NvmlCollector``. Start it after the collector's ``start()`` returned True: on a host without
    NVML it only logs at debug level (the collector already said so once).
    """

    def __init__(
        self,
        on_xid: Callable[[int, str, int], None],
        nvml: NvmlLibrary | None = None,
        on_event: Callable[[int, str, str, int], None] | None = None,
        wait_timeout_ms: int = WAIT_TIMEOUT_MS,
    ) -> None:
        self.nvml = binding(nvml)
        self.on_xid = on_xid
        self.on_event = on_event
        self.wait_timeout_ms = wait_timeout_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self._initialized = False  # holds one NVML reference
        self._gpus: dict[Any, _Gpu] = {}
        self.registered: dict[int, tuple[str, ...]] = {}  # gpu index -> event labels registered
        self.errors = 0  # unexpected wait/callback errors (visible to tests and the status page)
        self._logged: set[tuple[int, str]] = set()  # (gpu index, event label) logged at warning once

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> bool:
        """Register events and start the thread. False when NVML or event sets are unavailable."""
        if self.running:
            return True
        n = self.nvml
        try:
            n.nvmlInit()
        except n.NVMLError as exc:
            log.debug("XID events off: nvmlInit: %s", exc)
            return False
        self._initialized = True
        try:
            self._event_set = n.nvmlEventSetCreate()
            for index in range(n.nvmlDeviceGetCount()):
                self._register(index)
        except n.NVMLError as exc:
            log.warning("XID events off: %s", exc)
            self._release()
            return False
        if not self.registered:
            log.info("XID events off: no GPU supports the XID/ECC event types")
            self._release()
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvwatch-nvml-events", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout_s: float = 2.0) -> None:
        """Signal the thread, join it (one wait timeout at most), free the event set."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("NVML event thread did not stop within %.1f s", timeout_s)
                return  # it still uses the event set: leave it, the daemon thread dies with us
            self._thread = None
        self._release()

    # ---------------------------------------------------------------------------------------------

    def _register(self, index: int) -> None:
        """Register the event types this GPU supports; a GPU that supports none is skipped."""
        n = self.nvml
        try:
            handle = n.nvmlDeviceGetHandleByIndex(index)
            uuid = n.nvmlDeviceGetUUID(handle)
        except n.NVMLError as exc:
            log.warning("XID events: GPU %d not registered: %s", index, exc)
            return
        wanted = event_bits(n)
        try:
            supported = n.nvmlDeviceGetSupportedEventTypes(handle)
            wanted = [(bit, label) for bit, label in wanted if bit & supported]
        except n.NVMLError as exc:
            log.debug("GPU %d: nvmlDeviceGetSupportedEventTypes: %s; trying each type", index, exc)
        labels = self._register_mask(handle, wanted)
        if labels:
            self.registered[index] = labels
            key = handle_key(handle)
            self._gpus[key] = _Gpu(index, uuid if isinstance(uuid, str) else uuid.decode(), key)
        else:
            log.info("XID events: GPU %d supports none of %s", index, ", ".join(lbl for _, lbl in wanted))

    def _register_mask(self, handle: Any, wanted: list[tuple[int, str]]) -> tuple[str, ...]:
        """All wanted types in one call; if NVML refuses the set, each type on its own."""
        n = self.nvml
        if not wanted:
            return ()
        mask = 0
        for bit, _ in wanted:
            mask |= bit
        try:
            n.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
            return tuple(label for _, label in wanted)
        except n.NVMLError_NotSupported:
            pass
        labels = []
        for bit, label in wanted:
            try:
                n.nvmlDeviceRegisterEvents(handle, bit, self._event_set)
                labels.append(label)
            except n.NVMLError as exc:
                log.debug("event type %s not registered: %s", label, exc)
        return tuple(labels)

    def _run(self) -> None:
        n = self.nvml
        pause, last_error = _ERROR_PAUSE_S, None
        while not self._stop.is_set():
            try:
                data = n.nvmlEventSetWait_v2(self._event_set, self.wait_timeout_ms)
            except n.NVMLError_Timeout:
                pause, last_error = _ERROR_PAUSE_S, None
                continue
            except n.NVMLError as exc:
                self.errors += 1
                if type(exc) is not last_error:  # one line per kind of failure, not one per second
                    log.warning("NVML event wait failed: %s; retrying with backoff", exc)
                    last_error = type(exc)
                self._stop.wait(pause)
                pause = min(pause * 2, _ERROR_PAUSE_MAX_S)
                continue
            pause, last_error = _ERROR_PAUSE_S, None
            self._deliver(data)

    def _deliver(self, data: Any) -> None:
        gpu = self._gpus.get(handle_key(data.device))
        if gpu is None:
            log.warning("NVML event for an unregistered GPU handle (type 0x%x)", data.eventType)
            return
        label = next(
            (lbl for bit, lbl in event_bits(self.nvml) if bit == data.eventType), f"0x{data.eventType:x}"
        )
        try:
            if label == "xid":
                self.on_xid(gpu.index, gpu.uuid, int(data.eventData))
            elif self.on_event is not None:
                self.on_event(gpu.index, gpu.uuid, label, int(data.eventData))
            elif (gpu.index, label) not in self._logged:  # a GPU with a flaky row sends thousands
                self._logged.add((gpu.index, label))
                log.warning(
                    "GPU %d (%s): NVML event %s, data %d (its count is in the polled ECC and "
                    "remapped-row counters; later %s events of this GPU are logged at debug level)",
                    gpu.index,
                    gpu.uuid,
                    label,
                    data.eventData,
                    label,
                )
            else:
                log.debug("GPU %d (%s): NVML event %s, data %d", gpu.index, gpu.uuid, label, data.eventData)
        except Exception:  # a callback bug must not end the watcher
            self.errors += 1
            log.exception("NVML event callback failed")

    def _release(self) -> None:
        n = self.nvml
        if self._event_set is not None:
            try:
                n.nvmlEventSetFree(self._event_set)
            except n.NVMLError as exc:
                log.debug("nvmlEventSetFree: %s", exc)
            self._event_set = None
        if self._initialized:
            self._initialized = False
            try:
                n.nvmlShutdown()
            except n.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)
        self._gpus.clear()
        self.registered.clear()
