"""A config reload applies ``vllm_plugin_sockets`` at once: new sockets are bound, dropped ones closed
and removed, a moved one rebinds; a socket that cannot be bound is logged and reported while the
rest keep running. Datagrams come from the plugin's own sender (plugins/vllm)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvwatch.agent import Agent
from kvwatch.agent.reload import ConfigReloader
from kvwatch.config import load_config
from tests.local import kvwatch_run_refused, until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins" / "vllm"))
from kvwatch_vllm_plugin import wire


@pytest.fixture
def short_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="kvw", dir="/tmp"))  # a socket path is at most 107 bytes
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _write(path: Path, sockets: list[tuple[str, Path]]) -> None:
    entries = "".join(f"  - {{replica: {replica}, path: {sock}}}\n" for replica, sock in sockets)
    path.write_text(f"""
listen: 127.0.0.1:0
node: node-a
nvml: {{enabled: false}}
replicas:
  - {{name: r1, metrics_url: "http://127.0.0.1:9/metrics", model_name: m1}}
  - {{name: r2, metrics_url: "http://127.0.0.1:9/metrics", model_name: m2}}
vllm_plugin_sockets:{" []" if not sockets else ""}
{entries}""")


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _send(path: Path, output: int) -> None:
    sender = wire.DatagramSender(str(path))
    header = {"v": wire.WIRE_VERSION, "e": 0, "p": os.getpid(), "n": 1, "t": 1000.0, "d": 0, "ds": 0}
    finished = {"reason": "stop", "e2e": 1.0, "prompt": 10, "output": output, "max_tokens": None}
    [body] = wire.encode(header, [{"run": 1, "t": 1000.0}], [finished], [], 0)
    assert sender.send(wire.dumps(body)), f"not sent to {path}"


async def _metrics(agent: Agent) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"http://127.0.0.1:{agent.port}/metrics")).text


async def _scrape_until(agent: Agent, *present: str, timeout_s: float = 10.0) -> str:
    last = [""]

    async def scraped() -> str:
        last[0] = await _metrics(agent)
        return last[0] if all(p in last[0] for p in present) else ""

    try:
        return await until(scraped, timeout_s, f"{present} on /metrics", interval_s=0.05)
    except AssertionError as exc:
        plugin_lines = "\n".join(line for line in last[0].splitlines() if "vllm_plugin" in line)
        raise AssertionError(f"{exc}\n{plugin_lines}") from None


def _accepted(replica: str, n: int) -> str:
    return f'kvwatch_vllm_plugin_datagrams_total{{replica="{replica}",result="accepted"}} {n:.1f}'


async def test_a_reload_rebinds_the_plugin_sockets_live(short_dir: Path, tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvwatch")
    a, b, c = short_dir / "a.sock", short_dir / "b.sock", short_dir / "c.sock"
    config_file = tmp_path / "kvwatch.yaml"
    _write(config_file, [("r1", a)])
    agent = Agent(load_config(str(config_file)))
    await agent.start()
    reloader = ConfigReloader(
        str(config_file), lambda: agent.file_config, agent.apply_config, agent.state.config_reload
    )
    try:
        assert _is_socket(a)
        _send(a, 5)
        await _scrape_until(agent, _accepted("r1", 1))

        # r1 moves to b, r2 gains c: both apply now, a is closed and removed
        _write(config_file, [("r1", b), ("r2", c)])
        assert reloader.reload("test")
        await until(
            lambda: _is_socket(b) and _is_socket(c) and not os.path.lexists(a), what="b and c bound, a gone"
        )
        assert "changed; it takes effect at the next restart" not in caplog.text
        _send(b, 7)
        _send(c, 9)
        body = await _scrape_until(agent, _accepted("r1", 2), _accepted("r2", 1))
        # kvwatch_requests_total is per replica in both metrics profiles
        assert 'model_name="m2",outcome="completed",replica="r2",source="vllm_plugin"} 1.0' in body

        # a path that cannot be bound (a regular file is there): said so; the others keep running
        blocked = short_dir / "blocked"
        blocked.write_text("not a socket")
        _write(config_file, [("r1", b), ("r2", blocked)])
        assert reloader.reload("test")  # the file is valid; binding is what failed
        await until(lambda: not os.path.lexists(c), what="c closed")
        assert blocked.read_text() == "not a socket"  # never replaced
        await until(
            lambda: f"cannot be bound: {blocked} exists and is not a socket" in caplog.text,
            what="the bind failure logged",
        )
        assert agent.state.collectors["vllm_plugin:r2"].success is False
        _send(b, 11)
        await until(lambda: agent.state.plugin.snapshot()[("r1", "0")].datagrams == 3, what="b still read")

        # every socket dropped: all closed and removed
        _write(config_file, [])
        assert reloader.reload("test")
        await until(lambda: not os.path.lexists(b), what="b closed")
        assert "vllm_plugin:r2" not in agent.state.collectors  # the failed socket is no longer configured
    finally:
        await agent.stop()
    assert not os.path.lexists(b) and not os.path.lexists(c)


def test_a_socket_that_cannot_be_bound_at_start_names_its_key_and_path(short_dir: Path) -> None:
    # kvwatch run stopped with "cannot start: [Errno 2] No such file or directory", no path, no key,
    # then logged a scrape job it had just scheduled as failed, with a CancelledError traceback
    path = short_dir / "kvwatch.yaml"
    blocked = short_dir / "not-a-dir"
    blocked.write_text("a file where the socket's folder should be\n")
    _write(path, [("r1", blocked / "vllm.sock")])
    result = kvwatch_run_refused("--config", str(path))
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"vllm_plugin_sockets (r1): cannot bind {blocked}/vllm.sock" in result.stderr
    assert "Error running job" not in result.stderr and "Traceback" not in result.stderr, result.stderr[
        -3000:
    ]
