"""A real CPU vLLM with kvwatch's plugin loaded, once per session (``plugin_vllm``)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import RealEngine
from local import CACHE, free_port, start_vllm, stop_group

#: the two vLLM switches that feed the step samples and the KV block histograms
PLUGIN_ENGINE_ARGS = "--enable-logging-iteration-details --kv-cache-metrics --kv-cache-metrics-sample 1.0"


@dataclass(frozen=True)
class PluginEngine:
    engine: RealEngine
    socket_path: str


@pytest.fixture(scope="session")
def plugin_vllm() -> Iterator[PluginEngine]:
    """vLLM (20 KV blocks x 128 tokens: long requests preempt) sending to a socket nobody binds yet."""
    with tempfile.TemporaryDirectory(prefix="kvwatch-plugin-") as tmp:
        path = str(Path(tmp) / "vllm.sock")
        port = free_port()
        log = CACHE / "kvwatch-vllm" / f"vllm-plugin-test-{port}.log"
        pid = start_vllm(port, log, PLUGIN_ENGINE_ARGS, {"KVWATCH_VLLM_SOCKET": path})
        base = f"http://127.0.0.1:{port}"
        try:
            yield PluginEngine(RealEngine(base, f"{base}/metrics", pid, "tiny", log), path)
        finally:
            stop_group(pid)
