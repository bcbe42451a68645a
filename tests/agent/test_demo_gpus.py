"""The demo's fake GPUs follow their replica's load: busy ones draw power at a boost clock and warm up."""

from __future__ import annotations

import pynvml

from kvwatch.demo import _follow_load
from kvwatch.gpu.fake import FakeGpu


def test_a_busy_gpu_draws_power_at_its_boost_clock_and_warms_up() -> None:
    gpu, idle = FakeGpu(0, "GPU-0"), FakeGpu(0, "GPU-0")
    temperatures = []
    for _ in range(60):
        _follow_load(gpu, busy=True, kv_usage=0.9)
        temperatures.append(gpu.temperature_c)
    assert gpu.utilization_gpu == 100 and gpu.utilization_memory == 90
    assert idle.power_mw < gpu.power_mw < gpu.power_limit_mw
    assert gpu.sm_clock_mhz > idle.sm_clock_mhz
    assert not gpu.clock_event_reasons & pynvml.nvmlClocksEventReasonGpuIdle  # it showed "idle" at 100%
    assert temperatures == sorted(temperatures) and temperatures[-1] - idle.temperature_c > 20
    assert temperatures[-1] == temperatures[-10]  # it settles
    assert gpu.memory_temperature_c < gpu.temperature_c


def test_more_kv_traffic_draws_more_power_and_an_idle_gpu_rests_and_cools() -> None:
    light, heavy = FakeGpu(0, "GPU-0"), FakeGpu(1, "GPU-1")
    _follow_load(light, busy=True, kv_usage=0.1)
    _follow_load(heavy, busy=True, kv_usage=0.95)
    assert light.power_mw < heavy.power_mw
    for _ in range(60):
        _follow_load(heavy, busy=True, kv_usage=0.95)
    warm = heavy.temperature_c
    _follow_load(heavy, busy=False, kv_usage=0.0)
    rest = FakeGpu(0, "GPU-0")
    assert (heavy.utilization_gpu, heavy.power_mw, heavy.sm_clock_mhz) == (
        0,
        rest.power_mw,
        rest.sm_clock_mhz,
    )
    assert heavy.clock_event_reasons == pynvml.nvmlClocksEventReasonGpuIdle
    assert heavy.temperature_c < warm
