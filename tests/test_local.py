"""tests/local.py: the one policy for missing test tools (fail saying how to install, skip on request),
and the one way to wait for a condition."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.local import SKIP_MISSING_TOOLS, require_tool, until, wait_until


def test_a_missing_tool_fails_with_how_to_install_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(SKIP_MISSING_TOOLS, raising=False)
    with pytest.raises(pytest.fail.Exception, match=r"promtool on PATH not found: run scripts/setup-test"):
        require_tool("promtool")


def test_a_missing_tool_skips_only_when_asked(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(SKIP_MISSING_TOOLS, "1")
    with pytest.raises(pytest.skip.Exception):
        require_tool("promtool")


def test_an_explicit_path_wins_and_must_exist(monkeypatch, tmp_path) -> None:
    tool = tmp_path / "prometheus"
    tool.write_text("#!/bin/sh\n")
    monkeypatch.setenv("KVWATCH_PROMETHEUS", str(tool))
    assert require_tool("prometheus", path_env="KVWATCH_PROMETHEUS") == str(tool)
    monkeypatch.setenv("KVWATCH_PROMETHEUS", str(tmp_path / "nope"))
    monkeypatch.delenv(SKIP_MISSING_TOOLS, raising=False)
    with pytest.raises(pytest.fail.Exception, match="KVWATCH_PROMETHEUS"):
        require_tool("prometheus", path_env="KVWATCH_PROMETHEUS")


def test_wait_until_returns_the_first_truthy_value_and_retries_only_what_it_is_told() -> None:
    answers = iter([0, ConnectionError("still starting"), "", {"ready": True}])

    def probe() -> object:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_until(probe, 5, "ready", interval_s=0, retry_on=(ConnectionError,)) == {"ready": True}
    with pytest.raises(ConnectionError):
        wait_until(lambda: (_ for _ in ()).throw(ConnectionError("down")), 5, interval_s=0)


def test_wait_until_names_what_it_waited_for_and_the_last_value() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 0.2 s waiting for the port \(last: \[\]\)"):
        wait_until(list, 0.2, "the port")
    assert time.monotonic() - started >= 0.2


async def test_until_awaits_an_async_probe_and_lets_the_loop_run() -> None:
    flag = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, flag.set)

    async def is_set() -> bool:
        return flag.is_set()

    assert await until(is_set, 5, "the flag") is True
    assert await until(lambda: 7, 5) == 7
    with pytest.raises(AssertionError, match="waiting for never"):
        await until(lambda: False, 0.1, "never")
