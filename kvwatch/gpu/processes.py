"""What /proc says about an engine process: PID namespaces, children, visible GPUs.

The only I/O behind the PID -> GPU mapping (``derive/gpu_mapping.py`` is pure). ``root`` is
injectable so tests build a fake /proc in a temporary directory.

From ``/proc/<pid>/environ`` exactly two variables are read, ``CUDA_VISIBLE_DEVICES`` and
``NVIDIA_VISIBLE_DEVICES``; nothing else of it is kept or logged (environments hold secrets).
Reading another user's environ needs the same uid or CAP_SYS_PTRACE; without it the variables are
simply unknown.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from pathlib import Path
from typing import Protocol

from kvwatch.model import ProcessInfo

log = logging.getLogger(__name__)

VISIBLE_DEVICE_VARS = (b"CUDA_VISIBLE_DEVICES", b"NVIDIA_VISIBLE_DEVICES")
MAX_TREE = 4096  # processes followed below one engine PID (a runaway fork tree stops here)
MAX_ENVIRON_BYTES = 1 << 20


class ProcessTree(Protocol):
    """What the GPU mapping needs of /proc: a process and its descendants (``ProcReader`` reads them)."""

    def tree(self, pid: int, /) -> dict[int, ProcessInfo]: ...


class ProcReader:
    """Reads the few /proc files the mapping needs. Missing processes read as ``None``."""

    def __init__(self, root: str | os.PathLike[str] = "/proc") -> None:
        self.root = Path(root)

    def info(self, pid: int, scan: dict[int, list[int]] | None = None) -> ProcessInfo | None:
        """``scan``: a parent -> children map shared across calls when the kernel lacks
        ``task/*/children`` (see ``children``)."""
        status = self._read_text(pid, "status")
        if status is None:
            return None
        ns_pids: tuple[int, ...] = ()
        ppid = None
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key == "NSpid":
                ns_pids = tuple(int(v) for v in value.split() if v.isdigit())
            elif key == "PPid" and value.strip().isdigit():
                ppid = int(value.strip())
        cuda, nvidia = self.visible_devices(pid)
        return ProcessInfo(
            pid=pid,
            ppid=ppid,
            ns_pids=ns_pids or (pid,),
            children=self.children(pid, scan),
            cuda_visible_devices=cuda,
            nvidia_visible_devices=nvidia,
        )

    def visible_devices(self, pid: int) -> tuple[str | None, str | None]:
        """(CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES) of the process; None when unset or unreadable."""
        try:
            with (self.root / str(pid) / "environ").open("rb") as fh:
                raw = fh.read(MAX_ENVIRON_BYTES)
        except OSError:
            return None, None
        found: dict[bytes, str] = {}
        for entry in raw.split(b"\0"):
            name, sep, value = entry.partition(b"=")
            if sep and name in VISIBLE_DEVICE_VARS:
                found[name] = value.decode("ascii", "replace")
        return found.get(VISIBLE_DEVICE_VARS[0]), found.get(VISIBLE_DEVICE_VARS[1])

    def children(self, pid: int, scan: dict[int, list[int]] | None = None) -> tuple[int, ...]:
        """Direct children: ``task/*/children`` (CONFIG_PROC_CHILDREN), else from a scan of every
        ``stat`` (done once into ``scan`` when a dict is passed, so a tree walk scans once)."""
        task_dir = self.root / str(pid) / "task"
        try:
            tasks = list(task_dir.iterdir())
        except OSError:
            tasks = []
        kids: list[int] = []
        have_children_files = False
        for task in tasks:
            try:
                text = (task / "children").read_text()
            except OSError:
                continue
            have_children_files = True
            kids += [int(v) for v in text.split() if v.isdigit()]
        if have_children_files:
            return tuple(dict.fromkeys(kids))
        if scan is None:
            scan = {}
        if not scan:
            for p in self.pids():
                scan.setdefault(self.ppid(p) or 0, []).append(p)
        return tuple(scan.get(pid, ()))

    def ppid(self, pid: int) -> int | None:
        """Parent PID from ``stat`` (the comm field may hold spaces and parentheses)."""
        stat = self._read_text(pid, "stat")
        if stat is None:
            return None
        fields = stat[stat.rfind(")") + 2 :].split()
        return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None

    def pids(self) -> list[int]:
        try:
            return sorted(int(e.name) for e in self.root.iterdir() if e.name.isdigit())
        except OSError:
            return []

    def tree(self, pid: int) -> dict[int, ProcessInfo]:
        """The process and all its descendants (vLLM TP/DP workers are children of the engine)."""
        out: dict[int, ProcessInfo] = {}
        scan: dict[int, list[int]] = {}
        queue = deque([pid])
        while queue and len(out) < MAX_TREE:
            current = queue.popleft()
            if current in out:
                continue
            info = self.info(current, scan)
            if info is None:
                continue
            out[current] = info
            queue.extend(info.children)
        return out

    def _read_text(self, pid: int, name: str) -> str | None:
        try:
            return (self.root / str(pid) / name).read_text(errors="replace")
        except OSError:
            return None


def read_pid_file(path: str | os.PathLike[str]) -> int:
    """The PID in a pid file; ValueError naming the file and what was wrong."""
    try:
        text = Path(path).read_text(errors="replace").strip()
    except OSError as exc:
        raise ValueError(f"pid_file {path}: cannot read ({exc.strerror or exc})") from None
    first = text.split()[0] if text else ""
    if not first.isdigit() or int(first) <= 0:
        raise ValueError(f"pid_file {path}: expected a positive process id, found {text[:40]!r}")
    return int(first)
