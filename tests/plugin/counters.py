"""Reading the real vLLM's and the agent's expositions in the plugin tests: sums of counters by label,
and waiting until the agent has counted the plugin's requests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.agent.runtime import Agent
from tests.local import until


def families(text: str) -> dict[str, list]:
    """Family name -> its samples."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def total(fams: dict[str, list], name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` (a counter's ``name_total``; a histogram's ``name_sum``, ...)."""
    return sum(
        s.value
        for samples in fams.values()
        for s in samples
        if s.name in (name, f"{name}_total") and all(s.labels.get(k) == v for k, v in labels.items())
    )


def engine_counters(text: str) -> dict[str, float]:
    fams = families(text.replace("vllm:", "vllm_"))
    return {
        "preemptions": total(fams, "vllm_num_preemptions"),
        "local_compute": total(fams, "vllm_prompt_tokens_by_source", source="local_compute"),
        "generation": total(fams, "vllm_generation_tokens"),
        "finished": total(fams, "vllm_request_success"),
    }


async def agent_metrics(client: httpx.AsyncClient, agent: Agent) -> dict[str, list]:
    return families((await client.get(f"http://127.0.0.1:{agent.port}/metrics")).text)


async def wait_for_requests(
    client: httpx.AsyncClient, agent: Agent, n: int, recomputed_by: str | None = None, timeout_s: float = 60
) -> dict[str, list]:
    """Until the agent counted ``n`` plugin requests (and, given ``recomputed_by``, exported recomputed
    tokens of that source); its metrics then."""

    async def counted() -> dict[str, list] | None:
        fams = await agent_metrics(client, agent)
        done = total(fams, "kvwatch_requests", source="vllm_plugin") >= n
        recomputed = (
            recomputed_by is None or total(fams, "kvwatch_recomputed_tokens", source=recomputed_by) > 0
        )
        return fams if done and recomputed else None

    what = f"{n} plugin requests" + (f" and {recomputed_by} recomputed tokens" if recomputed_by else "")
    return await until(counted, timeout_s, what, interval_s=0.5)
