"""A byte-count progress bar on stderr for long reads (only when asked or stderr is a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 30
_REDRAW_S = 0.2


class Progress:
    """``update(bytes)`` as input is consumed; ``close()`` clears the line. Silent when disabled."""

    def __init__(
        self, total_bytes: int, enabled: bool, stream: TextIO | None = None, label: str = "reading"
    ) -> None:
        self.total = max(total_bytes, 1)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.done = 0
        self._drawn_at = 0.0

    @classmethod
    def auto(cls, total_bytes: int, forced: bool, stream: TextIO | None = None) -> Progress:
        """Enabled when ``forced`` (``--progress``) or when the stream is a terminal."""
        stream = stream if stream is not None else sys.stderr
        enabled = forced or (hasattr(stream, "isatty") and stream.isatty())
        return cls(total_bytes, enabled, stream)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._drawn_at >= _REDRAW_S or self.done >= self.total:
            self._drawn_at = now
            self._draw()

    def _draw(self) -> None:
        frac = min(self.done / self.total, 1.0)
        filled = int(frac * _WIDTH)
        bar = "#" * filled + "." * (_WIDTH - filled)
        mib_done, mib_total = self.done / 2**20, self.total / 2**20
        self.stream.write(f"\r{self.label} [{bar}] {frac:4.0%} {mib_done:,.0f}/{mib_total:,.0f} MiB")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (_WIDTH + 40) + "\r")
            self.stream.flush()
