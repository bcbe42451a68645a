"""Emulated cores for bench/node_rate.py (``--core-quota``): each process of a target runs in a CPU
cgroup of its own, capped at a fraction of one CPU.

On a 2-core machine a relay never gets a core to itself: the load generator (the client and 8
upstreams, in Python) needs more CPU per chunk than the proxy under test. With every proxy process
capped at, say, 0.15 CPU, the proxies saturate long before the load generator does, and a target's
rate is bounded by how many such capped processes it keeps busy at once: one for one event loop, one
per relay worker (plus the agent's own), one per nginx worker. That is the question "does the relay
scale past one core?" asked at a smaller core size. Needs root and the cgroup v1 ``cpu`` controller
or cgroup v2 with ``cpu`` in the root's ``cgroup.subtree_control``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
MIN_QUOTA_US = 1_000  # the kernel refuses a smaller quota
PREFIX = "kvwatch-bench-core-"


class CoreQuota:
    """One cgroup per confined process, each capped at ``quota`` of a CPU; ``release`` undoes it."""

    def __init__(self, quota: float) -> None:
        self.period_us, self.quota_us = period_and_quota(quota)
        self.v1 = (V1 / "cpu.cfs_quota_us").exists()
        self.root = V1 if self.v1 else V2
        if not self.v1 and "cpu" not in _read(V2 / "cgroup.subtree_control").split():
            raise SystemExit(
                "--core-quota needs the cgroup v1 cpu controller (/sys/fs/cgroup/cpu) or cgroup v2 "
                "with cpu enabled in /sys/fs/cgroup/cgroup.subtree_control"
            )
        self.groups: list[Path] = []

    def confine(self, pids: list[int]) -> None:
        """Move each process (with all its threads) into a capped cgroup of its own."""
        for pid in pids:
            group = self.root / f"{PREFIX}{pid}"
            try:
                group.mkdir(exist_ok=True)
            except OSError as exc:
                raise SystemExit(f"--core-quota: cannot create {group} ({exc}); run as root") from None
            self.groups.append(group)
            if self.v1:
                (group / "cpu.cfs_period_us").write_text(str(self.period_us))
                (group / "cpu.cfs_quota_us").write_text(str(self.quota_us))
            else:
                (group / "cpu.max").write_text(f"{self.quota_us} {self.period_us}")
            with contextlib.suppress(ProcessLookupError, OSError):  # it may have exited already
                (group / "cgroup.procs").write_text(str(pid))

    def release(self) -> None:
        """Every process still in a capped group back to the root group, and the groups removed."""
        for group in self.groups:
            for pid in _read(group / "cgroup.procs").split():
                with contextlib.suppress(OSError):
                    (self.root / "cgroup.procs").write_text(pid)
            with contextlib.suppress(OSError):
                group.rmdir()
        self.groups.clear()


def period_and_quota(quota: float) -> tuple[int, int]:
    """CFS (period, quota) in µs for ``quota`` of a CPU, with the shortest period the kernel's 1 ms
    minimum quota allows: a throttled process then waits at most period - quota (9 ms at 0.1 CPU),
    not most of the default 100 ms period, which alone would break any latency verdict."""
    if not 0.01 <= quota <= 64:
        raise SystemExit(f"--core-quota: expected a fraction of a CPU such as 0.1, got {quota}")
    period = max(MIN_QUOTA_US, -(-MIN_QUOTA_US * 1000 // round(quota * 1000)))
    return period, max(MIN_QUOTA_US, round(quota * period))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
