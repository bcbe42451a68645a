"""The HTTP load generator against simulated replicas: outcomes, patience, routing (loadgen.py)."""

from __future__ import annotations

import json

from kvwatch.sim.loadgen import LoadGenConfig, LoadGenerator
from kvwatch.sim.node import NodeConfig, SimNode
from kvwatch.sim.routing import RouterSpec
from kvwatch.sim.workload import LengthDist, Patience, RequestClass, WorkloadSpec, generate
from tests.local import until

from .helpers import small_config

SHORT = RequestClass(
    "short", prompt=LengthDist("fixed", 100), output=LengthDist("exponential", 150, high=600), max_tokens=400
)


async def settle(engines, timeout: float = 10.0) -> None:
    await until(lambda: not any(e.in_system for e in engines), timeout, "the engines to finish every request")


async def test_impatient_clients_abort_and_every_outcome_matches_the_engines():
    engine = small_config(
        block_size=16,
        num_gpu_blocks_override=200,
        max_model_len=1000,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    )
    node = SimNode(NodeConfig(engine=engine, replicas=2, speed=5.0, tick_s=0.01))
    await node.start()
    try:
        spec = WorkloadSpec(rate=60.0, classes=(SHORT,), patience=Patience(first_token_s=1.5), seed=4)
        requests = list(generate(spec, duration=15))
        gen = LoadGenerator(
            node.replica_urls,
            model=node.config.model_name,
            router=RouterSpec("round_robin"),
            config=LoadGenConfig(speed=5.0, chat_share=0.5, include_usage_share=0.5, seed=1),
        )
        async with gen:
            report = await gen.run(requests)
        await settle(node.engines)
    finally:
        await node.stop()
    engines = node.engines
    assert report.sent == len(requests) == sum(report.outcomes.values())
    assert report.outcomes["aborted"] > 0 and report.outcomes["completed"] > 0
    assert report.outcomes["truncated"] > 0 and report.outcomes["error"] == 0
    assert all(e.arrived == e.completed + e.truncated + e.aborted for e in engines)
    # The two sides may disagree, in the client's disfavour only: a client whose deadline passes while
    # the last bytes of a finished response are in flight, or before its request reached the server,
    # counts "aborted" where the engine counts "completed" or nothing (real races a proxy also sees).
    arrived = sum(e.arrived for e in engines)
    engine_aborted = sum(e.aborted for e in engines)
    engine_done = sum(e.completed + e.truncated for e in engines)
    client_done = report.outcomes["completed"] + report.outcomes["truncated"]
    assert arrived <= report.sent and client_done <= engine_done
    # most disconnects reach the engine as aborts
    assert engine_aborted <= report.outcomes["aborted"] <= 2 * engine_aborted
    assert abs(engines[0].arrived - engines[1].arrived) <= report.sent - arrived + 1  # round robin
    assert sum(e.preemptions_total for e in engines) > 0
    # usage-less streams are counted from the filler tokens: every finished one has its exact length
    done = [r for r in report.recent if r.outcome in ("completed", "truncated")]
    assert all(r.completion_tokens == min(r.target_tokens, 400) for r in done)
    bands = report.by_band(speed=5.0)
    assert bands["0-1k"]["count"] == len(done) and bands["0-1k"]["e2e_p99"] >= bands["0-1k"]["e2e_p50"]


async def test_leaving_without_drain_cancels_clients_and_frees_kv():
    engine = small_config(
        block_size=16,
        num_gpu_blocks_override=400,
        max_model_len=2000,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
    )
    node = SimNode(NodeConfig(engine=engine, replicas=1, speed=2.0, tick_s=0.01))
    await node.start()
    try:
        long = RequestClass("long", LengthDist("fixed", 50), LengthDist("fixed", 1500), max_tokens=1500)
        spec = WorkloadSpec(rate=20.0, classes=(long,), patience=Patience(first_token_s=None), seed=1)
        gen = LoadGenerator(node.replica_urls, model=node.config.model_name, config=LoadGenConfig(speed=2.0))
        async with gen:
            await gen.run(generate(spec, duration=1.0), duration=1.0, drain=False)
        await settle(node.engines)
        (e,) = node.engines
        assert e.arrived > 5 and e.aborted == e.arrived and e.used_blocks == 0
        assert gen.report.outcomes["aborted"] == gen.report.sent >= e.arrived  # some never reached it
    finally:
        await node.stop()


class _Content:
    def __init__(self, data: bytes, size: int) -> None:
        self._pieces = [data[i : i + size] for i in range(0, len(data), size)]

    async def iter_any(self):
        for piece in self._pieces:
            yield piece


class _Response:
    def __init__(self, data: bytes, size: int) -> None:
        self.content = _Content(data, size)


class _Limit:
    def reschedule(self, when) -> None:
        self.when = when


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks) + (
        b"data: [DONE]\n\n"
    )


async def test_stream_reader_finds_finish_and_usage_across_any_read_boundaries():
    big = " tok" * 5000  # one tick's worth at high speed: far larger than any read
    body = _sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": big}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5000, "total_tokens": 5003}},
    )
    no_usage = _sse({"choices": [{"index": 0, "text": " tok" * 1234, "finish_reason": "stop"}]})
    for size in (1, 3, 7, 64, 4096, 1 << 20):
        finish, tokens, ttft = await LoadGenerator._read_stream(_Response(body, size), _Limit(), 0.0, None)
        assert (finish, tokens) == ("length", 5000) and ttft is not None, size
        finish, tokens, _ = await LoadGenerator._read_stream(_Response(no_usage, size), _Limit(), 0.0, None)
        assert (finish, tokens) == ("stop", 1234), size
