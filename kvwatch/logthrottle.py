"""Log lines an outsider can repeat at will, let through once per interval and counted otherwise.

A bad request, a failed accept(), a dropped datagram or an engine that refuses connections can
each happen thousands of times a second; one log line each would flood the journal (measured:
619 KB in about a second out of file descriptors). ``LogThrottle.log`` lets the first line of a
kind through, holds back the repeats for ``interval_s`` and tells, on the next line it lets
through, how many it held back. The event itself is always counted in a metric by the caller:
the log is the hint, the counter the record.

Keys name a kind of event (a family, a reason the code chose), never a value from outside, so
the table stays as small as the code.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

DEFAULT_INTERVAL_S = 60.0


class LogThrottle:
    """At most one log line per key per ``interval_s``; the next one says how many were held back."""

    def __init__(
        self, interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[Hashable, float] = {}  # when a line of this key was last let through
        self._held: dict[Hashable, int] = {}  # lines of this key held back since then

    def held_back(self, key: Hashable) -> int:
        """Lines of ``key`` held back since the last one let through."""
        with self._lock:
            return self._held.get(key, 0)

    def log(
        self,
        logger: logging.Logger,
        level: int,
        key: Hashable,
        msg: str,
        *args: object,
        exc_info: BaseException | bool | None = None,
    ) -> bool:
        """Log ``msg % args`` unless a line of ``key`` went out within the interval; True if logged."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            self._last[key] = now
            held = self._held.pop(key, 0)
            since = 0.0 if last is None else now - last
        if held:
            msg = f"{msg} [{held} more like it in the last {since:.0f} s not logged]"
        else:
            msg = f"{msg} [repeats logged at most once every {self.interval_s:.0f} s]"
        logger.log(level, msg, *args, exc_info=exc_info)
        return True
