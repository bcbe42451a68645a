"""Loopback ports and local processes, for tests."""

from __future__ import annotations

import socket
from pathlib import Path

_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on now and this process has not handed out before: two calls in
    a row can otherwise get the same port back from the kernel before either is bound."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
