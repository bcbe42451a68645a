"""Small ledgers for report tests, written with the proxy's own line builder."""

from __future__ import annotations

import json
from pathlib import Path

from kvwatch.model import DEFAULT_BANDS, LengthBands, Outcome, RequestRecord
from kvwatch.requests.ledger import ledger_line

T0 = 1_750_000_000.0


def record(
    replica: str,
    outcome: Outcome,
    offset: float,
    prompt: int | None,
    output: int | None,
    ttft: float | None,
    e2e: float | None,
    model: str = "qwen3-32b",
    **extra: object,
) -> RequestRecord:
    return RequestRecord(
        replica,
        model,
        "proxy",
        outcome,
        T0 + offset,
        endpoint="chat",
        streaming=True,
        status_code=200,
        prompt_tokens=prompt,
        output_tokens=output,
        max_tokens=32000,
        ttft_seconds=ttft,
        e2e_seconds=e2e,
        **extra,
    )  # type: ignore[arg-type]


def line(rec: RequestRecord, bands: LengthBands = DEFAULT_BANDS) -> str:
    """One ledger line exactly as RequestLedger writes it."""
    return json.dumps(ledger_line(rec, bands), separators=(",", ":"))


def write(
    path: Path,
    records: list[RequestRecord],
    bands: LengthBands = DEFAULT_BANDS,
    extra_lines: dict[int, str] | None = None,
) -> Path:
    """Write records; ``extra_lines`` inserts raw lines before the given record index."""
    out = []
    for i, rec in enumerate(records):
        if extra_lines and i in extra_lines:
            out.append(extra_lines[i])
        out.append(line(rec, bands))
    if extra_lines and len(records) in extra_lines:
        out.append(extra_lines[len(records)])
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


#: The hand-computed ledger of test_report_values (values worked out in that file's docstring).
HAND = [
    record("r0", Outcome.COMPLETED, 0, 100, 500, 0.5, 10.5),  # A 0-1k
    record("r0", Outcome.TRUNCATED, 1, 200, 1000, 1.0, 21.0),  # B 1k-5k
    record("r0", Outcome.ABORTED, 2, 300, 200, 2.0, 4.0),  # C 0-1k
    record("r1", Outcome.ERROR, 3, 50, None, None, 1.0),  # D unknown
    record("r1", Outcome.COMPLETED, 4, 100, 6000, 0.2, 60.2),  # E 5k-10k
    record("r0", Outcome.COMPLETED, 5, 100, 999, 1.5, 11.5),  # F 0-1k
]
