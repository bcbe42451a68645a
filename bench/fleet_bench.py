"""What a fleet of kvwatch nodes costs one real Prometheus: head series, memory, CPU, rule evaluation.

One real Prometheus (Debian's /usr/bin/prometheus) scrapes N node-shaped exporters: each serves
kvwatch's real HTTP app (``export/server.py``: text, or protobuf with native histograms when the
scrape asks) over a full 8-replica x 8-GPU node's state (``agent_bench.build_state``: a real vLLM
capture per replica, every band and outcome, fake GPUs), refreshed and fed requests every few
seconds so every counter moves and the rules have rates to compute. All N share one state (the
series differ by ``instance``), served from this process on N ports.

Phases, each with a fresh Prometheus and TSDB, measured in the same run so they can be compared:

* ``baseline``: no targets, the shipped rule files: what Prometheus costs by itself;
* ``<profile>``: N kvwatch nodes, text exposition, the shipped rules (``alerts/*.rules.yaml``);
* ``<profile>-native``: the same with ``--enable-feature=native-histograms`` and the native rules
  (``alerts/native/``);
* ``vllm``: the peer: N nodes x 8 vLLM engines serving the same real capture kvwatch parses, no
  rules: what the engines' own /metrics cost.

Reported per phase and per node: head series (kvwatch's scraped series, recorded series), resident
memory of the Prometheus process above the baseline phase, its CPU above the baseline phase per
node and scrape interval (scraping, ingesting and evaluating the rules: Prometheus does not split
its CPU by task), the wall time of all rule groups' evaluations per cycle
(``prometheus_rule_group_duration_seconds``) and the average scrape duration. Bytes per sample on
disk need a compaction (2 h blocks) and are not measured.

``--profile`` is the exporter's metrics profile; a profile this kvwatch does not know is an error
(``lean``, the default, or ``full``).

Usage:  flock /tmp/kvwatch-heavy.lock .venv/bin/python -m bench.fleet_bench [--nodes 20]
        [--interval 10] [--window 60] [--profile full] [--phases baseline,full,full-native,vllm]
Results are recorded in docs/scale.md ("The fleet, measured").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from aiohttp import web

from bench._harness import listen
from bench.agent_bench import CAPTURE, REPLICAS, build_state, kvwatch_registry
from bench.proxybench.common import free_port

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_RULES = sorted((ROOT / "alerts").glob("*.rules.yaml"))
NATIVE_RULES = sorted((ROOT / "alerts" / "native").glob("*.rules.yaml"))
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Phase:
    name: str
    kind: str  # baseline | kvwatch | vllm
    native: bool = False


def proc_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Exporters:
    """N kvwatch node exporters (one shared state) and N x 8 vLLM engine pages, on their own ports."""

    def __init__(self, nodes: int, profile: str) -> None:
        extra = {"metrics": {"profile": profile}}  # named always: the default is lean
        self.state, self.config, self.refresh = build_state(extra)
        self.nodes = nodes
        self.runner: web.AppRunner | None = None
        self.engine_runner: web.AppRunner | None = None
        self.node_targets: list[str] = []
        self.engine_targets: list[str] = []

    async def start(self) -> None:
        from kvwatch.export.server import metrics_app

        self.refresh(time.time())
        self.runner = web.AppRunner(
            metrics_app(kvwatch_registry(self.state, self.config), lambda: True), access_log=None
        )
        await self.runner.setup()
        for _ in range(self.nodes):
            self.node_targets.append(f"127.0.0.1:{await listen(self.runner)}")
        text = CAPTURE.read_text()

        async def engine(_request: web.Request) -> web.Response:
            return web.Response(text=text, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", engine)
        self.engine_runner = web.AppRunner(app, access_log=None)
        await self.engine_runner.setup()
        for _ in range(self.nodes * REPLICAS):
            self.engine_targets.append(f"127.0.0.1:{await listen(self.engine_runner)}")

    async def keep_moving(self, every_s: float) -> None:
        """Refresh the engines' samples and finish a few requests per band, as a busy node would."""
        from kvwatch.model import Outcome, RequestRecord

        gaps = self.state.requests.bounds["kvwatch_request_inter_chunk_seconds"]
        i = 0
        while True:
            await asyncio.sleep(every_s)
            self.refresh(time.time())
            for rep in self.config.replicas:
                for out in (300, 3000, 7000, 15000, 25000):
                    i += 1
                    bins = [0] * (len(gaps) + 1)
                    bins[i % len(bins)] = out - 1
                    self.state.requests.observe(
                        RequestRecord(
                            replica=rep.name,
                            model_name="Qwen/Qwen3-0.6B",
                            source="proxy",
                            outcome=list(Outcome)[i % 5],
                            started_at=time.time(),
                            prompt_tokens=1000,
                            output_tokens=out,
                            max_tokens=32000,
                            ttft_seconds=0.05 * (i % 40),
                            e2e_seconds=30.0 + i % 300,
                            gap_bounds=gaps,
                            gap_counts=tuple(bins),
                            gap_sum=0.03 * out,
                        )
                    )

    async def stop(self) -> None:
        for runner in (self.runner, self.engine_runner):
            if runner is not None:
                await runner.cleanup()


