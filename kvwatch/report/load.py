"""Read a ledger or a reference trace into one request table with kvwatch's column names.

Every format ends as the same columns (``COLUMNS``), so the summary never asks where the data
came from; what a format cannot tell stays NaN (traces have no TTFT; Azure and Mooncake have no
outcome). pandas is imported here, never at kvwatch import time.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvwatch.model import LEDGER_VERSION, OUTCOMES
from kvwatch.report.inputs import InputFile, ReportError, read_all
from kvwatch.report.jsonlines import BOOL, NUM, STR, Field, Problems
from kvwatch.report.pieces import read_json_lines
from kvwatch.report.progress import Progress

if TYPE_CHECKING:
    import pandas as pd

#: the request table every loader produces (float columns are NaN where unknown); a ledger's also has
#: ``prompt_tokens_estimate`` (the proxy's, for requests whose usage never came)
COLUMNS = (
    "replica",
    "model_name",
    "outcome",
    "started_at",
    "prompt_tokens",
    "output_tokens",
    "output_tokens_estimated",
    "ttft_seconds",
    "e2e_seconds",
    "tpot_seconds",
)

LEDGER_FIELDS = (
    Field("replica", STR, required=True),
    Field("model_name", STR),
    Field("outcome", STR, required=True, choices=OUTCOMES),
    Field("started_at", NUM),
    Field("prompt_tokens", NUM),
    Field("prompt_tokens_estimate", NUM),
    Field("output_tokens", NUM),
    Field("output_tokens_estimated", BOOL),
    Field("ttft_seconds", NUM),
    Field("e2e_seconds", NUM),
    Field("tpot_seconds", NUM),
    Field("length_band", STR),
    Field("admission_band", STR),
)
MOONCAKE_FIELDS = (
    Field("timestamp", NUM, required=True),
    Field("input_length", NUM, required=True),
    Field("output_length", NUM, required=True),
)
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens")
BURSTGPT_ELAPSED = "Elapsed time"  # end-to-end seconds; releases before v1.2 lack it


@dataclass(frozen=True, slots=True)
class FileStats:
    path: str
    bytes: int
    records: int
    malformed: int


@dataclass(slots=True)
class Loaded:
    """The request table plus what the report must say about where it came from."""

    kind: str  # ledger | azure | burstgpt | mooncake
    frame: pd.DataFrame
    files: list[FileStats] = field(default_factory=list)
    problems: Problems = field(default_factory=Problems)
    recorded_bands: tuple[str, ...] = ()  # distinct length and admission band names the ledger recorded
    has_ttft: bool = True
    has_e2e: bool = True
    has_outcomes: bool = True


def load(files: list[InputFile], kind: str, progress: Progress, jobs: int | None = None) -> Loaded:
    """Read every file of one format; malformed lines are counted and skipped.

    ``jobs``: worker processes for JSON lines (None: by input size, see ``pieces``).
    """
    try:
        if kind == "ledger":
            return _load_ledger(files, progress, jobs)
        if kind == "mooncake":
            return _load_mooncake(files, progress, jobs)
        if kind == "azure":
            return _load_azure(files, progress)
        return _load_burstgpt(files, progress)
    finally:
        progress.close()


def _trace_names(files: list[InputFile]) -> dict[Path, str]:
    """Each trace file's group name: its file name without compression and format suffixes, with as
    many parent folders as keep two files of one name (``a/conv.csv``, ``b/conv.csv``) apart."""
    names: dict[Path, str] = {}
    for parents in range(max((len(item.path.parts) for item in files), default=0)):
        names = {item.path: _trace_name(item.path, parents) for item in files}
        if len(set(names.values())) == len(names):
            break
    return names


def _trace_name(path: Path, parents: int) -> str:
    name = path.name
    for suffix in (".gz", ".csv", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return "/".join((*path.parts[:-1][len(path.parts) - 1 - parents :], name or path.name))


def _load_ledger(files: list[InputFile], progress: Progress, jobs: int | None) -> Loaded:
    result = read_json_lines(files, LEDGER_FIELDS, {"v": LEDGER_VERSION}, progress, jobs)
    stats = [
        FileStats(
            str(f.path),
            f.size,
            result.records_by_file.get(str(f.path), 0),
            result.malformed_by_file.get(str(f.path), 0),
        )
        for f in files
    ]
    return ledger_loaded(result.frame, stats, result.problems)


def ledger_loaded(frame: pd.DataFrame, stats: list[FileStats], problems: Problems) -> Loaded:
    """A ledger's request table, its band columns taken out as the band names it recorded."""
    recorded = sorted(
        {str(b) for col in ("length_band", "admission_band") for b in frame.pop(col).cat.categories}
    )
    return Loaded("ledger", frame, stats, problems, tuple(recorded))


