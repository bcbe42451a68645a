"""The per-chunk fast path (``ChunkedDecoder.whole_chunk`` + ``Exchange.pass_chunk``) changes nothing a
client or an SRE can see: whatever an engine streams and however its reads fall, the client's bytes,
the request record and the counters are those of the general path (de-chunk, relay, meter, frame
again), which the other relay tests check against the engine's bytes.

Driven through a real ``EngineConnection`` (its ``data_received`` is where the fast path branches),
with the clock at the read's index so that both paths stamp the same times.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwatch.model import RequestRecord
from kvwatch.requests.accounting import RequestMeter
from kvwatch.requests.http1 import ChunkedDecoder, parse_request_head
from kvwatch.requests.proxy.client import ClientConnection
from kvwatch.requests.proxy.exchange import Exchange
from kvwatch.requests.proxy.pool import EngineConnection

from .scripted import DONE, chat_chunk, text_chunk, usage_chunk
from .unstarted import ASKING, STREAMING, RecordingTransport, unstarted_proxy

RESPONSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
)
LAST_CHUNK = b"0\r\n\r\n"


class EngineTransport(RecordingTransport):
    """The engine side's socket: what kvwatch wrote upstream, and closing, pausing and resuming."""

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class FailingMeter(RequestMeter):
    """A meter whose per-chunk accounting raises from the ``fail_at``-th call on (kvwatch's own bug)."""

    fail_at = 0  # 0: never

    def on_content(self, n: int, now: float) -> None:
        if self.fail_at and self.chunks + 1 >= self.fail_at:
            raise RuntimeError("accounting bug")
        super().on_content(n, now)


@contextmanager
def general_path_only() -> Iterator[None]:
    """No read qualifies for the fast path: every one is de-chunked, relayed and framed again."""
    whole_chunk = ChunkedDecoder.whole_chunk
    ChunkedDecoder.whole_chunk = lambda self, data: 0  # type: ignore[method-assign]
    try:
        yield
    finally:
        ChunkedDecoder.whole_chunk = whole_chunk  # type: ignore[method-assign]


async def run(
    reads: list[bytes], client_body: bytes, fail_at: int
) -> tuple[bytes, list[RequestRecord], Counter, int]:
    """What the client was written, the records, the counters, and how many reads took the fast path."""
    counters: Counter = Counter()
    records: list[RequestRecord] = []
    tick = [0.0]

    def count(family: str, *labels: str, amount: float = 1) -> None:
        counters[(family, *labels)] += amount

    meter = type("Meter", (FailingMeter,), {"fail_at": fail_at})
    proxy = unstarted_proxy(count=count, meter_factory=meter, sink=records.append, clock=lambda: tick[0])
    conn = ClientConnection(proxy.clients)
    conn.transport = down = RecordingTransport()
    head = parse_request_head(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d" % len(client_body)
    )
    exchange = Exchange(proxy.clients.exchanges, conn, head, client_body, 0.0, 0.0)
    conn.exchange = exchange
    engine_side = EngineConnection(proxy.clients.exchanges.engine)
    engine_side.connection_made(EngineTransport())
    exchange._send = lambda: exchange._attach(engine_side, reused=False)  # type: ignore[method-assign]
    passed = 0
    pass_chunk = exchange.pass_chunk

    def counting(frame: bytes, start: int) -> bool:
        nonlocal passed
        took = pass_chunk(frame, start)
        passed += took
        return took

    exchange.pass_chunk = counting  # type: ignore[method-assign]
    exchange.start()
    engine_side.data_received(RESPONSE_HEAD)
    for i, read in enumerate(reads):
        tick[0] = float(i + 1)
        engine_side.data_received(read)
    for _ in range(3):  # the record is made on a later loop turn
        await asyncio.sleep(0)
    conn._cancel_timer()
    engine_side._tail_done()
    await proxy.clients.exchanges.engine.stop()
    return bytes(down.written), records, counters, passed


