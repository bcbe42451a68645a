"""Write generated files, or (``--check``) show how the committed ones differ and fail."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TextIO


def stale_files(out_dir: Path, files: Mapping[str, str]) -> dict[str, str]:
    """``{relative name: unified diff}`` for every file whose committed text differs (or is missing)."""
    diffs: dict[str, str] = {}
    for name, text in files.items():
        path = out_dir / name
        try:
            current = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            diffs[name] = f"{path}: missing\n"
            continue
        if current != text:
            diffs[name] = "".join(difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{path} (committed)", tofile=f"{path} (generated)"))
    return diffs


def refused(what: str, problems: Sequence[str], stderr: TextIO | None = None) -> bool:
    """Say why generated ``what`` is not written (queries of series kvwatch does not export)."""
    if not problems:
        return False
    stderr = stderr or sys.stderr
    stderr.write(f"refusing to write {what} that query series kvwatch does not export:\n")
    for problem in problems:
        stderr.write(f"  {problem}\n")
    return True


def command_line(command: str, options: Iterable[tuple[str, str, str]]) -> str:
    """``command`` plus ``FLAG VALUE`` for each (flag, value, default) whose value is not the default:
    the command that regenerates what a ``--check`` found out of date."""
    return command + "".join(f" {flag} {value}" for flag, value, default in options if value != default)


def write_or_check(out_dir: Path, files: Mapping[str, str], check: bool, regenerate: str,
                   stdout: TextIO | None = None) -> int:
    """Write ``files`` under ``out_dir``; with ``check``, write nothing, print diffs, exit status 1
    when anything differs. ``regenerate`` is the command that fixes a failed check."""
    stdout = stdout or sys.stdout
    if check:
        diffs = stale_files(out_dir, files)
        for diff in diffs.values():
            stdout.write(diff if diff.endswith("\n") else diff + "\n")
        if diffs:
            stdout.write(f"{len(diffs)} generated file(s) out of date; run: {regenerate}\n")
            return 1
        stdout.write(f"{len(files)} generated file(s) up to date in {out_dir}\n")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        stdout.write(f"wrote {path}\n")
    return 0