class Prometheus:
    def __init__(self, workdir: Path, phase: Phase, targets: list[str], interval_s: int) -> None:
        self.workdir = workdir / phase.name
        self.workdir.mkdir(parents=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        job = "vllm" if phase.kind == "vllm" else "kvwatch"
        rules = [] if phase.kind == "vllm" else (NATIVE_RULES if phase.native else SHIPPED_RULES)
        interval = f"{interval_s}s"
        config = {
            "global": {
                "scrape_interval": interval,
                "evaluation_interval": interval,
                "scrape_timeout": interval,
            },
            "rule_files": [str(p) for p in rules],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}]
            if targets
            else [],
        }
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.args = [
            shutil.which("prometheus") or "/usr/bin/prometheus",
            f"--config.file={self.workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
            *(["--enable-feature=native-histograms"] if phase.native else []),
        ]
        self.proc: subprocess.Popen | None = None

    async def start(self) -> None:
        log = (self.workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + 180
        async with httpx.AsyncClient() as client:
            while True:
                if self.proc.poll() is not None:
                    log_text = (self.workdir / "prometheus.log").read_text()[-2000:]
                    raise SystemExit(f"prometheus exited: {log_text}")
                try:
                    if (await client.get(f"{self.url}/-/ready", timeout=2)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("prometheus did not get ready in 180 s")
                await asyncio.sleep(0.5)

    async def own(self) -> dict[str, float]:
        """Prometheus's own /metrics (it does not scrape itself here), summed by metric name."""
        from prometheus_client.parser import text_string_to_metric_families

        async with httpx.AsyncClient() as client:
            text = (await client.get(f"{self.url}/metrics", timeout=30)).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    async def query(self, expr: str) -> float:
        async with httpx.AsyncClient() as client:
            body = (await client.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)).json()
        result = body["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


async def run_phase(
    phase: Phase, exporters: Exporters, workdir: Path, interval_s: int, window_s: int
) -> dict[str, Any]:
    by_kind = {"baseline": [], "kvwatch": exporters.node_targets, "vllm": exporters.engine_targets}
    targets = by_kind[phase.kind]
    prom = Prometheus(workdir, phase, targets, interval_s)
    t0 = time.monotonic()
    await prom.start()
    started_s = time.monotonic() - t0
    try:
        await asyncio.sleep(3 * interval_s)  # a few scrapes and rule evaluations: every series exists
        assert prom.proc is not None
        cpu0, wall0, own0 = proc_cpu(prom.proc.pid), time.monotonic(), await prom.own()
        await asyncio.sleep(window_s)
        cpu1, wall1, own1 = proc_cpu(prom.proc.pid), time.monotonic(), await prom.own()
        job = "vllm" if phase.kind == "vllm" else "kvwatch"

        def delta(name: str) -> float:
            return own1.get(name, 0.0) - own0.get(name, 0.0)

        scraped = f'{{job="{job}", __name__!~"ALERTS.*"}}'
        out = {
            "phase": phase.name,
            "targets": len(targets),
            "prometheus_start_s": round(started_s, 1),
            "head_series": own1.get("prometheus_tsdb_head_series", 0.0),
            "scraped_series": await prom.query(f"count({scraped})"),
            "recorded_series": await prom.query('count({__name__=~"kvwatch:.+"})'),
            "rss_bytes": proc_rss(prom.proc.pid),
            "cpu_s": cpu1 - cpu0,
            "wall_s": wall1 - wall0,
            "rule_eval_s": delta("prometheus_rule_group_duration_seconds_sum"),
            "rule_evals": delta("prometheus_rule_group_duration_seconds_count"),
            "scrapes": delta("prometheus_target_interval_length_seconds_count"),
            "scrape_duration_avg_s": await prom.query(f'avg(scrape_duration_seconds{{job="{job}"}})'),
            "scrape_samples_per_target": await prom.query(f'avg(scrape_samples_scraped{{job="{job}"}})'),
        }
        return out
    finally:
        prom.stop()


def report(results: list[dict[str, Any]], nodes: int) -> str:
    base = next((r for r in results if r["phase"] == "baseline"), None)
    lines = [
        f"{nodes} nodes; per node = above the baseline phase, divided by the nodes "
        "(vllm: a node = 8 engines)",
        "",
        "| phase | scraped series / node | recorded series / node | head series | RSS MiB | "
        "RSS / node MiB | CPU % of a core | CPU ms / node / interval | rule eval ms / cycle | "
        "scrape ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        per_node = nodes if r["targets"] else 1
        rss_node = (r["rss_bytes"] - base["rss_bytes"]) / per_node / 2**20 if base and r["targets"] else 0.0
        cycles = r["wall_s"] / r["interval_s"]
        base_cpu = base["cpu_s"] / base["wall_s"] * r["wall_s"] if base else 0.0
        cpu_node = 1000 * max(r["cpu_s"] - base_cpu, 0.0) / (per_node * cycles) if r["targets"] else 0.0
        lines.append(
            f"| {r['phase']} | {r['scraped_series'] / per_node:,.0f} | "
            f"{r['recorded_series'] / per_node:,.0f} | {r['head_series']:,.0f} | "
            f"{r['rss_bytes'] / 2**20:,.0f} | {rss_node:.1f} | {100 * r['cpu_s'] / r['wall_s']:.1f} | "
            f"{cpu_node:.1f} | {1000 * r['rule_eval_s'] / cycles:.1f} | "
            f"{1000 * r['scrape_duration_avg_s']:.1f} |"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    exporters = Exporters(args.nodes, args.profile)
    await exporters.start()
    mover = asyncio.create_task(exporters.keep_moving(min(5.0, args.interval / 2)))
    results = []
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-fleet-bench-"))
    phases = {
        "baseline": Phase("baseline", "baseline"),
        args.profile: Phase(args.profile, "kvwatch"),
        f"{args.profile}-native": Phase(f"{args.profile}-native", "kvwatch", native=True),
        "vllm": Phase("vllm", "vllm"),
    }
    try:
        for name in args.phases.replace("full", args.profile).split(","):
            result = await run_phase(phases[name], exporters, workdir, args.interval, args.window)
            result["interval_s"] = args.interval
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        mover.cancel()
        await exporters.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--interval", type=int, default=10, help="scrape and rule evaluation interval, s")
    parser.add_argument("--window", type=int, default=60, help="measurement window per phase, s")
    parser.add_argument("--profile", default="full", help="the exporters' metrics profile (default: full)")
    parser.add_argument("--phases", default="baseline,full,full-native,vllm")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    print(report(results, args.nodes))


if __name__ == "__main__":
    main()