def frame(payload: bytes, style: str) -> bytes:
    """A chunk as an engine might frame it: canonically, or in ways RFC 9112 allows that the fast path
    leaves to the general one."""
    size = {"canonical": b"%x", "upper": b"%X", "zero": b"0%x", "extension": b"%x;x=1"}[style] % len(payload)
    return size + b"\r\n" + payload + b"\r\n"


def spaced(delta: dict) -> bytes:
    """Non-compact JSON (``json.dumps`` defaults): content found by the regex, not the byte marker."""
    return (
        b"data: "
        + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}).encode()
        + b"\n\n"
    )


texts = st.text(alphabet=st.sampled_from(["a", "é", '"', "\\", "\n", " ", "\u2028", "}"]), max_size=4)
tokens = texts.filter(bool)
events = st.one_of(
    *[tokens.map(lambda t: chat_chunk({"content": t}))] * 6,  # what an engine mostly sends
    texts.map(lambda t: chat_chunk({"content": t})),
    texts.map(lambda t: chat_chunk({"reasoning_content": t})),
    texts.map(text_chunk),
    texts.map(lambda t: spaced({"content": t})),
    st.sampled_from(
        [
            chat_chunk({"role": "assistant", "content": ""}),
            chat_chunk({"content": ""}, "stop"),
            chat_chunk({"content": "x"}, "length"),
            chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}),
            chat_chunk({"content": "x"}, extra={"usage": {"prompt_tokens": 3, "completion_tokens": 1}}),
            usage_chunk(3, 2),
            b"\n",
            b"data: x\n\n\n",
            b": comment\n\n",
        ]
    ),
)
styles = st.sampled_from(["canonical"] * 6 + ["upper", "zero", "extension"])


@st.composite
def engine_reads(draw: st.DrawFn) -> list[bytes]:
    """An engine's stream as it reaches kvwatch: mostly one chunk per read (an engine's pace), some
    reads holding several chunks, some chunks cut across reads."""
    body = draw(st.lists(events, max_size=25))
    if draw(st.booleans()):
        body.append(DONE)
    wire = [frame(event, draw(styles)) for event in body] + [LAST_CHUNK]
    reads: list[bytes] = []
    for piece in wire:
        how = draw(st.sampled_from(["alone"] * 6 + ["join", "cut"]))
        if how == "join" and reads:
            reads[-1] += piece
        elif how == "cut" and len(piece) > 1:
            at = draw(st.integers(min_value=1, max_value=len(piece) - 1))
            reads += [piece[:at], piece[at:]]
        else:
            reads.append(piece)
    return reads


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reads=engine_reads(), asking=st.booleans(), fail_at=st.integers(min_value=0, max_value=6))
async def test_fast_path_changes_no_byte_record_or_count(
    reads: list[bytes], asking: bool, fail_at: int
) -> None:
    body = ASKING if asking else STREAMING
    fast = await run(reads, body, fail_at)
    with general_path_only():
        general = await run(reads, body, fail_at)
    assert general[3] == 0
    assert fast[:3] == general[:3]


async def test_an_engines_paced_stream_takes_the_fast_path_for_every_token() -> None:
    """vLLM's shape, one chunk per read: every content chunk leaves by the fast path; the role chunk
    (the first bytes the client gets), the finish, usage and [DONE] chunks by the general one."""
    tokens = [chat_chunk({"content": f"t{i}"}) for i in range(50)]
    stream = [chat_chunk({"role": "assistant", "content": ""}), *tokens, chat_chunk({"content": ""}, "stop")]
    stream += [usage_chunk(12, 50), DONE]
    reads = [frame(event, "canonical") for event in stream] + [LAST_CHUNK]
    written, records, counters, passed = await run(reads, STREAMING, 0)
    assert passed == 50
    with general_path_only():
        assert (await run(reads, STREAMING, 0))[:3] == (written, records, counters)
    (record,) = records
    assert record.output_tokens == 50 and record.chunks == 50 and sum(record.gap_counts) == 49
    assert record.ttft_seconds == 2.0  # the first token's read (the role chunk was read 1)
    assert written.count(b"data: ") == len(stream) - 1  # the usage chunk kvwatch asked for is removed