def _load_mooncake(files: list[InputFile], progress: Progress, jobs: int | None) -> Loaded:
    import pandas as pd

    frames, stats, problems = [], [], Problems()
    names = _trace_names(files)
    for item in files:
        result = read_json_lines([item], MOONCAKE_FIELDS, {}, progress, jobs)
        problems.merge(result.problems)
        cols = result.frame
        frames.append(
            _trace_frame(
                pd,
                names[item.path],
                len(cols),
                started_at=cols["timestamp"].to_numpy(dtype=float) / 1000.0,
                prompt=cols["input_length"].to_numpy(dtype=float),
                output=cols["output_length"].to_numpy(dtype=float),
            )
        )
        stats.append(FileStats(str(item.path), item.size, len(cols), result.problems.total))
    return Loaded(
        "mooncake", _concat(pd, frames), stats, problems, has_ttft=False, has_e2e=False, has_outcomes=False
    )


def _read_csv(
    pd: Any, item: InputFile, required: tuple[str, ...], progress: Progress, problems: Problems
) -> tuple[pd.DataFrame, int]:
    """CSV with the ``required`` columns; rows whose numbers do not parse are dropped and counted."""
    data = read_all(item, progress)
    if not data.strip():  # no header either: pandas refuses it, yet it only holds no request
        return pd.DataFrame({col: pd.Series(dtype=object) for col in required}), 0
    lines = sum(1 for ln in data.splitlines()[1:] if ln.strip())
    try:
        df = pd.read_csv(
            io.BytesIO(data),
            on_bad_lines="skip",
            skipinitialspace=True,
            encoding_errors="replace",
            low_memory=False,
        )
    except (ValueError, pd.errors.ParserError) as exc:
        raise ReportError(f"{item.path}: not a readable CSV: {exc}") from None
    df.columns = [str(c).strip() for c in df.columns]
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ReportError(
            f"{item.path}: missing column(s) {', '.join(missing)} (expected {','.join(required)})"
        )
    malformed = max(lines - len(df), 0)
    problems.add_count(str(item.path), "wrong number of fields", malformed)
    return df, malformed


def _to_numeric(pd: Any, column: pd.Series) -> pd.Series:
    """Floats, NaN where a cell is no number."""
    try:
        return pd.to_numeric(column, errors="coerce")
    except OverflowError:  # read_csv kept a 400-digit integer as a Python int; as text it reads as inf
        return pd.to_numeric(column.astype(str), errors="coerce")


def _numeric(
    pd: Any, df: pd.DataFrame, columns: tuple[str, ...], item: InputFile, problems: Problems
) -> tuple[pd.DataFrame, int]:
    """Rows whose ``columns`` all hold a finite number >= 0, and how many were dropped (counted).

    Counts, times and durations alike: 1e400 reads as inf and -5 as -5, neither a value a request has.
    """
    for col in columns:
        values = _to_numeric(pd, df[col])
        df[col] = values.where(np.isfinite(values) & (values >= 0))
    bad = df[list(columns)].isna().any(axis=1).to_numpy()
    count = int(bad.sum())
    named = " or ".join([", ".join(columns[:-1]), columns[-1]] if len(columns) > 2 else columns)
    problems.add_count(str(item.path), f"missing, unparsable or negative {named}", count)
    return df[~bad], count


