"""How many CPUs the agent may use, and so how many relay worker processes ``proxy.workers: auto`` runs.

A container's CPU limit is a CFS quota, not a CPU count: ``os.cpu_count()`` and the affinity mask
still show the node's cores. The quota is read from the cgroup the process is in (v2 ``cpu.max``,
v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), on every level up to the root, and the tightest
wins. A fractional quota rounds *up*: 1.5 CPUs run two workers, which the kernel throttles to 1.5
cores between them, where one worker could use at most one.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def quota_cpus(quota: int, period: int) -> float | None:
    """CPUs a CFS quota allows, or None for no limit (quota -1 or "max", or a period of 0)."""
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max``: ``"$MAX $PERIOD"``, ``$MAX`` may be ``max`` (no limit)."""
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) > 1 else 100_000
    except ValueError:
        return None
    return quota_cpus(quota, period)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None


def _levels(mount: Path, cgroup_path: str) -> list[Path]:
    """``mount/a/b``, ``mount/a``, ``mount``: the process's cgroup and every parent under the mount."""
    parts = [p for p in cgroup_path.strip().split("/") if p]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The tightest CFS quota on the process's cgroup or its parents, in CPUs; None: unlimited.

    ``/proc/self/cgroup`` names the cgroup (``0::/path`` on v2, ``N:cpu,cpuacct:/path`` on v1). In
    a container with its own cgroup namespace the path is ``/`` and the mount is the container's
    own cgroup; on v1 without one the path is the host's, so the mount itself is read too.
    """
    membership = _read(proc_self_cgroup) or ""
    limits: list[float] = []
    for line in membership.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            for level in _levels(root, path):
                text = _read(level / "cpu.max")
                if text is not None and (cpus := parse_cpu_max(text)) is not None:
                    limits.append(cpus)
        elif "cpu" in controllers.split(","):
            mount = root / controllers
            if not mount.is_dir():
                mount = root / "cpu"
            for level in _levels(mount, path):
                quota, period = _read(level / "cpu.cfs_quota_us"), _read(level / "cpu.cfs_period_us")
                if quota is None or period is None:
                    continue
                try:
                    cpus = quota_cpus(int(quota), int(period))
                except ValueError:
                    continue
                if cpus is not None:
                    limits.append(cpus)
    return min(limits) if limits else None


def usable_cpus(
    root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP, available: int | None = None
) -> int:
    """CPUs this process may run on (``available``, default its affinity mask), capped by its cgroup
    quota rounded up; at least 1."""
    cpus = available if available is not None else _affinity()
    limit = cgroup_cpu_limit(root, proc_self_cgroup)
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


def relay_workers(setting: int | None, proxied_replicas: int, cpus: int) -> int:
    """Relay worker processes to run: ``proxy.workers`` as set, or for ``auto`` (None) one per
    proxied replica capped by ``cpus``. 0 or 1 means none: the relay runs on the agent's loop."""
    if setting is not None:
        return setting if setting > 1 else 0
    count = min(proxied_replicas, cpus)
    return count if count > 1 else 0


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
