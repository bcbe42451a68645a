"""The session's real CPU vLLM (tests/conftest.py ``real_vllm``, started with kvwatch's plugin
loaded) seen as a plugin engine (``plugin_vllm``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.local import RealEngine


@dataclass(frozen=True)
class PluginEngine:
    engine: RealEngine
    socket_path: str


@pytest.fixture(scope="session")
def plugin_vllm(real_vllm: RealEngine) -> PluginEngine:
    """vLLM (20 KV blocks x 128 tokens: long requests preempt) sending to a socket nobody binds yet."""
    assert real_vllm.plugin_socket is not None
    return PluginEngine(real_vllm, real_vllm.plugin_socket)
