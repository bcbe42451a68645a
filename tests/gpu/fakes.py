"""Test doubles for the GPU source: a settable clock and a fake /proc tree (the fixtures in
conftest.py hand them out; tests that build their own import them from here)."""

from __future__ import annotations

from pathlib import Path


class Clock:
    """A settable clock for backoff and timestamps."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeProc:
    """A /proc tree in a temporary directory, with only the files ProcReader reads."""

    def __init__(self, root: Path, children_files: bool = True) -> None:
        self.root = root
        self.children_files = children_files

    def add(
        self,
        pid: int,
        ppid: int,
        ns_pids: tuple[int, ...] = (),
        comm: str = "python3",
        environ: dict[str, str] | None = None,
        children: tuple[int, ...] = (),
    ) -> None:
        d = self.root / str(pid)
        (d / "task" / str(pid)).mkdir(parents=True)
        nspid = "\t".join(str(p) for p in (ns_pids or (pid,)))
        (d / "status").write_text(
            f"Name:\t{comm}\nState:\tS (sleeping)\nPid:\t{pid}\nPPid:\t{ppid}\nNSpid:\t{nspid}\nThreads:\t4\n"
        )
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 0 0 0 0\n")
        env = environ or {}
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
        if self.children_files:
            text = "".join(f"{c} " for c in children)  # the kernel's format: each pid followed by a space
            (d / "task" / str(pid) / "children").write_text(text)
