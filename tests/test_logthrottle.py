"""The throttle every repeatable log line goes through: one line per interval, and a count of the rest."""

from __future__ import annotations

import logging

from kvwatch.logthrottle import LogThrottle


def test_repeats_within_the_interval_are_held_back_and_the_next_line_counts_them(caplog) -> None:
    now = [0.0]
    throttle = LogThrottle(60.0, clock=lambda: now[0])
    log = logging.getLogger("kvwatch.test.throttle")
    caplog.set_level(logging.WARNING, logger=log.name)
    sent = [throttle.log(log, logging.WARNING, "k", "bad thing %d", i) for i in range(1000)]
    assert sent.count(True) == 1 and throttle.held_back("k") == 999
    assert throttle.log(log, logging.WARNING, "other", "another kind")  # keys are throttled apart
    now[0] = 61.0
    assert throttle.log(log, logging.WARNING, "k", "bad thing %d", 1000)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3
    assert messages[0].startswith("bad thing 0")
    assert messages[2].startswith("bad thing 1000")
    assert "999 more like it in the last 61 s not logged" in messages[2]
    assert throttle.held_back("k") == 0
