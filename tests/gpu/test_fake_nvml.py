"""The fake NVML keeps NVML's semantics and cannot drift from the real pynvml API."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pynvml
import pytest

from kvwatch.gpu import events, fake, nvml
from kvwatch.gpu.fake import MIB, FakeNvml

ROOT = Path(__file__).resolve().parents[2]
#: every file that calls NVML through a module object (the collector, the event thread, the smoke script)
NVML_USERS = (Path(nvml.__file__), Path(events.__file__), ROOT / "bench" / "nvml_smoke.py")
NVML_NAME = re.compile(r"(nvml[A-Z]\w*|NVML_\w+|NVMLError(_[A-Z]\w*)?|NVMLLibraryMismatchError)")
STRUCT_FIELDS = {"nvmlReturn"}  # c_nvmlFieldValue_t.nvmlReturn: an attribute of a result, not the module


def nvml_names_used(path: Path) -> set[str]:
    """NVML names in attribute accesses and string constants (call names passed to ``call()``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return {n for n in names if NVML_NAME.fullmatch(n)} - STRUCT_FIELDS


# ------------------------------------------------------------------------------------------------
# drift against the real module
# ------------------------------------------------------------------------------------------------


def test_every_nvml_name_kvwatch_uses_exists_in_real_pynvml_and_in_the_fake():
    used = set().union(*(nvml_names_used(p) for p in NVML_USERS))
    assert {"nvmlDeviceGetFieldValues", "nvmlEventSetWait_v2", "NVMLError_GpuIsLost"} <= used  # scan works
    f = FakeNvml(gpus=1)
    assert sorted(n for n in used if not hasattr(pynvml, n)) == []
    assert sorted(n for n in used if not hasattr(f, n)) == []


def test_fake_functions_exist_in_pynvml_with_compatible_parameters():
    for name in FakeNvml.api_names():
        real = getattr(pynvml, name)
        assert callable(real), name
        real_params = list(inspect.signature(real).parameters)
        fake_params = list(inspect.signature(getattr(FakeNvml, name)).parameters)[1:]  # without self
        if real_params != ["args", "kwargs"]:  # pynvml decorators hide some signatures
            assert fake_params == real_params, name


def test_fake_constants_and_errors_are_the_real_ones():
    f = FakeNvml(gpus=1)
    for name in fake._REEXPORTED:
        assert getattr(f, name) is getattr(pynvml, name), name
    assert f.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost


# ------------------------------------------------------------------------------------------------
# NVML semantics
# ------------------------------------------------------------------------------------------------


def test_every_call_before_init_raises_uninitialized():
    f = FakeNvml(gpus=1)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        f.nvmlDeviceGetCount()
    f.nvmlInit()
    h = f.nvmlDeviceGetHandleByIndex(0)
    f.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        f.nvmlDeviceGetPowerUsage(h)


def test_init_is_reference_counted():
    f = FakeNvml(gpus=1)
    f.nvmlInit()
    f.nvmlInit()
    f.nvmlShutdown()
    assert f.nvmlDeviceGetCount() == 1
    f.nvmlShutdown()
    assert not f.initialized
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        f.nvmlShutdown()


def test_missing_library_fails_init_like_pynvml():
    f = FakeNvml(library_missing=True)
    with pytest.raises(pynvml.NVMLError_LibraryNotFound) as exc:
        f.nvmlInit()
    assert exc.value.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND


def test_lost_gpu_answers_gpu_is_lost_even_to_handle_lookup():
    f = FakeNvml(gpus=2)
    f.nvmlInit()
    h = f.nvmlDeviceGetHandleByIndex(1)
    f.set_lost(1)
    for call in (
        lambda: f.nvmlDeviceGetUUID(h),
        lambda: f.nvmlDeviceGetHandleByIndex(1),
        lambda: f.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP]),
    ):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    assert f.nvmlDeviceGetCount() == 2  # still enumerated


def test_returns_real_ctypes_structures():
    f = FakeNvml(gpus=1)
    f.nvmlInit()
    h = f.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(h, pynvml.c_nvmlDevice_t)
    assert isinstance(f.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2), pynvml.c_nvmlMemory_v2_t)
    assert isinstance(f.nvmlDeviceGetMemoryInfo(h), pynvml.c_nvmlMemory_t)
    values = f.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, (138, 17), (138, 18)])
    assert isinstance(values[0], pynvml.c_nvmlFieldValue_t)
    assert [v.nvmlReturn for v in values] == [
        pynvml.NVML_SUCCESS,
        pynvml.NVML_SUCCESS,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
    ]  # 18 links: 0..17
    assert (values[1].fieldId, values[1].scopeId) == (138, 17)
    assert f.nvmlDeviceGetPciInfo_v3(h).busId == "00000000:19:00.0"


