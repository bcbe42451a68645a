"""The proxy's request numbers match the definitions, and clients get exactly the engine's bytes.

Timing tolerance: the scripted engine, the proxy and the test client share one process and one
monotonic clock (``time.perf_counter``), so kvwatch's TTFT and e2e are checked with exact
inequalities: at least what the engine itself took (kvwatch received the request before the engine
did, and relayed each chunk after the engine wrote it) and at most what the client saw (the client
sent before kvwatch received and read after kvwatch wrote). Gap bins are compared with the bins of
the gaps the client observed; scripted gaps sit at least 25 ms from any bucket boundary, far more
than one loop turn between kvwatch's write and the client's read.
"""

from __future__ import annotations

import bisect
import itertools
import json

from aiohttp import ClientSession

from kvwatch import buckets
from kvwatch.model import Outcome

from .bodies import CHAT_MAX_64_TOKENS
from .scripted import ProxyHarness, Script, ScriptedEngine
from .timed_stream import stream

COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 64}


def _bins(gaps: list[float]) -> tuple[int, ...]:
    bins = [0] * (len(buckets.INTER_CHUNK_SECONDS) + 1)
    for g in gaps:
        bins[bisect.bisect_left(buckets.INTER_CHUNK_SECONDS, g)] += 1
    return tuple(bins)


