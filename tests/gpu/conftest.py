"""Fixtures for the GPU source: a fake NVML (faithful to pynvml's API) and a collector on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwatch.gpu.fake import FakeNvml
from kvwatch.gpu.nvml import NvmlCollector

from .fakes import Clock, FakeProc


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(gpus=2)


@pytest.fixture
def collector(fake: FakeNvml, clock: Clock) -> NvmlCollector:
    c = NvmlCollector(fake, now=clock)
    assert c.start()
    return c


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path)
