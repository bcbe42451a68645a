"""The dead-code check's whitelist (.ci/vulture_whitelist.py) stays reviewed: every entry names
something that still exists and says why it is alive, so an entry cannot outlive its name and hide
the next dead thing of that name."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WHITELIST = ROOT / ".ci" / "vulture_whitelist.py"
ENTRY = re.compile(r"^_\.(\w+)\s+#\s*(\S.*)$")


def whitelist_entries(text: str) -> list[tuple[str, str]]:
    """(name, reason) of each ``_.name  # reason`` line; a line without a reason is an error."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("_."):
            match = ENTRY.match(line)
            assert match, f"{WHITELIST.name} line {number} gives no reason: {line!r}"
            entries.append((match.group(1), match.group(2)))
    return entries


def test_every_whitelist_entry_has_a_reason_and_a_name_that_still_exists() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["vulture"]
    sources = [
        p
        for path in config["paths"]
        if (ROOT / path) != WHITELIST
        for p in ([ROOT / path] if (ROOT / path).is_file() else sorted((ROOT / path).rglob("*.py")))
        if not any(part in str(p.relative_to(ROOT)) for part in config["exclude"])
    ]
    text = "\n".join(p.read_text(encoding="utf-8") for p in sources)
    entries = whitelist_entries(WHITELIST.read_text(encoding="utf-8"))
    assert entries
    gone = [name for name, _ in entries if not re.search(rf"\b{re.escape(name)}\b", text)]
    assert not gone, f"whitelisted names no longer in the code (remove them from {WHITELIST.name}): {gone}"


def test_an_entry_without_a_reason_is_refused() -> None:
    assert whitelist_entries("_.kept  # read by name\n") == [("kept", "read by name")]
    with pytest.raises(AssertionError, match="gives no reason"):
        whitelist_entries("_.unexplained\n")
