"""Control characters an engine puts in a label value never reach /metrics raw.

An engine's ``model_name`` (or any label value it serves, or a served model name the proxy learns)
carrying ESC and BEL was exported as is: ``curl /metrics`` in a terminal then ran the escape
sequence. Every label value from outside now goes through ``kvwatch.safetext.terminal_safe``, the
same rule ``kvwatch top`` applies: each non-printable character is written as a visible escape.
"""

from __future__ import annotations

import httpx
from aiohttp import web

from kvwatch.agent import Agent
from kvwatch.config import Config, HostPort, IntervalsConfig, NvmlConfig, ReplicaConfig
from kvwatch.discovery.pods import judge_pod
from kvwatch.engines.registry import parse_exposition
from kvwatch.requests.accounting import ModelLabels
from tests.engines import hostile
from tests.local import serve_app, until

HOSTILE_MODEL = "evil\x1b[2J\x07\u202ename"
SHOWN = "evil\\x1b[2J\\x07\\u202ename"  # as kvwatch top shows it


def _page() -> str:
    return hostile.vllm_page().replace('model_name="tiny"', f'model_name="{HOSTILE_MODEL}"')


def test_a_label_value_is_read_with_its_control_characters_escaped() -> None:
    result = parse_exposition(_page(), "r0", "vllm")
    assert {s.model_name for s in result.samples} == {SHOWN}


async def test_metrics_carry_no_raw_control_character_from_an_engine() -> None:
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=_page(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner, port = await serve_app(app)
    listen = HostPort("127.0.0.1", 0)
    replica = ReplicaConfig(name="r0", metrics_url=f"http://127.0.0.1:{port}/metrics")
    agent = Agent(
        Config(
            replicas=(replica,),
            listen=listen,
            intervals=IntervalsConfig(engine_s=0.5),
            nvml=NvmlConfig(fake_gpus=0),
        )
    )
    await agent.start()
    try:
        async with httpx.AsyncClient() as client:

            async def scraped() -> str:
                text = (await client.get(f"http://127.0.0.1:{agent.port}/metrics", timeout=5)).text
                return text if "kvwatch_kv_capacity_tokens{" in text else ""

            text = await until(scraped, 10, "a scrape of the engine on /metrics", interval_s=0.2)
    finally:
        await agent.stop()
        await runner.cleanup()
    assert not any(ch in text for ch in "\x1b\x07\u202e")
    assert 'model_name="evil\\\\x1b[2J\\\\x07\\\\u202ename"' in text  # the text format escapes the backslash


def test_a_served_model_name_the_proxy_learns_is_escaped() -> None:
    labels = ModelLabels(set(), None)
    labels.learn([HOSTILE_MODEL])
    assert labels.label(None) == SHOWN
    assert labels.label(HOSTILE_MODEL) == SHOWN


def test_a_model_annotation_is_escaped() -> None:
    pod = {
        "metadata": {
            "namespace": "ns",
            "name": "p",
            "uid": "u",
            "annotations": {
                "kvwatch.io/scrape": "true",
                "kvwatch.io/port": "8000",
                "kvwatch.io/model": HOSTILE_MODEL,
            },
        },
        "spec": {"containers": [{"name": "c", "image": "vllm/vllm-openai"}]},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    verdict = judge_pod(pod)
    assert verdict.engine is not None and verdict.engine.model_name == SHOWN
