"""kvwatch's plugin in a real CPU vLLM started with ``--no-enable-prefix-caching`` and a KV cache small
enough to preempt (10 blocks of 128 tokens, four answers of 300..600 tokens).

vLLM then records no prefix-cache lookups, yet sends zeroed ``PrefixCacheStats`` every step: the plugin
once reported that as an exact recompute of 0 in the middle of a preemption storm, in place of the
estimate. And one request without ``max_tokens``: vLLM's /v1/completions takes 16 for it (chat
completions the remaining context), which the plugin once reported as the client's limit.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import httpx
import pytest

from kvwatch.agent.runtime import Agent
from kvwatch.config import (
    Config,
    HostPort,
    IntervalsConfig,
    NvmlConfig,
    ReplicaConfig,
    VllmPluginSocketConfig,
)
from tests.local import CACHE, free_port, start_vllm, stop_group
from tests.plugin.counters import engine_counters, total, wait_for_requests

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = (300, 400, 500, 600)  # ~1,950 tokens at the end into 1,280 KV slots: preemptions


async def scenario(base: str, socket_path: str) -> tuple[dict, dict[str, float], dict[str, float]]:
    config = Config(
        replicas=(ReplicaConfig("r0", f"{base}/metrics", backend="vllm", model_name="tiny"),),
        listen=HostPort("127.0.0.1", 0),
        intervals=IntervalsConfig(engine_s=0.5),
        nvml=NvmlConfig(enabled=False),
        vllm_plugin_sockets=(VllmPluginSocketConfig("r0", socket_path),),
    )
    agent = Agent(config)
    await agent.start()
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            before = engine_counters((await client.get(f"{base}/metrics")).text)

            async def complete(i: int, max_tokens: int | None) -> None:
                body = {"model": "tiny", "prompt": f"request {i} " * 12, "ignore_eos": True}
                if max_tokens is not None:
                    body["max_tokens"] = max_tokens
                (await client.post(f"{base}/v1/completions", json=body)).raise_for_status()

            await asyncio.gather(*(complete(i, m) for i, m in enumerate(MAX_TOKENS)))
            await complete(99, None)  # no max_tokens: /v1/completions reads it as 16
            after = engine_counters((await client.get(f"{base}/metrics")).text)
            # until the agent has all five requests and has scraped the engine (the estimate needs both)
            fams = await wait_for_requests(client, agent, 5, recomputed_by="estimate")
    finally:
        await agent.stop()
    return fams, before, after


def test_without_prefix_caching_the_estimate_stays_and_an_unset_max_tokens_is_unknown():
    with tempfile.TemporaryDirectory(prefix="kvwatch-nopc-") as tmp:
        socket_path = str(Path(tmp) / "vllm.sock")
        port = free_port()
        log = CACHE / "kvwatch-vllm" / f"vllm-test-nopc-{port}.log"
        env = {
            "KVWATCH_VLLM_SOCKET": socket_path,
            "PYTHONPATH": str(ROOT / "plugins" / "vllm"),
            "KV_BLOCKS": "10",
            "MAX_MODEL_LEN": "1024",
        }
        pid = start_vllm(port, log, "--no-enable-prefix-caching", env)
        try:
            fams, before, after = asyncio.run(scenario(f"http://127.0.0.1:{port}", socket_path))
        finally:
            stop_group(pid)
    assert after["preemptions"] > before["preemptions"], "the load did not preempt: the test proves nothing"
    sources = {s.labels["source"] for s in fams["kvwatch_recomputed_tokens"]}
    assert "vllm_plugin" not in sources  # vLLM counted no lookups: nothing exact to say
    assert total(fams, "kvwatch_recomputed_tokens", source="estimate") > 0
    assert total(fams, "kvwatch_requests", source="vllm_plugin") == 5
    # the four limits the client set, not the one vLLM resolved for the request without one
    assert total(fams, "kvwatch_request_output_limit_ratio_count", source="vllm_plugin") == 4
