"""The one policy for missing test tools (tests/local.py): fail saying how to install, skip on request."""

from __future__ import annotations

import pytest
from local import SKIP_MISSING_TOOLS, require_tool


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
