"""The recorded side of a replay: what the node did for the requests the twin replays.

``--limit N`` replays the first N requests by arrival, so the recorded figures must be those of the
same requests, not the whole file's. A ledger's are read from the very lines the workload kept
(``Workload.lines``: the requests and the lines not replayed that arrived meanwhile); a trace's are
its first rows up to the N-th request the trace reader kept. Either way they are summarised by
``kvwatch report``'s own code, with ``build_report``'s choice of bands.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from kvwatch.model import LEDGER_VERSION, LengthBands
from kvwatch.plan.inputs import LedgerLine, Workload
from kvwatch.report.inputs import CHUNK_BYTES, expand
from kvwatch.report.jsonlines import JsonLinesColumns
from kvwatch.report.load import LEDGER_FIELDS, FileStats, Loaded, ledger_loaded, load
from kvwatch.report.progress import Progress
from kvwatch.report.summary import Report, choose_bands, summarize

if TYPE_CHECKING:
    import pandas as pd


def recorded_report(workload: Workload, bands: LengthBands | None = None) -> Report:
    """The node's figures for ``workload``'s requests; ``bands`` None: as ``kvwatch report`` picks
    them (a ledger's recorded band names, else the defaults). A ledger must have been read with
    ``keep_lines``."""
    if workload.kind == "ledger":
        if not workload.lines:
            raise ValueError("a ledger's recorded report needs the workload read with keep_lines=True")
        loaded = _ledger_loaded(workload.lines)
    else:
        loaded = _trace_loaded(workload)
    chosen, origin = choose_bands(loaded, bands)
    return summarize(loaded, chosen, origin)


def _ledger_loaded(lines: tuple[LedgerLine, ...]) -> Loaded:
    """The lines as ``report.load`` reads a ledger (a malformed line's number counts the kept lines)."""
    by_file: dict[str, list[bytes]] = {}
    for line in lines:
        by_file.setdefault(line.path, []).append(line.text)
    reader = JsonLinesColumns(LEDGER_FIELDS, {"v": LEDGER_VERSION})
    stats = []
    for path, texts in by_file.items():
        records, malformed, size = reader.records, reader.problems.total, 0
        for first, chunk in _chunks(texts):
            reader.add_chunk(chunk, path, first)
            size += len(chunk)
        stats.append(FileStats(path, size, reader.records - records, reader.problems.total - malformed))
    return ledger_loaded(reader.frame(), stats, reader.problems)


def _chunks(texts: list[bytes]) -> Iterator[tuple[int, bytes]]:
    """(number of the first line, whole lines) of about ``CHUNK_BYTES``, as the report reads a file."""
    start, size = 0, 0
    for end, text in enumerate(texts, start=1):
        size += len(text) + 1
        if size >= CHUNK_BYTES or end == len(texts):
            yield start + 1, b"\n".join(texts[start:end]) + b"\n"
            start, size = end, 0


def _trace_loaded(workload: Workload) -> Loaded:
    files = expand([glob.escape(path) for path in workload.paths])  # the names as read, not patterns
    loaded = load(files, workload.kind, Progress.auto(sum(f.size for f in files), False))
    loaded.frame = _first_requests(loaded.frame, len(workload.requests))
    return loaded


def _first_requests(frame: pd.DataFrame, n: int) -> pd.DataFrame:
    """The rows up to the ``n``-th replayable one by time, as ``sim.workload.load_trace`` keeps its
    first ``n`` requests (a row without a prompt or output token is not replayed, only counted)."""
    order = np.argsort(frame["started_at"].to_numpy(dtype=float), kind="stable")  # unknown times last
    prompt = frame["prompt_tokens"].to_numpy(dtype=float)[order]
    output = frame["output_tokens"].to_numpy(dtype=float)[order]
    replayable = np.flatnonzero((prompt >= 1) & (output >= 1))
    if len(replayable) <= n:
        return frame
    return frame.iloc[np.sort(order[: replayable[n - 1] + 1])].reset_index(drop=True)
