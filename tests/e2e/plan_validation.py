"""Validation of ``kvwatch plan`` on the real CPU vLLM (docs/planning.md "Validation").

Two traces are sent to the real vLLM through ``kvwatch run``'s proxy by the official ``openai``
client at their arrival times, so both ledgers are kvwatch's real records. A real Prometheus
scrapes vLLM every second. The twin is calibrated twice: from vLLM's histograms in Prometheus
over trace A (``kvwatch plan calibrate --prometheus``) and from a short calibration load
(``--load``); it then replays each ledger, and its figures are compared with what was recorded:

* per band e2e p50 and p99: the ledger (kvwatch's proxy) against the twin;
* preemptions: vLLM's own ``vllm:num_preemptions_total`` over the trace against the twin's;
* peak KV usage: ``max_over_time(vllm:kv_cache_usage_perc)`` in Prometheus (1 s scrapes) against
  the twin's peak sampled every 1 simulated second.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from .stack import parse, select, total

BANDS = (128, 256)  # the tiny engine's outputs (32-400 tokens) span three bands: 0-128, 128-256, 256+
TARGETS = {"e2e_p50": 0.15, "e2e_p99": 0.25, "preemptions": 0.20, "peak_kv": 0.10}


@dataclass(frozen=True)
class TraceRequest:
    arrival: float
    prompt_words: int  # random numbers of ~5 tokens each: no shared prefixes
    max_tokens: int  # sent with ignore_eos: the output is exactly this long


def make_trace(seed: int, count: int, rate: float, burst: int = 0) -> list[TraceRequest]:
    """``burst`` requests at t=0 (prompts of 60-90 numbers, 300-400 tokens out), then ``count`` Poisson
    arrivals at ``rate``. The burst preempts on any machine: all of it is admitted onto the idle
    engine (each prompt needs 3-4 of the 19 usable 128-token blocks) and would then need ~6 blocks
    each, while the Poisson part alone preempts only when the engine is slow enough to fall behind."""
    rng = random.Random(seed)
    t = 0.0
    out = [TraceRequest(0.0, rng.randint(60, 90), rng.randint(300, 400)) for _ in range(burst)]
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(
            TraceRequest(
                t,
                rng.randint(15, 90),
                rng.choice([rng.randint(32, 127), rng.randint(128, 255), rng.randint(256, 400)]),
            )
        )
    return out


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(str(rng.randrange(10**5)) for _ in range(words))


def drive(
    base_url: str, trace: list[TraceRequest], seed: int, timeout_s: float = 240.0
) -> list[dict[str, Any]]:
    """Send every request at ``start + arrival`` (one thread each) through ``base_url`` (…/v1)."""
    rng = random.Random(seed)
    prompts = [_prompt(rng, r.prompt_words) for r in trace]
    results: list[dict[str, Any]] = [{} for _ in trace]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)
    start = time.monotonic() + 0.5

    def one(i: int) -> None:
        r = trace[i]
        time.sleep(max(0.0, start + r.arrival - time.monotonic()))
        chunks = 0
        try:
            stream = client.completions.create(
                model="tiny",
                prompt=prompts[i],
                max_tokens=r.max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                chunks += 1
            results[i] = {"chunks": chunks, "end": "complete"}
        except Exception as exc:  # any kind: a thread that dies leaves no result to explain the failure
            results[i] = {"chunks": chunks, "end": type(exc).__name__, "error": str(exc)[:300]}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(trace))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    client.close()
    return [result or {"end": "still running", "chunks": None} for result in results]


def unfinished(trace: list[TraceRequest], results: list[dict[str, Any]]) -> list[str]:
    """The requests that did not stream to the end, each with what the client saw."""
    return [
        f"#{i} {request}: {result}"
        for i, (request, result) in enumerate(zip(trace, results, strict=True))
        if result.get("end") != "complete"
    ]


def preemptions(metrics_url: str) -> float:
    return total(parse(httpx.get(metrics_url, timeout=30).text), "vllm:num_preemptions_total")


def peak_kv(prometheus_url: str, start: float, end: float) -> float:
    span = max(1, int(end - start) + 1)
    body = httpx.get(
        f"{prometheus_url}/api/v1/query",
        params={"query": f"max(max_over_time(vllm:kv_cache_usage_perc[{span}s]))", "time": end},
        timeout=30,
    ).json()
    return float(body["data"]["result"][0]["value"][1])


class PeakPoll:
    """vLLM's ``kv_cache_usage_perc`` read every ``interval_s`` while a trace runs: a tiny pool can
    fill and free again between Prometheus's 1 s scrapes (a clean-clone run sampled a peak of 17 of
    19 blocks in a trace that preempted 4 times), so the recorded peak is the higher of the two."""

    def __init__(self, metrics_url: str, interval_s: float = 0.2) -> None:
        self.metrics_url, self.interval_s = metrics_url, interval_s
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-kv-poll", daemon=True)

    def __enter__(self) -> PeakPoll:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(self.interval_s):
                try:
                    samples = parse(client.get(self.metrics_url).text)
                except httpx.HTTPError:
                    continue  # a busy engine's slow page: the next read or Prometheus covers it
                values = [s.value for s in select(samples, "vllm:kv_cache_usage_perc")]
                self.peak = max([self.peak, *values])


def split_ledger(ledger: Path, boundary: float, before: Path, after: Path) -> None:
    lines = [ln for ln in ledger.read_text().splitlines() if ln.strip()]
    early = [ln for ln in lines if json.loads(ln)["started_at"] < boundary]
    late = [ln for ln in lines if json.loads(ln)["started_at"] >= boundary]
    before.write_text("".join(ln + "\n" for ln in early))
    after.write_text("".join(ln + "\n" for ln in late))


def error(twin: float | None, recorded: float | None) -> float | None:
    if twin is None or recorded is None or recorded == 0:
        return None
    return (twin - recorded) / recorded


def compare(
    name: str, twin_result: Any, recorded_report: Any, recorded_preemptions: float, recorded_peak: float
) -> list[dict[str, Any]]:
    """One row per band (and all bands): recorded, twin, relative error, within target or not."""
    from kvwatch.report.summary import ALL

    rec = {r.length_band: r for r in recorded_report.rows_for(ALL)}
    rows = []
    for r in twin_result.report.rows_for(ALL):
        o = rec.get(r.length_band)
        if o is None or not o.requests:
            continue
        row = {"case": name, "band": "all" if r.length_band == ALL else r.length_band, "requests": o.requests}
        for key in ("e2e_p50", "e2e_p99"):
            attr = f"{key}_seconds"
            row[key] = {
                "recorded": getattr(o, attr),
                "twin": getattr(r, attr),
                "error": error(getattr(r, attr), getattr(o, attr)),
            }
        rows.append(row)
    node = twin_result.node
    rows.append(
        {
            "case": name,
            "band": "node",
            "preemptions": {
                "recorded": recorded_preemptions,
                "twin": node.preemptions,
                "error": error(node.preemptions, recorded_preemptions),
            },
            "peak_kv": {
                "recorded": recorded_peak,
                "twin": node.peak_kv_usage,
                "error": error(node.peak_kv_usage, recorded_peak),
            },
        }
    )
    for row in rows:
        for key, limit in TARGETS.items():
            if key in row:
                err = row[key]["error"]
                row[key]["met"] = err is not None and abs(err) <= limit
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The error table as markdown (docs/planning.md quotes it)."""

    def cell(m: dict[str, Any], fmt: str) -> str:
        err = m["error"]
        mark = "" if m.get("met") else " **miss**"
        return (
            f"{format(m['recorded'], fmt)} / {format(m['twin'], fmt)} / "
            f"{'n/a' if err is None else f'{err:+.0%}'}{mark}"
        )

    out = [
        "| case | band | requests | e2e p50 rec / twin / err | e2e p99 rec / twin / err | "
        "preemptions rec / twin / err | peak KV rec / twin / err |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            "| "
            + " | ".join(
                [
                    r["case"],
                    r["band"],
                    str(r.get("requests", "")),
                    cell(r["e2e_p50"], ".2f") if "e2e_p50" in r else "",
                    cell(r["e2e_p99"], ".2f") if "e2e_p99" in r else "",
                    cell(r["preemptions"], ".0f") if "preemptions" in r else "",
                    cell(r["peak_kv"], ".2f") if "peak_kv" in r else "",
                ]
            )
            + " |"
        )
    return "\n".join(out)
