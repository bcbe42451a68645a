"""JSON-lines inputs read in pieces, on several CPUs when the input is large.

A plain file is cut into pieces of ``PIECE_BYTES``; a piece owns the lines that *start* inside it
(it skips the partial line it begins in and finishes the one it ends in), so every line is read
exactly once whatever the cut. A gzip file is one piece. Pieces are read by worker processes
(``spawn``: nothing of the parent's state is shared) when the input is at least
``PARALLEL_MIN_BYTES`` and more than one CPU is available; small inputs are read in-process. Both
ways run the same ``read_piece``, so the result does not depend on the way.
"""

from __future__ import annotations

import gzip
import io
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvwatch.report.inputs import CHUNK_BYTES, InputFile, ReportError
from kvwatch.report.jsonlines import Field, JsonLinesColumns, Problems, concat_frames
from kvwatch.report.progress import Progress

if TYPE_CHECKING:
    import pandas as pd

PIECE_BYTES = 32 * 1024 * 1024
PARALLEL_MIN_BYTES = 64 * 1024 * 1024
MAX_JOBS = 8


@dataclass(frozen=True, slots=True)
class Piece:
    index: int
    path: str
    gzipped: bool
    start: int
    end: int | None  # None: to the end of the file
    size: int  # input bytes this piece covers (progress)


@dataclass(slots=True)
class PieceResult:
    index: int
    frame: pd.DataFrame
    records: int
    lines: int
    problems: Problems


def plan(files: Sequence[InputFile], piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    pieces: list[Piece] = []
    for item in files:
        if item.gzipped or item.size <= piece_bytes:
            pieces.append(Piece(len(pieces), str(item.path), item.gzipped, 0, None, item.size))
            continue
        for start in range(0, item.size, piece_bytes):
            end = min(start + piece_bytes, item.size)
            pieces.append(Piece(len(pieces), str(item.path), False, start, end, end - start))
    return pieces


def _chunks(fh: io.BufferedIOBase, limit: int | None) -> Iterator[bytes]:
    """Newline-terminated chunks of ``fh`` from its position, up to the line crossing ``limit``."""
    tail = b""
    remaining = limit
    while remaining is None or remaining > 0:
        size = CHUNK_BYTES if remaining is None else min(CHUNK_BYTES, remaining)
        block = fh.read(size)
        if not block:
            break
        if remaining is not None:
            remaining -= len(block)
        data = tail + block
        cut = data.rfind(b"\n") + 1
        tail = data[cut:]
        if cut:
            yield data[:cut]
    if remaining is not None and tail:
        tail += fh.readline()  # finish the line that crosses the piece's end
    if tail:
        yield tail if tail.endswith(b"\n") else tail + b"\n"


def _open_piece(piece: Piece) -> tuple[io.BufferedIOBase, int | None]:
    raw = open(piece.path, "rb")  # noqa: SIM115 - closed by the caller
    if piece.gzipped:
        return gzip.GzipFile(fileobj=raw, mode="rb"), None
    if piece.start > 0:
        raw.seek(piece.start - 1)
        if raw.read(1) != b"\n":
            raw.readline()  # this line started in the previous piece
    limit = None if piece.end is None else max(piece.end - raw.tell(), 0)
    return raw, limit


def read_piece(piece: Piece, fields: tuple[Field, ...], literals: dict[str, int]) -> PieceResult:
    """Columns of one piece; line numbers in its problems count from the piece's first line."""
    reader = JsonLinesColumns(fields, literals)
    fh, limit = _open_piece(piece)
    lines = 0
    try:
        for chunk in _chunks(fh, limit):
            reader.add_chunk(chunk, piece.path, lines + 1)
            lines += chunk.count(b"\n")
    except (OSError, EOFError) as exc:
        raise ReportError(f"{piece.path}: cannot read: {exc}") from None
    finally:
        fh.close()
    return PieceResult(piece.index, reader.frame(), reader.records, lines, reader.problems)


def default_jobs() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_JOBS))


@dataclass(slots=True)
class JsonLinesResult:
    frame: pd.DataFrame
    problems: Problems
    records_by_file: dict[str, int]
    malformed_by_file: dict[str, int]


def read_json_lines(
    files: Sequence[InputFile],
    fields: tuple[Field, ...],
    literals: dict[str, int],
    progress: Progress,
    jobs: int | None = None,
    piece_bytes: int = PIECE_BYTES,
) -> JsonLinesResult:
    """Read every file's records; ``jobs`` None picks in-process or all CPUs by input size."""
    pieces = plan(files, piece_bytes)
    total = sum(p.size for p in pieces)
    if jobs is None:
        jobs = default_jobs() if total >= PARALLEL_MIN_BYTES else 1
    jobs = max(1, min(jobs, len(pieces)))
    results: list[PieceResult] = []
    if jobs == 1:
        for piece in pieces:
            results.append(read_piece(piece, fields, literals))
            progress.update(piece.size)
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            futures = {pool.submit(read_piece, p, fields, literals): p for p in pieces}
            for future in as_completed(futures):
                results.append(future.result())
                progress.update(futures[future].size)
    results.sort(key=lambda r: r.index)
    return _combine(pieces, results, fields)


def _combine(pieces: list[Piece], results: list[PieceResult], fields: tuple[Field, ...]) -> JsonLinesResult:
    problems = Problems()
    records: dict[str, int] = {}
    malformed: dict[str, int] = {}
    line_offset: dict[str, int] = {}
    for piece, result in zip(pieces, results, strict=True):
        offset = line_offset.get(piece.path, 0)
        problems.merge(result.problems, offset)
        line_offset[piece.path] = offset + result.lines
        records[piece.path] = records.get(piece.path, 0) + result.records
        malformed[piece.path] = malformed.get(piece.path, 0) + result.problems.total
    frame = concat_frames([r.frame for r in results], fields)
    return JsonLinesResult(frame, problems, records, malformed)
