"""Fixtures of the end-to-end tests. Each area appends its own small, self-contained block."""

from __future__ import annotations

# -- alerting stack: kvwatch demos of both metrics profiles, Prometheus with the shipped rules,
# Alertmanager, webhook (tests/e2e/alerting.py). Shared by test_alerting_e2e, test_dashboards_e2e and
# test_demo_status_page: the stack needs minutes of wall time before the page alerts fire, so it is
# started once for both profiles, and stopped as soon as the next test no longer asks for it (it
# would otherwise hold CPU through the rest of the session).
from collections.abc import Iterator
from pathlib import Path

import pytest

from .alerting import PROFILES, AlertingStack, start_alerting_stack


class _StackHolder:
    """Starts the stack on first use, restarts it if a later test needs it after an early stop."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.stack: AlertingStack | None = None
        self.runs = 0

    def get(self, profile: str) -> AlertingStack:
        if self.stack is None or self.stack.stopped:
            self.runs += 1
            workdir = self.workdir / f"run-{self.runs}"
            workdir.mkdir()
            self.stack = start_alerting_stack(workdir)
        return self.stack.seen_as(profile)

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()


_STACK_HOLDER = pytest.StashKey[_StackHolder]()


@pytest.fixture(scope="session")
def _alerting_stack_holder(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_StackHolder]:
    holder = _StackHolder(tmp_path_factory.mktemp("alerting-stack"))
    request.config.stash[_STACK_HOLDER] = holder
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture(scope="session", params=PROFILES)
def metrics_profile(request: pytest.FixtureRequest) -> str:
    """The demos' metrics.profile: every test on the stack runs for both (the stack runs the demos
    of both at once; session scope keeps one profile's tests together)."""
    return request.param


@pytest.fixture
def alerting_stack(_alerting_stack_holder: _StackHolder, metrics_profile: str) -> AlertingStack:
    """The running stack (started by the first test that asks for it), seen as ``metrics_profile``'s."""
    return _alerting_stack_holder.get(metrics_profile)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    holder = item.config.stash.get(_STACK_HOLDER, None)
    if (
        holder is not None
        and "alerting_stack" in getattr(item, "fixturenames", ())
        and (nextitem is None or "alerting_stack" not in getattr(nextitem, "fixturenames", ()))
    ):
        holder.stop()