def test_memory_v2_adds_up_and_v1_used_includes_reserved():
    f = FakeNvml(gpus=1)
    f.nvmlInit()
    h = f.nvmlDeviceGetHandleByIndex(0)
    f.add_process(0, 1, 10 * 1024 * MIB)
    v2 = f.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    v1 = f.nvmlDeviceGetMemoryInfo(h)
    assert v2.total == v2.used + v2.reserved + v2.free == 143_771 * MIB
    assert v1.used == v2.used + v2.reserved and v1.free == v2.free
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        f.nvmlDeviceGetMemoryInfo(h, version=1)


def test_counters_cannot_go_down():
    f = FakeNvml(gpus=1)
    for lower in (
        lambda: f.add_pcie_traffic(0, tx_bytes=-1),
        lambda: f.add_energy(0, -5),
        lambda: f.add_ecc_errors(0, corrected=-1),
        lambda: f.advance(-1),
    ):
        with pytest.raises(ValueError, match="only go up"):
            lower()
    f.set_remapped_rows(0, correctable=3)
    with pytest.raises(ValueError, match="only go up"):
        f.set_remapped_rows(0, correctable=2)


def test_link_cannot_train_above_its_maximum():
    with pytest.raises(ValueError, match="exceeds"):
        FakeNvml(gpus=1).set_link(0, gen=6, width=16)


def test_memory_cannot_exceed_what_the_gpu_has():
    f = FakeNvml(gpus=1)
    with pytest.raises(ValueError, match="free"):
        f.add_process(0, 1, 200 * 1024 * MIB)
    with pytest.raises(ValueError, match="total - reserved"):
        f.gpu(0).memory_used_bytes = 143_771 * MIB
    f.gpu(0).memory_used_bytes = 100 * 1024 * MIB  # a test may set it directly


def test_injected_failures_target_one_call_one_gpu_and_count_down():
    f = FakeNvml(gpus=2)
    f.nvmlInit()
    h0, h1 = f.nvmlDeviceGetHandleByIndex(0), f.nvmlDeviceGetHandleByIndex(1)
    f.fail("nvmlDeviceGetPowerUsage", pynvml.NVMLError_Unknown, gpu=1, times=2)
    assert f.nvmlDeviceGetPowerUsage(h0) == 74_580
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_Unknown):
            f.nvmlDeviceGetPowerUsage(h1)
    assert f.nvmlDeviceGetPowerUsage(h1) == 74_580


def test_unknown_call_name_or_error_class_is_refused():
    f = FakeNvml(gpus=1)
    with pytest.raises(ValueError, match="no NVML call"):
        f.fail("nvmlDeviceGetPowerUsag", pynvml.NVMLError_Unknown)
    with pytest.raises(TypeError):
        f.fail("nvmlDeviceGetPowerUsage", RuntimeError)


def test_registering_an_unsupported_event_type_fails_the_whole_registration():
    f = FakeNvml(gpus=1)
    f.nvmlInit()
    h = f.nvmlDeviceGetHandleByIndex(0)
    es = f.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        f.nvmlDeviceRegisterEvents(
            h, pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeGpuUnavailableError, es
        )
    f.inject_xid(0, 13)
    with pytest.raises(pynvml.NVMLError_Timeout):
        f.nvmlEventSetWait_v2(es, 10)  # nothing registered, nothing delivered


def test_events_arrive_through_the_event_set_with_the_device_handle():
    f = FakeNvml(gpus=2)
    f.nvmlInit()
    h1 = f.nvmlDeviceGetHandleByIndex(1)
    es = f.nvmlEventSetCreate()
    f.nvmlDeviceRegisterEvents(h1, pynvml.nvmlEventTypeXidCriticalError, es)
    f.inject_xid(1, 79)
    data = f.nvmlEventSetWait_v2(es, 1000)
    assert isinstance(data, pynvml.c_nvmlEventData_t)
    assert events.handle_key(data.device) == events.handle_key(h1)
    assert (data.eventType, data.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 79)
