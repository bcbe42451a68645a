"""An engine's absurd usage number (or a client's absurd max_tokens) no longer drops the request.

``completion_tokens`` of 1 followed by 400 zeros is valid JSON and a valid Python int; it used to
raise OverflowError in ``RequestRecord.tpot_seconds`` (int -> float), so the request went missing
from kvwatch_requests_total, the histograms and the ledger. Every count a request source takes from
outside is now range-checked (at most 2^31): the request is recorded with that field unknown and
named in ``dropped_values``, and counted in kvwatch_request_values_dropped_total{reason}.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.agent import Agent
from kvwatch.config import Config, HostPort, LedgerConfig, NvmlConfig, ReplicaConfig
from kvwatch.model import DEFAULT_BANDS, MAX_COUNT
from kvwatch.requests.accounting import inspect_request
from kvwatch.requests.ledger import ledger_line
from kvwatch.requests.otlp import records_from_export
from kvwatch.requests.sglang_files import line_record
from kvwatch.requests.vllm_plugin import decode
from tests.local import until
from tests.records import PLUGIN_DATAGRAM

from .otlp_spans import TOKENS, model_labels, one_replica, span_export
from .scripted import Script, ScriptedEngine

ABSURD = 10**400  # "1" and 400 zeros
LISTEN = HostPort("127.0.0.1", 0)


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


async def test_an_absurd_usage_count_through_the_proxy_is_recorded_and_counted(
    engine: ScriptedEngine, tmp_path: Path
) -> None:
    path = tmp_path / "ledger.jsonl"
    replica = ReplicaConfig(
        name="r0",
        metrics_url=f"{engine.url}/metrics",
        api_url=engine.url,
        proxy_listen=LISTEN,
        model_name="tiny",
    )
    agent = Agent(
        Config(
            replicas=(replica,),
            listen=LISTEN,
            nvml=NvmlConfig(fake_gpus=0),
            ledger=LedgerConfig(path=str(path)),
        )
    )
    engine.script = Script(completion_tokens=ABSURD)
    await agent.start()
    try:
        proxy = f"http://127.0.0.1:{agent.proxy_ports['r0']}"
        async with httpx.AsyncClient() as client:
            response = await client.post(
                f"{proxy}/v1/chat/completions",
                timeout=10,
                json={
                    "model": "tiny",
                    "stream": True,
                    "max_tokens": int("9" * 4001),
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            assert response.status_code == 200 and b"Hello" in response.content  # the stream is intact
            await until(lambda: agent.state.requests.observed == 1)
            text = (await client.get(f"http://127.0.0.1:{agent.port}/metrics")).text
    finally:
        await agent.stop()
    requests = _samples(text, "kvwatch_requests_total")
    assert sum(requests.values()) == 1  # the request is counted (it was missing before)
    dropped = _samples(text, "kvwatch_request_values_dropped_total")
    assert dropped == {
        (("reason", f"{field}_out_of_range"), ("replica", "r0"), ("source", "proxy")): 1.0
        for field in ("max_tokens", "output_tokens")
    }
    [line] = [json.loads(raw) for raw in path.read_text().splitlines()]
    assert line["output_tokens"] == 2 and line["output_tokens_estimated"] is True  # counted chunks instead
    assert line["max_tokens"] is None  # the client's 4,001 digits are not stored
    assert line["dropped_values"] == ["max_tokens", "output_tokens"]
    assert len(path.read_text()) < 2048


def test_absurd_counts_in_an_otlp_span_leave_the_field_unknown() -> None:
    export = span_export(
        {},
        **{
            TOKENS: 2**63 - 1,
            "gen_ai.usage.prompt_tokens": 5,
            "gen_ai.latency.e2e": 2.0,
            "gen_ai.latency.time_to_first_token": 1.0,
        },
    )
    [record], results = records_from_export(export, one_replica(), model_labels())
    assert results["request"] == 1
    assert (record.output_tokens, record.prompt_tokens) == (None, 5)
    assert record.dropped_values == ("output_tokens",)
    assert record.tpot_seconds is None
    ledger_line(record, DEFAULT_BANDS)  # encodes


def test_absurd_counts_in_a_plugin_datagram_keep_its_requests() -> None:
    finished = {**PLUGIN_DATAGRAM["f"][0], "output": ABSURD, "preemptions": ABSURD}
    busy = {**PLUGIN_DATAGRAM["s"][0], "run": ABSURD, "it": [1, ABSURD, 1, 1, 2.0]}
    datagram = json.dumps({**PLUGIN_DATAGRAM, "s": [busy], "f": [finished]}).encode()
    decoded = decode(datagram, "r0", "tiny")
    [record] = decoded.records
    assert (record.output_tokens, record.preemptions, record.prompt_tokens) == (None, None, 3)
    assert record.dropped_values == ("output_tokens", "preemptions")
    [step] = decoded.steps
    assert (step.running, step.ctx_tokens, step.ctx_requests) == (None, None, 1)
    assert decoded.dropped_step_values == ("step_ctx_tokens", "step_run")


def test_absurd_counts_in_an_sglang_file_line_keep_the_request() -> None:
    line = {
        "completion_tokens": ABSURD,
        "prompt_tokens": 4,
        "e2e_latency": 1.0,
        "decode_throughput": 10.0,
        "finish_reason": {"type": "stop", "status_code": 10**30},
        "request_parameters": json.dumps({"sampling_params": {"max_new_tokens": ABSURD}}),
    }
    record = line_record(line, "r0", "tiny", now=1.7e9)
    assert (record.output_tokens, record.max_tokens, record.status_code) == (None, None, None)
    assert record.dropped_values == ("output_tokens", "max_tokens")
    assert record.tpot_seconds is None


@pytest.mark.parametrize(("limit", "stored"), [(MAX_COUNT, MAX_COUNT), (MAX_COUNT + 1, None), (16, 16)])
def test_a_client_max_tokens_is_bounded(limit: int, stored: int | None) -> None:
    info = inspect_request(json.dumps({"max_tokens": limit}).encode(), "chat")
    assert (info.max_tokens, info.max_tokens_out_of_range) == (stored, stored is None)


def test_an_sglang_finish_reason_reaches_the_ledger_only_as_a_short_plain_token() -> None:
    huge = {"completion_tokens": 3, "finish_reason": {"type": "x" * 100_000 + "\x1b"}}
    assert line_record(huge, "r0", "tiny", now=1.7e9).finish_reason == "other"
    assert (
        line_record({"completion_tokens": 3, "finish_reason": "stop"}, "r0", "tiny", now=1.7e9).finish_reason
        == "stop"
    )


def test_an_absurd_dropped_count_in_a_plugin_header_is_unknown_and_metrics_still_render() -> None:
    """The header's cumulative drop counts went into PluginStats as they were: float() of 1 and 400
    zeros then failed the plugin export area on every scrape after."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from kvwatch.export.plugin import PluginCollector
    from kvwatch.state import NodeState

    datagram = json.dumps({"v": 1, "e": 0, "t": 1.7e9, "p": 7, "n": 1, "d": ABSURD, "ds": ABSURD}).encode()
    decoded = decode(datagram, "r0", "tiny")
    assert (decoded.link.dropped, decoded.link.dropped_steps) == (None, None)
    state = NodeState("node", DEFAULT_BANDS)
    state.plugin.observe(decoded.link, None)
    registry = CollectorRegistry()
    registry.register(PluginCollector(state, Config()))
    assert b"kvwatch_vllm_plugin_dropped_steps_total{" in generate_latest(registry)
