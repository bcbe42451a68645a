"""kvwatch's plugin inside the real CPU vLLM, against the engine's own counters and log.

One scenario per session (``observed``): requests while no agent listens; a kvwatch agent starts and a
preempting load runs (20 KV blocks of 128 tokens, six 300..1300-token answers); the agent stops,
a request runs unobserved, a new agent starts and one more request runs. The tests then compare
what kvwatch exported with instruments kvwatch did not write: vLLM's /metrics counters, the
engine's own per-iteration log lines (``--enable-logging-iteration-details``) and the usage the
engine returned to the client.

The engine is the session's shared vLLM: other tests may have used it (and its plugin dropped their
datagrams, no agent listening) before; the scenario waits until it is idle and compares deltas of its
counters and the log lines written after its own start.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvwatch.agent.runtime import Agent
from kvwatch.config import (
    Config,
    HostPort,
    IntervalsConfig,
    LedgerConfig,
    NvmlConfig,
    ReplicaConfig,
    VllmPluginSocketConfig,
)
from kvwatch.model import DEFAULT_BANDS
from tests.local import until, wait_vllm_idle

from .counters import engine_counters, total, wait_for_requests

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow]

MAX_TOKENS = (300, 500, 700, 900, 1100, 1300)  # 4 answers in 0-1k, 2 in 1k-5k; ~4800 tokens > 2560 slots
ITERATION = re.compile(
    r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, "
    r"(\d+) generation requests, (\d+) generation tokens"
)


@dataclass(frozen=True)
class Observed:
    unobserved_usage: list[dict]
    load_usage: list[dict]
    engine_delta: dict[str, float]  # vLLM's counters over the load
    scheduled_tokens: int  # sum of context + generation tokens of the engine's iteration log lines
    iterations: int  # the engine's iteration log lines during the load
    iterations_before: int  # the lines the engine logged since it started, before the load
    agent: dict[str, list]  # the first agent's /metrics after the load
    ledger: list[dict]
    restarted_agent: dict[str, list]


def agent_config(plugin, ledger: Path | None) -> Config:
    engine = plugin.engine
    return Config(
        replicas=(ReplicaConfig("r0", engine.metrics_url, backend="vllm", model_name="tiny"),),
        listen=HostPort("127.0.0.1", 0),
        intervals=IntervalsConfig(engine_s=1.0),
        nvml=NvmlConfig(enabled=False),
        vllm_plugin_sockets=(VllmPluginSocketConfig("r0", plugin.socket_path),),
        ledger=LedgerConfig(path=str(ledger)) if ledger else LedgerConfig(),
    )


async def complete(client: httpx.AsyncClient, base: str, max_tokens: int, i: int) -> dict:
    r = await client.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": f"request {i} " * 12, "max_tokens": max_tokens, "ignore_eos": True},
    )
    r.raise_for_status()
    return r.json()["usage"]


async def open_connections(client: httpx.AsyncClient, base: str, n: int) -> None:
    """``n`` keep-alive connections in the client's pool before the load, so that its requests all
    reach vLLM at once. Opened with the load, a new connection can take seconds: in a clean-clone
    run the two requests on pooled connections started at once and the four on new ones 2 s and 7 s
    later (vLLM's iteration log), so the KV cache never filled and nothing was preempted. The delays
    match SYN retransmits (1, 3, 7 s); that machine's kernel counted 398 listen-queue drops over the
    suite, which also floods sockets on purpose, so which socket dropped them is not known."""
    held, all_held = 0, asyncio.Event()

    async def hold() -> None:
        nonlocal held
        async with client.stream("GET", f"{base}/v1/models") as response:  # the connection is ours
            held += 1
            if held == n:
                all_held.set()
            await all_held.wait()  # until every one is: no request finds another's connection free
            await response.aread()  # read to the end, the connection goes back to the pool

    await asyncio.gather(*(hold() for _ in range(n)))


async def preempted_since(client: httpx.AsyncClient, metrics_url: str, before: dict[str, float]) -> bool:
    return engine_counters((await client.get(metrics_url)).text)["preemptions"] > before["preemptions"]


async def scenario(plugin, ledger: Path) -> Observed:
    engine = plugin.engine
    async with httpx.AsyncClient(timeout=180) as client:
        await asyncio.to_thread(
            wait_vllm_idle, engine.metrics_url, 120, "the shared vLLM to finish earlier tests"
        )
        unobserved = await asyncio.gather(*(complete(client, engine.base_url, 24, i) for i in range(2)))

        agent = Agent(agent_config(plugin, ledger))
        await agent.start()
        try:
            await open_connections(client, engine.base_url, len(MAX_TOKENS))
            before = engine_counters((await client.get(engine.metrics_url)).text)
            offset = engine.log.stat().st_size
            usage = await asyncio.gather(
                *(complete(client, engine.base_url, m, i) for i, m in enumerate(MAX_TOKENS))
            )
            await until(
                lambda: preempted_since(client, engine.metrics_url, before),
                10,
                "vLLM to count a preemption of the load (it needs all six requests running at once)",
            )
            fams = await wait_for_requests(client, agent, len(MAX_TOKENS), recomputed_by="vllm_plugin")
            after = engine_counters((await client.get(engine.metrics_url)).text)
            with engine.log.open("rb") as f:
                before_load = ITERATION.findall(f.read(offset).decode(errors="replace"))
                lines = ITERATION.findall(f.read().decode(errors="replace"))
        finally:
            await agent.stop()
        unobserved.append(await complete(client, engine.base_url, 24, 99))

        restarted = Agent(agent_config(plugin, None))
        await restarted.start()
        try:
            await complete(client, engine.base_url, 24, 100)
            restarted_fams = await wait_for_requests(client, restarted, 1)
        finally:
            await restarted.stop()
    ledger_lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    return Observed(
        unobserved,
        usage,
        {k: after[k] - before[k] for k in after},
        sum(int(ctx) + int(gen) for _, ctx, _, gen in lines),
        len(lines),
        len(before_load),
        fams,
        ledger_lines,
        restarted_fams,
    )


@pytest.fixture(scope="module")
def observed(plugin_vllm) -> Observed:
    # a directory of our own: parallel pytest runs on this machine prune each other's basetemp
    with tempfile.TemporaryDirectory(prefix="kvwatch-plugin-ledger-") as tmp:
        return asyncio.run(scenario(plugin_vllm, Path(tmp) / "ledger.jsonl"))


def test_vllm_keeps_serving_without_an_agent_and_the_drops_are_counted(observed):
    assert [u["completion_tokens"] for u in observed.unobserved_usage] == [24, 24, 24]
    first = total(observed.agent, "kvwatch_vllm_plugin_dropped_datagrams", replica="r0", dp_rank="0")
    later = total(
        observed.restarted_agent, "kvwatch_vllm_plugin_dropped_datagrams", replica="r0", dp_rank="0"
    )
    assert first > 0  # the steps of the two unobserved requests (batched: a few datagrams)
    assert later > first  # the request while no agent listened, then data resumed
    assert total(observed.restarted_agent, "kvwatch_requests", source="vllm_plugin") == 1


def test_per_request_preemptions_add_up_to_the_engines_counter(observed):
    assert observed.engine_delta["preemptions"] > 0, "the load did not preempt: the test proves nothing"
    per_request = total(observed.agent, "kvwatch_request_preemptions_sum", source="vllm_plugin")
    assert per_request == observed.engine_delta["preemptions"]


def test_exact_recomputed_tokens_equal_what_the_engine_recomputed(observed):
    """Every token the engine scheduled is a first prefill, a decode input, or a re-prefill:
    scheduled = local-compute prompt tokens + (generated - finished) + (re-prefilled - resumes),
    each resume re-prefilling the one token its decode step would have fed anyway."""
    d = observed.engine_delta
    recomputed = total(observed.agent, "kvwatch_recomputed_tokens", source="vllm_plugin")
    assert recomputed > 0
    assert not [s for s in observed.agent["kvwatch_recomputed_tokens"] if s.labels["source"] == "estimate"]
    engine_recomputed = observed.scheduled_tokens - d["local_compute"] - (d["generation"] - d["finished"])
    assert recomputed - d["preemptions"] == engine_recomputed


def test_per_band_counts_and_max_tokens_are_what_was_sent(observed):
    sent = Counter(DEFAULT_BANDS.band_for(m) for m in MAX_TOKENS)
    counted = Counter()
    for s in observed.agent["kvwatch_requests"]:
        if s.labels["source"] == "vllm_plugin" and s.value:
            assert s.labels["outcome"] == "truncated"  # ignore_eos: every answer ran to max_tokens
            counted[s.labels["length_band"]] += s.value
    assert counted == sent
    assert [u["completion_tokens"] for u in observed.load_usage] == list(MAX_TOKENS)
    plugin_lines = [line for line in observed.ledger if line["source"] == "vllm_plugin"]
    assert sorted(line["max_tokens"] for line in plugin_lines) == sorted(MAX_TOKENS)
    assert sorted(line["output_tokens"] for line in plugin_lines) == sorted(MAX_TOKENS)
    assert sum(line["preemptions"] for line in plugin_lines) == observed.engine_delta["preemptions"]
    ratio = total(observed.agent, "kvwatch_request_output_limit_ratio_sum", source="vllm_plugin")
    assert ratio == pytest.approx(len(MAX_TOKENS))


def test_every_iteration_the_engine_logged_is_a_step_sample_or_a_counted_drop(observed):
    """Since vLLM started, every iteration it logged is in kvwatch's step histogram or in the steps
    the plugin says it dropped: all of them before the agent started (nobody listened), and, on a
    machine starved enough to refuse a datagram, the few of the load that went with it."""
    steps = total(observed.agent, "kvwatch_engine_step_seconds_count", replica="r0")
    dropped_steps = total(observed.agent, "kvwatch_vllm_plugin_dropped_steps", replica="r0")
    results = {
        s.labels["result"]: s.value
        for s in observed.agent["kvwatch_vllm_plugin_datagrams"]
        if s.labels.get("replica") == "r0"
    }
    assert observed.iterations > sum(MAX_TOKENS) / 8  # at most 8 sequences per step
    assert observed.iterations_before > 0 and results["accepted"] > 0
    assert all(n == 0 for result, n in results.items() if result != "accepted"), results  # none refused
    assert steps + dropped_steps == observed.iterations_before + observed.iterations, (
        f"load: {observed.iterations} iterations, {steps} step samples; dropped steps since the engine "
        f"started {dropped_steps} of {observed.iterations_before} before the load"
    )
    assert steps >= 0.9 * observed.iterations  # losing datagrams under load is rare, never the rule
    lifetimes = total(observed.agent, "kvwatch_kv_block_lifetime_seconds_count", replica="r0")
    assert lifetimes > 0  # preempted and finished requests free blocks that get evicted
