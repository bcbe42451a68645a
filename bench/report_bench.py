"""``kvwatch report`` on a 1,000,000-line synthetic ledger, against naive readers in the same run.

The ledger is written with the proxy's own line builder (``kvwatch.requests.ledger.ledger_line``,
compact JSON, like ``RequestLedger``), from a reasoning workload: 8 replicas of 2 models, prompts
lognormal (median ~800 tokens), outputs exponential (mean 6,300 tokens) capped at max_tokens 32,000
(truncated), 3% aborted part-way, 1% upstream errors, 0.5% rejected (429, no tokens), TTFT
lognormal, TPOT growing with length, 23-bin inter-chunk gap counts. It is cached next to the
system's temp dir (``--ledger`` to choose), since writing it takes longer than reading it.

Measured, each as wall time:
  kvwatch    ``python -m kvwatch report LEDGER --csv --html --quiet`` in a subprocess (interpreter
             start, imports, read, summary, all three renderings): the number the target is about;
             with the default worker processes (every CPU for an input this size) and ``--jobs 1``.
  peers      on the first ``--peer-lines`` lines (default 100,000), per line, extrapolated to the
             ledger: ``json.loads`` per line into a DataFrame + the same groupby quantiles, and
             ``pandas.read_json(lines=True)``; the ratio is peer / kvwatch per line.

  .venv/bin/python -m bench.report_bench                 # 1M lines
  .venv/bin/python -m bench.report_bench --lines 200000 --peer-lines 50000
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench._harness import parser as bench_parser
from kvwatch import buckets
from kvwatch.model import DEFAULT_BANDS, Outcome, RequestRecord
from kvwatch.requests.ledger import ledger_line

ROOT = Path(__file__).resolve().parent.parent

REPLICAS = [(f"r{i}", "qwen3-32b" if i < 4 else "llama-3.1-70b") for i in range(8)]
MAX_TOKENS = 32000
GAP_BOUNDS = buckets.INTER_CHUNK_SECONDS


def _record(rng: np.random.Generator, started_at: float) -> RequestRecord:
    replica, model = REPLICAS[int(rng.integers(len(REPLICAS)))]
    prompt = int(np.clip(rng.lognormal(6.7, 0.7), 20, 30000))
    wanted = max(1, int(rng.exponential(6300)))
    fate = rng.random()
    if fate < 0.005:
        return RequestRecord(
            replica,
            model,
            "proxy",
            Outcome.REJECTED,
            started_at,
            endpoint="chat",
            streaming=True,
            status_code=429,
            max_tokens=MAX_TOKENS,
            e2e_seconds=float(rng.uniform(0.001, 0.01)),
            chunks=0,
        )
    output = min(wanted, MAX_TOKENS)
    outcome, finish, status = (
        (Outcome.TRUNCATED, "length", 200) if wanted >= MAX_TOKENS else (Outcome.COMPLETED, "stop", 200)
    )
    if fate < 0.035:
        output, outcome, finish = max(1, int(output * rng.random())), Outcome.ABORTED, None
    elif fate < 0.045:
        output, outcome, finish, status = max(1, int(output * rng.random())), Outcome.ERROR, None, 502
    ttft = float(rng.lognormal(-1.0 + prompt / 20000, 0.7))
    tpot = float(0.018 + 0.02 * output / MAX_TOKENS + abs(rng.normal(0, 0.004)))
    e2e = ttft + tpot * (output - 1)
    chunks = output
    counts = [0] * (len(GAP_BOUNDS) + 1)
    spread = rng.multinomial(max(chunks - 1, 0), [0.15, 0.6, 0.2, 0.05])
    for slot, n in zip((4, 5, 6, 8), spread, strict=True):
        counts[slot] += int(n)
    return RequestRecord(
        replica,
        model,
        "proxy",
        outcome,
        started_at,
        endpoint="chat",
        streaming=True,
        status_code=status,
        finish_reason=finish,
        prompt_tokens=prompt,
        output_tokens=output,
        output_tokens_estimated=bool(rng.random() < 0.002),
        max_tokens=MAX_TOKENS,
        ttft_seconds=ttft,
        e2e_seconds=e2e,
        chunks=chunks,
        gap_bounds=GAP_BOUNDS,
        gap_counts=tuple(counts),
        gap_sum=e2e - ttft,
    )


def write_ledger(path: Path, lines: int, seed: int = 7) -> None:
    rng = np.random.default_rng(seed)
    t = 1_750_000_000.0
    tmp = path.with_suffix(".partial")
    with tmp.open("w", encoding="utf-8") as fh:
        for i in range(lines):
            t += float(rng.exponential(0.05))
            fh.write(
                json.dumps(ledger_line(_record(rng, round(t, 6)), DEFAULT_BANDS), separators=(",", ":"))
                + "\n"
            )
            if i and i % 200_000 == 0:
                print(f"  written {i:,} lines", file=sys.stderr)
    tmp.replace(path)


def time_kvwatch(ledger: Path, out: Path, jobs: int | None = None) -> float:
    cmd = [
        sys.executable,
        "-m",
        "kvwatch",
        "report",
        str(ledger),
        "--csv",
        str(out / "bands.csv"),
        "--html",
        str(out / "report.html"),
        "--quiet",
    ]
    if jobs is not None:
        cmd += ["--jobs", str(jobs)]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.perf_counter() - start


def _head(ledger: Path, lines: int) -> bytes:
    out = io.BytesIO()
    with ledger.open("rb") as fh:
        for _ in range(lines):
            line = fh.readline()
            if not line:
                break
            out.write(line)
    return out.getvalue()


def time_json_loads(data: bytes) -> float:
    """The obvious reader: json.loads per line, a DataFrame, the same kind of groupby quantiles."""
    import pandas as pd

    start = time.perf_counter()
    records = [json.loads(line) for line in data.splitlines() if line.strip()]
    df = pd.DataFrame.from_records(
        records,
        columns=[
            "replica",
            "length_band",
            "outcome",
            "ttft_seconds",
            "tpot_seconds",
            "e2e_seconds",
            "output_tokens",
        ],
    )
    df.groupby(["replica", "length_band"])[
        ["ttft_seconds", "tpot_seconds", "e2e_seconds", "output_tokens"]
    ].quantile([0.5, 0.9, 0.99])
    return time.perf_counter() - start


def time_read_json(data: bytes) -> float:
    import pandas as pd

    start = time.perf_counter()
    pd.read_json(io.BytesIO(data), lines=True)
    return time.perf_counter() - start


def main() -> int:
    parser = bench_parser(__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--peer-lines", type=int, default=100_000)
    parser.add_argument("--ledger", type=Path, help="ledger path (written when missing)")
    parser.add_argument("--runs", type=int, default=3, help="kvwatch runs (best and median reported)")
    args = parser.parse_args()
    if args.quick:
        args.lines, args.peer_lines, args.runs = 2_000, 1_000, 1
    ledger = args.ledger or Path(tempfile.gettempdir()) / f"kvwatch-bench-ledger-{args.lines}.jsonl"
    if not ledger.exists():
        print(f"writing {args.lines:,}-line ledger to {ledger} ...", file=sys.stderr)
        write_ledger(ledger, args.lines)
    size_mib = ledger.stat().st_size / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        runs = sorted(time_kvwatch(ledger, Path(tmp)) for _ in range(args.runs))
        single = sorted(time_kvwatch(ledger, Path(tmp), jobs=1) for _ in range(args.runs))
    head = _head(ledger, args.peer_lines)
    peer_lines = head.count(b"\n")
    loads_s = time_json_loads(head)
    read_json_s = time_read_json(head)
    best, median = runs[0], runs[len(runs) // 2]
    per_line_us = median / args.lines * 1e6
    print(f"ledger: {args.lines:,} lines, {size_mib:,.0f} MiB ({ledger})")
    print(
        f"kvwatch report (subprocess, csv+html): best {best:.2f} s, median {median:.2f} s "
        f"of {args.runs} ({per_line_us:.2f} us/line); target < 10 s: {'met' if median < 10 else 'MISSED'}"
    )
    print(
        f"kvwatch report --jobs 1 (one process): best {single[0]:.2f} s, "
        f"median {single[len(single) // 2]:.2f} s"
    )
    for name, seconds in (
        ("json.loads per line + groupby", loads_s),
        ("pandas.read_json(lines=True)", read_json_s),
    ):
        per_line = seconds / peer_lines * 1e6
        print(
            f"peer {name}: {per_line:.2f} us/line on {peer_lines:,} lines "
            f"(~{per_line * args.lines / 1e6:.1f} s for the ledger), {per_line / per_line_us:.1f}x kvwatch"
        )
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