async def test_ttft_gaps_e2e_and_tpot_follow_the_definitions(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    gaps = [0.4, 0.6, 0.175, 0.4]
    engine.script = Script(contents=[(0.15, "a"), *((g, "x") for g in gaps)], completion_tokens=9)
    seen_by_client = await stream(
        http, f"{proxy.url}/v1/chat/completions", {**CHAT_MAX_64_TOKENS, "stream": True}
    )
    [record] = proxy.records
    [seen] = engine.seen

    assert record.outcome is Outcome.COMPLETED and record.finish_reason == "stop"
    assert (record.output_tokens, record.output_tokens_estimated, record.prompt_tokens) == (9, False, 11)
    assert record.prompt_tokens_estimate is None  # the engine counted it: no estimate beside the count
    assert record.chunks == 5 and record.streaming and record.endpoint == "chat"

    engine_ttft = seen.writes[0] - seen.received
    client_ttft = seen_by_client["arrivals"][0] - seen_by_client["sent"]
    assert engine_ttft <= record.ttft_seconds <= client_ttft

    engine_e2e = seen.done_at - seen.received
    client_e2e = seen_by_client["ended"] - seen_by_client["sent"]
    assert engine_e2e <= record.e2e_seconds <= client_e2e

    arrivals = seen_by_client["arrivals"]
    client_gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert record.gap_counts == _bins(client_gaps) == _bins(gaps)
    assert abs(record.gap_sum - sum(client_gaps)) < 0.05
    assert record.gap_bounds == buckets.INTER_CHUNK_SECONDS

    assert record.tpot_seconds == (record.e2e_seconds - record.ttft_seconds) / 8


async def test_role_chunk_with_empty_content_does_not_start_ttft(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    engine.script = Script(contents=[(0.3, "late")])
    await stream(http, f"{proxy.url}/v1/chat/completions", {**CHAT_MAX_64_TOKENS, "stream": True})
    [record] = proxy.records
    assert record.ttft_seconds >= 0.3  # the role chunk went out at once; the first text after 0.3 s


async def test_reasoning_only_chunks_are_content(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    engine.script = Script(contents=[(0.2, "thinking"), (0.0, "more")], reasoning=True)
    await stream(http, f"{proxy.url}/v1/chat/completions", {**CHAT_MAX_64_TOKENS, "stream": True})
    [record] = proxy.records
    assert record.chunks == 2 and 0.2 <= record.ttft_seconds < 5


async def test_client_without_include_usage_gets_the_engines_exact_bytes_chat(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    body = {**CHAT_MAX_64_TOKENS, "stream": True}
    direct = await stream(http, f"{engine.url}/v1/chat/completions", body)
    proxied = await stream(http, f"{proxy.url}/v1/chat/completions", body)
    assert b'"usage"' not in direct["raw"]
    assert proxied["raw"] == direct["raw"]
    injected = engine.seen[-1].body  # kvwatch asked the engine for usage, and got it
    assert json.loads(injected)["stream_options"] == {"include_usage": True}
    assert proxy.records[-1].output_tokens == 2 and not proxy.records[-1].output_tokens_estimated


async def test_client_without_include_usage_gets_the_engines_exact_bytes_completions(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    engine.script = Script(contents=[(0.0, "one"), (0.01, " two"), (0.0, " three")], completion_tokens=5)
    body = {**COMPLETION, "stream": True}
    direct = await stream(http, f"{engine.url}/v1/completions", body)
    proxied = await stream(http, f"{proxy.url}/v1/completions", body)
    assert proxied["raw"] == direct["raw"] and b'"usage"' not in proxied["raw"]
    record = proxy.records[-1]
    assert (record.endpoint, record.output_tokens, record.chunks) == ("completions", 5, 3)


async def test_final_chunk_waits_for_a_usage_chunk_written_separately(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    engine.script = Script(usage_delay=0.2)
    body = {**CHAT_MAX_64_TOKENS, "stream": True}
    direct = await stream(http, f"{engine.url}/v1/chat/completions", body)
    proxied = await stream(http, f"{proxy.url}/v1/chat/completions", body)
    assert proxied["raw"] == direct["raw"]
    assert proxy.records[-1].output_tokens == 2 and not proxy.records[-1].output_tokens_estimated


async def test_client_that_asks_for_usage_gets_the_usage_chunk(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    body = {**CHAT_MAX_64_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    direct = await stream(http, f"{engine.url}/v1/chat/completions", body)
    proxied = await stream(http, f"{proxy.url}/v1/chat/completions", body)
    assert b'"usage":{' in proxied["raw"] and proxied["raw"] == direct["raw"]
    assert engine.seen[-1].body == engine.seen[-2].body  # forwarded as the client wrote it


async def test_injection_keeps_every_other_request_byte(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    raw = b'{ "model" : "tiny", "stream": true, "prompt": "x", "temperature": 1e-5 }'
    async with http.post(
        f"{proxy.url}/v1/completions", data=raw, headers={"Content-Type": "application/json"}
    ) as response:
        await response.read()
    assert engine.seen[-1].body == b'{"stream_options":{"include_usage":true},' + raw[1:]


async def test_response_head_is_preserved(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    body = {**CHAT_MAX_64_TOKENS, "stream": True}
    direct = await stream(http, f"{engine.url}/v1/chat/completions", body)
    proxied = await stream(http, f"{proxy.url}/v1/chat/completions", body)
    ignore = {"Date"}
    assert {k: v for k, v in proxied["headers"].items() if k not in ignore} == {
        k: v for k, v in direct["headers"].items() if k not in ignore
    }


async def test_without_usage_output_tokens_are_counted_chunks_marked_estimated(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    engine.script = Script(contents=[(0.0, "a"), (0.0, "b"), (0.0, "c")], send_usage=False)
    proxied = await stream(http, f"{proxy.url}/v1/chat/completions", {**CHAT_MAX_64_TOKENS, "stream": True})
    assert proxied["raw"].endswith(b"data: [DONE]\n\n")
    [record] = proxy.records
    assert (record.output_tokens, record.output_tokens_estimated) == (3, True)


async def test_finish_reason_length_is_truncated(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    engine.script = Script(finish="length")
    await stream(http, f"{proxy.url}/v1/chat/completions", {**CHAT_MAX_64_TOKENS, "stream": True})
    [record] = proxy.records
    assert record.outcome is Outcome.TRUNCATED and record.finish_reason == "length"


async def test_non_streaming_request_reads_usage_from_the_body(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    engine.script = Script(completion_tokens=1234, finish="length")
    async with http.post(f"{engine.url}/v1/chat/completions", json=CHAT_MAX_64_TOKENS) as response:
        direct = await response.read()
    async with http.post(f"{proxy.url}/v1/chat/completions", json=CHAT_MAX_64_TOKENS) as response:
        proxied = await response.read()
        assert response.headers["Content-Length"] == str(len(direct))
    assert proxied == direct
    [record] = proxy.records
    assert (record.output_tokens, record.streaming, record.ttft_seconds) == (1234, False, None)
    assert record.outcome is Outcome.TRUNCATED and record.e2e_seconds > 0
    assert "stream_options" not in json.loads(engine.seen[-1].body)  # nothing injected


async def test_keep_alive_connection_serves_several_requests(
    engine: ScriptedEngine, proxy: ProxyHarness, http: ClientSession
) -> None:
    for _ in range(3):
        result = await stream(
            http, f"{proxy.url}/v1/chat/completions", {**CHAT_MAX_64_TOKENS, "stream": True}
        )
        assert result["status"] == 200
    assert len(proxy.records) == 3
    assert proxy.in_flight.current() == []
