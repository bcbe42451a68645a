from __future__ import annotations

import pytest

from kvwatch.sim.engine import SimEngine

from .helpers import small_config


@pytest.fixture
def make_engine():
    """An engine factory over ``small_config`` (keyword overrides are EngineConfig fields)."""

    def make(**overrides) -> SimEngine:
        return SimEngine(small_config(**overrides))

    return make
