"""Which files a report reads, how they are opened (plain or gzip), and what format they are in.

Paths may be globs; rotated ledgers (``ledger.jsonl``, ``ledger.jsonl.1``, ...) are read oldest
first. A file is gzip when its first bytes say so, whatever its name.
"""

from __future__ import annotations

import glob
import gzip
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvwatch.jsonsafe import loads
from kvwatch.report.progress import Progress

FORMATS = ("ledger", "azure", "burstgpt", "mooncake")

#: CSV header columns that identify a trace format (a subset must be present)
CSV_SIGNATURES = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Model", "Request tokens", "Response tokens"),
}
#: JSON-lines keys that identify a format
JSON_SIGNATURES = {
    "ledger": ("replica", "outcome", "output_tokens"),
    "mooncake": ("timestamp", "input_length", "output_length"),
}

EXPECTED_FORMATS = (
    "a kvwatch request ledger (JSON lines with replica, outcome, output_tokens, ...), "
    "an Azure LLM trace (CSV TIMESTAMP,ContextTokens,GeneratedTokens), "
    "a BurstGPT trace (CSV Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,...) "
    "or a Mooncake trace (JSON lines with timestamp, input_length, output_length, hash_ids)"
)

CHUNK_BYTES = 4 * 1024 * 1024
_GZIP_MAGIC = b"\x1f\x8b"
_ROTATION = re.compile(r"^(?P<base>.*?)(?:\.(?P<index>\d+))?(?P<gz>\.gz)?$")
_SNIFF_LINES = 20


class ReportError(Exception):
    """A problem with the report's input the user must fix (message says what and where)."""


@dataclass(frozen=True, slots=True)
class InputFile:
    path: Path
    size: int
    gzipped: bool


def _rotation_key(path: Path) -> tuple[str, int, str]:
    """Sort key putting ``x.jsonl.3`` before ``x.jsonl.1`` before ``x.jsonl`` (oldest first)."""
    m = _ROTATION.match(str(path))
    assert m is not None  # the pattern matches every string
    index = int(m.group("index")) if m.group("index") else 0
    return (m.group("base"), -index, str(path))


def expand(patterns: list[str]) -> list[InputFile]:
    """Expand paths and globs into existing files, oldest rotation first, each once."""
    found: dict[Path, None] = {}
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise ReportError(f"{pattern}: no file matches this pattern")
        for match in matches:
            path = Path(match)
            if not path.is_file():
                raise ReportError(f"{match}: no such file")
            found[path] = None
    files = []
    for path in sorted(found, key=_rotation_key):
        try:
            with path.open("rb") as fh:
                magic = fh.read(2)
            size = path.stat().st_size
        except OSError as exc:
            raise ReportError(f"{path}: cannot read: {exc.strerror or exc}") from None
        files.append(InputFile(path, size, magic == _GZIP_MAGIC))
    return files


def open_binary(item: InputFile) -> tuple[io.BufferedIOBase, BinaryIO]:
    """(reader of the decompressed bytes, raw file whose ``tell()`` measures progress)."""
    raw = item.path.open("rb")
    if item.gzipped:
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    return raw, raw


def read_all(item: InputFile, progress: Progress) -> bytes:
    """Whole decompressed content (trace CSVs are parsed in one go by pandas)."""
    reader, raw = open_binary(item)
    blocks: list[bytes] = []
    seen = 0
    try:
        while True:
            try:
                block = reader.read(CHUNK_BYTES)
            except (OSError, EOFError) as exc:  # corrupt or truncated gzip
                raise ReportError(f"{item.path}: cannot decompress: {exc}") from None
            pos = raw.tell()
            progress.update(pos - seen)
            seen = pos
            if not block:
                return b"".join(blocks)
            blocks.append(block)
    finally:
        reader.close()
        raw.close()


def _head_lines(item: InputFile) -> list[str]:
    reader, raw = open_binary(item)
    try:
        head = reader.read(64 * 1024)
    except (OSError, EOFError) as exc:
        raise ReportError(f"{item.path}: cannot decompress: {exc}") from None
    finally:
        reader.close()
        raw.close()
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff")
    return [ln.strip() for ln in text.splitlines() if ln.strip()][:_SNIFF_LINES]


def detect_formats(files: list[InputFile]) -> dict[Path, str]:
    """The format of each file that has lines. An empty file holds no request, so it cannot disagree
    with the others: rotation leaves one (the new ``ledger.jsonl``). ReportError when all are empty."""
    formats = {}
    for item in files:
        lines = _head_lines(item)
        if lines:
            formats[item.path] = _format_of(item, lines)
    if not formats:
        names = ", ".join(os.fspath(item.path) for item in files)
        raise ReportError(f"{names}: file is empty" if len(files) == 1 else f"{names}: every file is empty")
    return formats


def _format_of(item: InputFile, lines: list[str]) -> str:
    """The format ``lines`` (a file's first non-blank lines) are in; ReportError says what was
    expected."""
    for line in lines:  # the first JSON object decides (a garbage first line is only skipped)
        if not line.startswith("{"):
            continue
        try:
            obj = loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            for name, keys in JSON_SIGNATURES.items():
                if all(k in obj for k in keys):
                    return name
        break
    header = {col.strip().strip('"') for col in lines[0].split(",")}
    for name, cols in CSV_SIGNATURES.items():
        if all(c in header for c in cols):
            return name
    raise ReportError(
        f"{item.path}: cannot tell the format from its first lines; expected "
        f"{EXPECTED_FORMATS}. Pass --trace-format to name it."
    )


def detect_common_format(files: list[InputFile], forced: str | None) -> str:
    """The one format of all inputs (a report compares like with like)."""
    if forced and forced != "auto":
        if forced not in FORMATS:
            raise ReportError(f"unknown --trace-format {forced!r} (one of auto, {', '.join(FORMATS)})")
        return forced
    formats = detect_formats(files)
    kinds = set(formats.values())
    if len(kinds) > 1:
        listing = ", ".join(f"{os.fspath(p)} is {k}" for p, k in formats.items())
        raise ReportError(
            f"inputs are in different formats ({listing}); report one format at a time "
            "and compare the reports side by side"
        )
    return kinds.pop()
