"""The usage relay as a table: an engine's event stream, split into reads at chosen points -> the bytes
each read lets through to the client, and what the relay observed (usage, errors, an engine that
sends usage unasked, the end of the stream). The relay is pure, so each row is a plain function call."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from kvwatch.requests import sse
from kvwatch.requests.proxy.relay import MAX_EVENT_BYTES, MAX_HELD_EVENTS, UsageRelay

from .scripted import DONE, chat_chunk, usage_chunk

ROLE = chat_chunk({"role": "assistant", "content": ""})
HI = chat_chunk({"content": "hi"})
STOP = chat_chunk({"content": ""}, "stop")
USAGE = usage_chunk(7, 2)
FINGERPRINTED_USAGE = usage_chunk(7, 2, extra={"system_fingerprint": "fp_1"})
FINGERPRINTED_STOP = chat_chunk({"content": ""}, "stop", extra={"system_fingerprint": "fp_1"})
#: llama.cpp puts its timings on the last chunk it writes (an object of numbers)
TIMINGS = {"timings": {"prompt_n": 71, "prompt_ms": 0.96, "predicted_per_token_ms": 0.17300000000000001}}
TIMED_USAGE = usage_chunk(7, 2, extra=TIMINGS)
TIMED_STOP = chat_chunk({"content": ""}, "length", extra=TIMINGS)
LENGTH = chat_chunk({"content": ""}, "length")
EXACT = sse.Usage(7, 2)
STREAM = ROLE + HI + STOP + USAGE + DONE
DEEP_USAGE = (
    b'data: {"choices":[],"usage":{"prompt_tokens":1,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}}\n\n"
)


def with_usage(event: bytes, completion: int) -> bytes:
    """``event`` as vLLM writes it with continuous usage stats: the counts so far on every chunk."""
    counts = (7 + completion, completion)
    usage = b'"usage":{"prompt_tokens":7,"total_tokens":%d,"completion_tokens":%d}' % counts
    return event.replace(b"]}\n\n", b"]," + usage + b"}\n\n")


FORCED = with_usage(ROLE, 0) + with_usage(HI, 1) + with_usage(STOP, 2)


def crlf(events: bytes) -> bytes:
    return events.replace(b"\n\n", b"\r\n\r\n")


def at(stream: bytes, *marks: bytes | int) -> list[bytes]:
    """``stream`` cut into reads: at byte offsets, or just after the first occurrence of a byte string."""
    cuts = sorted(m if isinstance(m, int) else stream.index(m) + len(m) for m in marks)
    bounds = [0, *cuts, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class Row:
    name: str
    reads: list[bytes]
    strip: bool  # kvwatch asked for usage (its usage chunk is removed)
    client: list[bytes]  # what each read lets through, then what finish() releases (held + rest)
    usage: sse.Usage | None = EXACT
    errors: int = 0
    forced: bool = False  # the engine sends usage a client did not ask for, and kvwatch did not either
    done: bool = True  # [DONE] went out with nothing pending
    unasked: bool = True
    asked_continuous: bool = False  # the request asked for usage on every chunk itself


ROWS = [
    Row(
        "client asked usage itself: everything passes, usage read",
        [STREAM],
        strip=False,
        unasked=False,
        client=[STREAM, b""],
    ),
    Row(
        "kvwatch asked: its usage chunk is removed",
        [STREAM],
        strip=True,
        client=[ROLE + HI + STOP + DONE, b""],
    ),
    Row(
        "one read per event: the final chunk waits for the usage chunk",
        at(STREAM, ROLE, HI, STOP, USAGE),
        strip=True,
        client=[ROLE, HI, b"", STOP, DONE, b""],
    ),
    Row(
        "split inside the usage chunk and inside a separator",
        at(STREAM, 90, STREAM.index(USAGE) + 30, STREAM.index(DONE) - 1),
        strip=True,
        client=[b"", ROLE + HI, b"", STOP + DONE, b""],
    ),
    Row(
        "the usage chunk's system_fingerprint goes back onto the final chunk",
        at(ROLE + STOP + FINGERPRINTED_USAGE + DONE, STOP),
        strip=True,
        client=[ROLE, FINGERPRINTED_STOP + DONE, b""],
    ),
    Row(
        "llama.cpp's timings go back onto the final chunk, numbers as it wrote them",
        at(ROLE + LENGTH + TIMED_USAGE + DONE, LENGTH),
        strip=True,
        client=[ROLE, TIMED_STOP + DONE, b""],
    ),
    Row(
        "CRLF separators",
        at(crlf(STREAM), crlf(HI)),
        strip=True,
        client=[crlf(ROLE + HI), crlf(STOP + DONE), b""],
    ),
    Row(
        "the engine ignores include_usage: what was held goes at [DONE], in order",
        at(ROLE + STOP + DONE, STOP),
        strip=True,
        usage=None,
        client=[ROLE, STOP + DONE, b""],
    ),
    Row(
        "usage riding on a content chunk is read and kept",
        [chat_chunk({"content": "a"}, extra={"usage": {"prompt_tokens": 7, "completion_tokens": 2}}) + DONE],
        strip=False,
        unasked=False,
        client=[
            chat_chunk({"content": "a"}, extra={"usage": {"prompt_tokens": 7, "completion_tokens": 2}})
            + DONE,
            b"",
        ],
    ),
    Row(
        "usage nobody asked for: the engine forces it, relayed as sent",
        [STREAM],
        strip=False,
        forced=True,
        client=[STREAM, b""],
    ),
    Row(
        "the engine forces usage (vLLM --enable-force-include-usage: on every chunk too): nothing removed",
        [FORCED[:300], FORCED[300:] + USAGE, DONE],
        strip=True,
        client=[with_usage(ROLE, 0), with_usage(HI, 1) + with_usage(STOP, 2) + USAGE, DONE, b""],
    ),
    Row(
        "usage on every chunk the request asked for itself: kvwatch's usage chunk still removed",
        [FORCED + USAGE + DONE],
        strip=True,
        asked_continuous=True,
        client=[FORCED + DONE, b""],
    ),
    Row(
        "a usage chunk nested 100,000 deep: removed, counted as an error, the stream whole",
        at(ROLE + STOP + DEEP_USAGE + DONE, STOP, 5000),
        strip=True,
        usage=None,
        errors=1,
        client=[ROLE, b"", STOP + DONE, b""],
    ),
    Row(
        "a stream cut before [DONE]: the held final chunk and the incomplete rest come out at the end",
        [ROLE + STOP + b'data: {"partial'],
        strip=True,
        usage=None,
        done=False,
        client=[ROLE, STOP + b'data: {"partial'],
    ),
    Row(
        "an 'event' over MAX_EVENT_BYTES without a separator: plain bytes from there on",
        [ROLE + STOP, b"x" * (MAX_EVENT_BYTES + 1), USAGE + DONE],
        strip=True,
        usage=None,
        done=False,
        client=[ROLE, STOP + b"x" * (MAX_EVENT_BYTES + 1), USAGE + DONE, b""],
    ),
    Row(
        "more than MAX_HELD_EVENTS after the final chunk: relayed, no longer held",
        [STOP + HI * (MAX_HELD_EVENTS + 1), HI + DONE],
        strip=True,
        usage=None,
        client=[STOP + HI * (MAX_HELD_EVENTS + 1), HI + DONE, b""],
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_usage_relay_table(row: Row) -> None:
    relay = UsageRelay(row.strip, row.unasked, row.asked_continuous)
    got, usage = [], None
    for read in row.reads:
        got.append(relay.feed(read))
        if relay.usage is not None:
            usage, relay.usage = relay.usage, None
    done = relay.done
    held, rest = relay.finish()
    got.append(held + rest)
    assert got == row.client
    observed = (usage, len(relay.errors), relay.forced_usage, done)
    assert observed == (row.usage, row.errors, row.forced, row.done)
    assert relay.holding == 0


def test_what_the_relay_holds_is_what_it_reports_for_the_buffer_budget() -> None:
    relay = UsageRelay(strip=True, unasked=True)
    assert relay.feed(ROLE + STOP + b"data: {") == ROLE
    assert relay.holding == len(STOP) - 2 + len(b"data: {")  # held event (without separator) + carry
    assert relay.overflow() == STOP + b"data: {"  # over budget: everything kept goes, in order
    assert relay.holding == 0 and relay.plain
    assert relay.feed(USAGE + DONE) == USAGE + DONE  # nothing is held or removed any more
