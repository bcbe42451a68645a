"""The reference node of docs/scale.md, served by the real agent in this process: 8 replicas whose
engines serve a real vLLM 0.13 + LMCache + Dynamo capture, 8 fake H200s (NVLink, 2 processes and
2 XIDs each), proxies on, a request of every band x outcome finished and one in flight per
admission band. Shared by the scale test and ``bench/exposition_size.py``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.agent import Agent
from kvwatch.config import config_from_mapping
from kvwatch.gpu.fake import FakeNvml
from kvwatch.model import InFlightRequest, Outcome, RequestRecord
from tests.local import serve_app, until

ROOT = Path(__file__).resolve().parents[2]
CAPTURE = ROOT / "tests/fixtures/engines/captured/vllm-0.13-0.14-v1-lmcache-dynamo-2026-01-2.prom"
MODEL = "qwen3-32b"

#: one output length per band (default edges 1k/5k/10k/20k), None = unknown
BAND_OUTPUTS = (300, 3000, 7000, 15000, 25000, None)


async def _serve_captures(replicas: int) -> tuple[web.AppRunner, str]:
    """One local server answering /r<i>/metrics with a real vLLM + LMCache + Dynamo capture."""
    text = CAPTURE.read_text()

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.add_routes([web.get(f"/r{i}/metrics", metrics) for i in range(replicas)])
    runner, port = await serve_app(app, access_log=None)
    return runner, f"http://127.0.0.1:{port}"


def _record(
    replica: str, outcome: Outcome, output: int | None, gap_bounds: tuple[float, ...]
) -> RequestRecord:
    gaps = [0] * (len(gap_bounds) + 1)
    gaps[3] = 10
    return RequestRecord(
        replica=replica,
        model_name=MODEL,
        source="proxy",
        outcome=outcome,
        started_at=time.time(),
        prompt_tokens=1000,
        output_tokens=output,
        max_tokens=32000,
        ttft_seconds=0.4,
        e2e_seconds=60.0,
        gap_bounds=gap_bounds,
        gap_counts=tuple(gaps),
        gap_sum=0.2,
        output_tokens_estimated=output is not None,
    )


def _series(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0) + 1
    return out


@asynccontextmanager
async def reference_node(
    profile: str = "lean",
    replicas: int = 8,
    gpus: int = 8,
    processes_per_gpu: int = 2,
    xids: tuple[int, ...] = (13, 79),
) -> AsyncIterator[Agent]:
    """The running agent once every family is populated: two engine scrapes (headroom needs a
    baseline), a GPU poll, the GPU mapping and the XIDs."""
    runner, base = await _serve_captures(replicas)
    fake = FakeNvml(gpus)
    config = config_from_mapping(
        {
            "node": "full-node",
            "listen": "127.0.0.1:0",
            "log_level": "error",
            "metrics": {"profile": profile},
            "intervals": {"engine": "0.3s", "gpu": "0.3s", "process_map": "0.3s"},
            "replicas": [
                {
                    "name": f"replica-{i}",
                    "backend": "vllm",
                    "metrics_url": f"{base}/r{i}/metrics",
                    "api_url": f"{base}/r{i}",
                    "proxy_listen": "127.0.0.1:0",
                    "model_name": MODEL,
                    "gpus": [str(i)],
                }
                for i in range(replicas)
            ],
        }
    )
    agent = Agent(config, nvml=fake)
    await agent.start()
    try:
        gap_bounds = agent.state.requests.bounds["kvwatch_request_inter_chunk_seconds"]
        for replica in config.replicas:
            for output in BAND_OUTPUTS:
                for outcome in Outcome:
                    agent.record(_record(replica.name, outcome, output, gap_bounds))
            for band in config.length_bands.all_names:
                agent.state.in_flight.start(
                    InFlightRequest(replica.name, MODEL, band, 1000, 10, time.time(), 16000)
                )
        for gpu in range(gpus):
            for p in range(processes_per_gpu):
                fake.add_process(gpu, 4000 + 10 * gpu + p, 40 << 30)
            for xid in xids:
                fake.inject_xid(gpu, xid)
        async with httpx.AsyncClient() as client:

            async def populated() -> bool:
                page = await client.get(f"http://127.0.0.1:{agent.port}/metrics", timeout=10)
                series = _series(page.text)
                return (
                    series.get("kvwatch_kv_headroom_seconds") == replicas
                    and series.get("kvwatch_gpu_xid_errors_total") == gpus * len(xids)
                    and series.get("kvwatch_replica_gpu_info") == replicas
                )

            await until(populated, 30, "every replica's headroom, XIDs and GPU info", interval_s=0.3)
        yield agent
    finally:
        await agent.stop()
        await runner.cleanup()
