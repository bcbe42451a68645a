"""The real pynvml (nvidia-ml-py) on this GPU-less machine: GPU metrics off, nothing else harmed.

These run against the installed driver bindings, not the fake. On a machine that does have a
driver they are skipped (they assert the no-driver behaviour).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from kvwatch.gpu.events import XidWatcher
from kvwatch.gpu.nvml import NvmlCollector

ROOT = Path(__file__).resolve().parents[2]
SMOKE = "bench.nvml_smoke"  # run as the docs say: python -m bench.nvml_smoke, from the repository root


def _has_driver() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def run_smoke(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", SMOKE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )


no_driver = pytest.mark.skipif(_has_driver(), reason="this machine has an NVIDIA driver")


def test_real_module_is_nvidia_ml_py_not_the_deprecated_wrapper():
    from importlib.metadata import PackageNotFoundError, version

    assert version("nvidia-ml-py")
    with pytest.raises(PackageNotFoundError):
        version("pynvml")  # the deprecated PyPI wrapper would shadow the module and warn on import


@no_driver
def test_start_without_driver_is_false_with_one_clear_line(caplog: pytest.LogCaptureFixture):
    collector = NvmlCollector(pynvml)
    with caplog.at_level(logging.DEBUG, logger="kvwatch"):
        assert collector.start() is False
        assert collector.poll() == []  # retry not due yet: no second line, no crash
    lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "GPU metrics off: libnvidia-ml.so.1 not found" in lines[0].getMessage()
    assert not collector.report.success and not collector.report.available


@no_driver
def test_retry_against_the_real_module_stays_quiet(caplog: pytest.LogCaptureFixture):
    now = [0.0]
    collector = NvmlCollector(pynvml, now=lambda: now[0])
    collector.start()
    caplog.clear()  # the one line of start() is tested above
    with caplog.at_level(logging.INFO, logger="kvwatch"):
        for _ in range(3):
            now[0] += 1000
            assert collector.poll() == []
    assert caplog.records == []
    assert collector.process_gpus() == {} and collector.driver_version() is None


@no_driver
def test_event_watcher_without_driver_does_not_start():
    watcher = XidWatcher(lambda *_: None, nvml=pynvml)
    assert watcher.start() is False and not watcher.running
    watcher.stop()  # harmless


@no_driver
def test_smoke_script_reports_no_library_and_exits_zero():
    done = run_smoke()
    assert done.returncode == 0
    assert done.stdout.startswith("no NVML library or no GPU: libnvidia-ml.so.1 not found")
    assert done.stderr == ""


def test_smoke_script_on_the_fake_lists_every_call_and_times_the_poll(tmp_path: Path):
    out = tmp_path / "smoke.json"
    done = run_smoke("--fake", "2", "--polls", "3", "--events-seconds", "0.2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    for call in (
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetMemoryInfo(version=v2)",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait_v2",
        "nvmlDeviceGetComputeRunningProcesses",
    ):
        assert call in done.stdout
    assert "full poll of 2 GPU(s)" in done.stdout and "ratio" in done.stdout
    assert out.stat().st_size > 0
