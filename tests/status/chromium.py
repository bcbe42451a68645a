"""Headless Chromium for tests: a page's DOM after its scripts ran for a virtual-time budget."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.local import require_tool


async def dump_dom(url: str, profile: Path, budget_ms: int) -> str:
    """``chromium --headless --dump-dom`` of ``url``; ``budget_ms`` of virtual time lets its timers run."""
    chromium = require_tool("chromium")
    args = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        "--dump-dom",
        url,
    ]
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()