def _load_azure(files: list[InputFile], progress: Progress) -> Loaded:
    import pandas as pd

    frames, stats, problems = [], [], Problems()
    names = _trace_names(files)
    for item in files:
        df, skipped = _read_csv(pd, item, AZURE_COLUMNS, progress, problems)
        df, bad = _numeric(pd, df, ("ContextTokens", "GeneratedTokens"), item, problems)
        stamps = pd.to_datetime(df["TIMESTAMP"], format="ISO8601", errors="coerce", utc=True)
        timeless = stamps.isna().to_numpy()  # a row with no time is as malformed as one with no count
        problems.add_count(str(item.path), "missing or unparsable TIMESTAMP", int(timeless.sum()))
        df, stamps, bad = df[~timeless], stamps[~timeless], bad + int(timeless.sum())
        started = (stamps - pd.Timestamp(0, tz="UTC")).dt.total_seconds().to_numpy(dtype=float)
        frames.append(
            _trace_frame(
                pd,
                names[item.path],
                len(df),
                started_at=started,
                prompt=df["ContextTokens"].to_numpy(dtype=float),
                output=df["GeneratedTokens"].to_numpy(dtype=float),
            )
        )
        stats.append(FileStats(str(item.path), item.size, len(df), skipped + bad))
    return Loaded(
        "azure", _concat(pd, frames), stats, problems, has_ttft=False, has_e2e=False, has_outcomes=False
    )


def _load_burstgpt(files: list[InputFile], progress: Progress) -> Loaded:
    """BurstGPT: ``Response tokens`` 0 marks a failed request (outcome error, output unknown)."""
    import pandas as pd

    frames, stats, problems = [], [], Problems()
    names = _trace_names(files)
    has_e2e = True
    for item in files:
        df, skipped = _read_csv(pd, item, BURSTGPT_COLUMNS, progress, problems)
        df, bad = _numeric(pd, df, _burstgpt_numbers(df), item, problems)
        response = df["Response tokens"].to_numpy(dtype=float)
        failed = response == 0
        if BURSTGPT_ELAPSED in df.columns:
            e2e = df[BURSTGPT_ELAPSED].to_numpy(dtype=float)
        else:
            e2e, has_e2e = np.full(len(df), np.nan), False
        frame = _trace_frame(
            pd,
            names[item.path],
            len(df),
            started_at=df["Timestamp"].to_numpy(dtype=float),
            prompt=df["Request tokens"].to_numpy(dtype=float),
            output=np.where(failed, np.nan, response),
            e2e=e2e,
            outcome=np.where(failed, "error", "completed"),
            model=df["Model"].astype(str).to_numpy(),
        )
        frames.append(frame)
        stats.append(FileStats(str(item.path), item.size, len(df), skipped + bad))
    return Loaded(
        "burstgpt", _concat(pd, frames), stats, problems, has_ttft=False, has_e2e=has_e2e, has_outcomes=True
    )


def _burstgpt_numbers(df: pd.DataFrame) -> tuple[str, ...]:
    """The columns a BurstGPT row needs as numbers >= 0: a negative ``Elapsed time`` would be a
    negative e2e, and with it negative KV token-seconds."""
    times = ("Timestamp", BURSTGPT_ELAPSED) if BURSTGPT_ELAPSED in df.columns else ("Timestamp",)
    return (*times, "Request tokens", "Response tokens")


def _trace_frame(
    pd: Any,
    name: str,
    n: int,
    *,
    started_at: np.ndarray,
    prompt: np.ndarray,
    output: np.ndarray,
    e2e: np.ndarray | None = None,
    outcome: np.ndarray | None = None,
    model: np.ndarray | None = None,
) -> pd.DataFrame:
    nan = np.full(n, np.nan)
    return pd.DataFrame(
        {
            "replica": pd.Categorical([name] * n),
            "model_name": pd.Categorical(model if model is not None else [None] * n),
            "outcome": pd.Categorical(outcome if outcome is not None else [None] * n, categories=OUTCOMES),
            "started_at": started_at,
            "prompt_tokens": prompt,
            "output_tokens": output,
            "output_tokens_estimated": nan,
            "ttft_seconds": nan,
            "e2e_seconds": e2e if e2e is not None else nan,
            "tpot_seconds": nan,
        }
    )


def _concat(pd: Any, frames: list[pd.DataFrame]) -> pd.DataFrame:
    """The files' frames as one. A file without a valid row is left out: its empty categories have
    another dtype than the others', which ``union_categoricals`` refuses."""
    from pandas.api.types import union_categoricals

    frames = [f for f in frames if len(f)] or frames[:1]
    if len(frames) == 1:
        return frames[0]
    out = pd.concat(frames, ignore_index=True)
    for col in ("replica", "model_name"):
        out[col] = union_categoricals([f[col] for f in frames])
    out["outcome"] = pd.Categorical(out["outcome"], categories=OUTCOMES)
    return out
