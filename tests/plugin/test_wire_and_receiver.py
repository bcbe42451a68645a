"""The plugin's datagram format and sender (standard library only) against kvwatch's receiver."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from kvwatch.model import Outcome, PluginLink
from kvwatch.requests.vllm_plugin import (
    MAX_DATAGRAM_BYTES,
    DatagramError,
    PluginReceiver,
    bind_socket,
    decode,
)
from tests.local import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins" / "vllm"))
from kvwatch_vllm_plugin import wire


def header(**extra):
    return {"v": 1, "e": 0, "p": 4242, "n": 1, "t": 1000.0, "d": 0, **extra}


FINISHED = {
    "reason": "length",
    "e2e": 2.5,
    "queue": 0.5,
    "prefill": 0.25,
    "decode": 1.75,
    "inference": 2.0,
    "prompt": 300,
    "output": 64,
    "cached": 128,
    "max_tokens": 64,
    "preemptions": 2,
}


def test_a_step_with_requests_round_trips_and_missing_fields_stay_unknown():
    step = {
        "run": 3,
        "wait": 2,
        "kv": 0.75,
        "pre_req": 1,
        "pre_q": 700,
        "pre_h": 256,
        "preempted": 1,
        "it": [1, 444, 2, 2, 12.5],
    }
    bodies = wire.encode(
        header(),
        [{**step, "t": 999.5}],
        [FINISHED, {"reason": "stop", "output": 5}],
        [wire.eviction_sample(3.0, 1.0, (0.5, float("nan"), "x"))],
        0,
    )
    assert len(bodies) == 1
    decoded = decode(wire.dumps(bodies[0]), "r0", "tiny")
    assert decoded.link == PluginLink("r0", "0", 4242, 1, 0)
    [s] = decoded.steps
    assert s.at == 999.5  # the step's own time, not the datagram's
    assert (s.running, s.waiting, s.kv_usage_ratio, s.ctx_tokens, s.gen_tokens, s.elapsed_ms) == (
        3,
        2,
        0.75,
        444,
        2,
        12.5,
    )
    assert s.recomputed_tokens == 444 and s.batch_tokens == 446
    assert s.evictions[0].reuse_gaps_seconds == (0.5,)  # NaN and a string are not sent
    first, second = decoded.records
    assert first.source == "vllm_plugin" and first.outcome is Outcome.TRUNCATED
    assert (first.preemptions, first.max_tokens, first.cached_prompt_tokens, first.prefill_seconds) == (
        2,
        64,
        128,
        0.25,
    )
    assert first.started_at == pytest.approx(1000.0 - 2.5)
    assert second.outcome is Outcome.COMPLETED
    assert (second.max_tokens, second.preemptions, second.e2e_seconds, second.prompt_tokens) == (None,) * 4


def test_many_finished_requests_are_split_below_the_size_limit():
    bodies = wire.encode(header(), [{"run": 1}], [FINISHED] * 100, [], 0)
    assert len(bodies) == 4 and "s" in bodies[0] and all("s" not in b for b in bodies[1:])
    records = [r for b in bodies for r in decode(wire.dumps(b), "r0", "m").records]
    assert len(records) == 100
    assert max(len(wire.dumps(b)) for b in bodies) < MAX_DATAGRAM_BYTES // 4


@pytest.mark.parametrize(
    ("data", "result"),
    [
        (b"x" * (MAX_DATAGRAM_BYTES + 1), "oversized"),
        (b"not json", "malformed"),
        (b"\xff\xfe", "malformed"),
        (b"[1, 2]", "malformed"),
        (json.dumps({**header(), "v": 2}).encode(), "unknown_version"),
        (json.dumps({**header(), "v": True}).encode(), "unknown_version"),
        (json.dumps({k: v for k, v in header().items() if k != "e"}).encode(), "malformed"),
        (json.dumps({**header(), "e": 5000}).encode(), "malformed"),
        (json.dumps({**header(), "t": None}).encode(), "malformed"),
        (json.dumps({**header(), "s": [{"run": -1}]}).encode(), "malformed"),
        (json.dumps({**header(), "s": [{"it": [1, 2]}]}).encode(), "malformed"),
        (json.dumps({**header(), "s": {"run": 1}}).encode(), "malformed"),
        (json.dumps({**header(), "f": {"output": 1}}).encode(), "malformed"),
        (json.dumps({**header(), "pa": True}).encode(), "malformed"),
        (json.dumps({**header(), "s": [{"cpre_q": -5}]}).encode(), "malformed"),
        (json.dumps({**header(), "ev": [[1.0]], "s": [{}]}).encode(), "malformed"),
        (b"[" * 100_000, "oversized"),
        (b"[" * 60_000, "malformed"),  # deep nesting: RecursionError is caught
    ],
)
def test_bad_datagrams_are_refused_with_a_reason(data, result):
    with pytest.raises(DatagramError) as err:
        decode(data, "r0", "m")
    assert err.value.result == result


def test_one_bad_request_costs_that_request_and_keeps_the_steps_and_the_others():
    """vLLM's negative queue/prefill time of a request that never got a token (an older plugin sent it
    as is) once dropped its whole datagram: 64 steps and 31 other requests, counted only as malformed."""
    steps = [{"t": 999.0 + i, "it": [0, 0, 1, 1, 2.0]} for i in range(3)]
    bad = {**FINISHED, "reason": "error", "prefill": -12201.85, "inference": -12201.85}
    body = {**header(), "s": steps, "f": [FINISHED, bad, {"reason": 3}, "x", FINISHED]}
    got = decode(json.dumps(body).encode(), "r0", "m")
    assert len(got.steps) == 3 and len(got.records) == 2
    assert got.refused == ("negative_duration", "malformed", "malformed")


def test_a_request_the_reader_fails_on_costs_that_request_only(monkeypatch):
    from kvwatch.requests import vllm_plugin

    real = vllm_plugin.request_record

    def fails_on_seven(fields, *args):
        if fields.get("output") == 7:
            raise ArithmeticError("a reader bug")
        return real(fields, *args)

    monkeypatch.setattr(vllm_plugin, "request_record", fails_on_seven)
    body = {**header(), "f": [FINISHED, {**FINISHED, "output": 7}, FINISHED]}
    got = decode(json.dumps(body).encode(), "r0", "m")
    assert [r.output_tokens for r in got.records] == [64, 64] and got.refused == ("malformed",)


def test_the_receiver_counts_refused_requests_by_reason(tmp_path):
    counted: list[tuple] = []
    steps: list = []
    receiver = PluginReceiver(
        "r0",
        str(tmp_path / "x.sock"),
        "m",
        lambda r: None,
        lambda link, step: steps.append(step),
        lambda family, *labels, amount=1: counted.append((family, *labels, amount)),
    )
    body = {**header(), "s": [{"it": [0, 0, 1, 1, 2.0]}], "f": [{**FINISHED, "queue": -3.0}]}
    receiver.handle(json.dumps(body).encode())
    assert ("kvwatch_vllm_plugin_datagrams", "r0", "accepted", 1) in counted
    assert ("kvwatch_vllm_plugin_refused_requests", "r0", "negative_duration", 1) in counted
    assert len(steps) == 1 and steps[0].elapsed_ms == 2.0  # the step sample is kept: none went missing


def test_connector_lookups_and_the_admission_flag_are_read():
    body = {**header(pa=1), "s": [{"pre_q": 1000, "pre_h": 400, "cpre_q": 600, "cpre_h": 500}]}
    got = decode(json.dumps(body).encode(), "r0", "m")
    assert got.link.per_admission is True and got.steps[0].recomputed_tokens == 100
    assert decode(json.dumps(header(pa=0)).encode(), "r0", "m").link.per_admission is False
    assert decode(json.dumps(header()).encode(), "r0", "m").link.per_admission is None


def test_sender_counts_drops_when_no_agent_listens(tmp_path):
    sender = wire.DatagramSender(str(tmp_path / "absent.sock"))
    assert sender.send(b"{}") is False and sender.dropped == 1
    (tmp_path / "stale.sock").touch()  # a file that is not a socket: refused, still no exception
    stale = wire.DatagramSender(str(tmp_path / "stale.sock"))
    assert stale.send(b"{}") is False and stale.dropped == 1


def test_sender_never_blocks_on_an_agent_that_does_not_read(tmp_path):
    path = str(tmp_path / "slow.sock")
    receiver = bind_socket(path)
    try:
        sender = wire.DatagramSender(path)
        started = time.perf_counter()
        for _ in range(2000):
            sender.send(b"x" * 2000)
        elapsed = time.perf_counter() - started
        assert sender.backlog == wire.MAX_BACKLOG  # kept for the agent, up to the bound
        assert sender.dropped > 0 and sender.sent + sender.dropped + sender.backlog == 2000
        assert elapsed < 1.0  # EAGAIN at once, never a wait
    finally:
        receiver.close()


def test_a_slow_agent_loses_nothing_and_gets_everything_in_order(tmp_path):
    """The kernel queue (net.unix.max_dgram_qlen) fills while the agent stalls; the plugin keeps the
    rest and sends it, oldest first, once the agent reads again."""
    path = str(tmp_path / "stalled.sock")
    receiver = bind_socket(path)
    receiver.setblocking(False)
    try:
        sender = wire.DatagramSender(path)
        results = [sender.send(f"{i}".encode()) for i in range(100)]
        assert results[0] is True and results[-1] is False and sender.backlog > 0
        assert sender.dropped == 0
        got: list[bytes] = []
        for _ in range(1000):
            while True:
                try:
                    got.append(receiver.recv(100))
                except BlockingIOError:
                    break
            if not sender.backlog:
                break
            sender.drain()
        assert got == [f"{i}".encode() for i in range(100)] and sender.sent == 100
    finally:
        receiver.close()


def test_the_drain_thread_sends_the_backlog_once_the_agent_reads_with_no_further_step(tmp_path):
    """An engine that goes idle right after its last step calls neither ``send`` nor ``log`` for 10 s:
    the drainer's own thread sends what waited as soon as the agent reads again, oldest first."""
    path = str(tmp_path / "idle.sock")
    receiver = bind_socket(path)
    receiver.setblocking(False)
    try:
        sender = wire.DatagramSender(path)
        drainer = wire.BacklogDrainer(sender)
        for i in range(60):
            sender.send(f"{i}".encode())
        assert sender.backlog > 0
        tries = []
        drain = sender.drain
        sender.drain = lambda: (tries.append(1), drain())[1]  # type: ignore[method-assign]
        drainer.wake()
        # the agent still stalls: the thread retries (seen several times), nothing is lost or reordered
        wait_until(lambda: len(tries) >= 5, what="the drain thread to retry while the agent stalls")
        assert sender.dropped == 0 and sender.backlog > 0
        got: list[bytes] = []

        def received_all() -> bool:
            with contextlib.suppress(BlockingIOError):
                while len(got) < 60:
                    got.append(receiver.recv(100))
            return len(got) == 60

        wait_until(received_all, 5, "the backlog to reach the agent", interval_s=0.001)
        drainer.stop()
        assert got == [f"{i}".encode() for i in range(60)] and sender.backlog == 0 and sender.sent == 60
    finally:
        receiver.close()


def test_a_send_that_finds_another_thread_draining_leaves_its_datagram_for_it(tmp_path):
    path = str(tmp_path / "busy.sock")
    receiver = bind_socket(path)
    try:
        sender = wire.DatagramSender(path)
        with sender._lock:  # another thread is draining
            started = time.perf_counter()
            assert sender.send(b"later") is False
            assert time.perf_counter() - started < 0.1 and sender.backlog == 1
        sender.drain()
        assert receiver.recv(100) == b"later" and sender.sent == 1 and sender.backlog == 0
    finally:
        receiver.close()


def test_an_agent_that_goes_away_drops_the_backlog_and_counts_it(tmp_path):
    path = str(tmp_path / "gone.sock")
    receiver = bind_socket(path)
    sender = wire.DatagramSender(path)
    for i in range(50):
        sender.send(f"{i}".encode())
    waiting = sender.backlog
    assert waiting > 0
    receiver.close()
    Path(path).unlink()
    assert sender.send(b"late") is False
    assert sender.backlog == 0 and sender.dropped == waiting + 1 and sender.sent + sender.dropped == 51


def test_the_steps_of_every_dropped_datagram_are_counted(tmp_path):
    sender = wire.DatagramSender(str(tmp_path / "absent.sock"))
    sender.send(b"{}", steps=33)
    sender.send(b"{}")  # a datagram of finished requests only
    assert (sender.dropped, sender.dropped_steps) == (2, 33)
    path = str(tmp_path / "full.sock")
    receiver = bind_socket(path)
    try:
        bounded = wire.DatagramSender(path, max_backlog=4)
        for _ in range(40):
            bounded.send(b"x", steps=2)
        assert bounded.dropped > 0 and bounded.dropped_steps == 2 * bounded.dropped
    finally:
        receiver.close()


class _ShortOfBuffers:
    """A socket whose kernel is short of buffers for the first ``failures`` sends (ENOBUFS)."""

    def __init__(self, failures: int, error: int = errno.ENOBUFS) -> None:
        self.failures, self.error, self.sent = failures, error, []

    def sendto(self, data: bytes, path: str) -> int:
        if self.failures:
            self.failures -= 1
            raise OSError(self.error, os.strerror(self.error))
        self.sent.append(data)
        return len(data)

    def close(self) -> None:
        pass


def test_a_kernel_short_of_buffers_delays_a_datagram_and_loses_nothing(tmp_path):
    sender = wire.DatagramSender(str(tmp_path / "any.sock"))
    sock = sender._sock = _ShortOfBuffers(failures=3)  # type: ignore[assignment]
    assert sender.send(b"a", steps=5) is False and sender.backlog == 1
    sender.send(b"b", steps=1)
    sender.drain()
    assert sender.send(b"c") is True
    assert sock.sent == [b"a", b"b", b"c"] and (sender.dropped, sender.dropped_steps) == (0, 0)
    too_big = wire.DatagramSender(str(tmp_path / "any.sock"))
    too_big._sock = _ShortOfBuffers(failures=1, error=errno.EMSGSIZE)  # type: ignore[assignment]
    assert too_big.send(b"huge", steps=7) is False  # an error of the datagram itself: that one only
    assert (too_big.dropped, too_big.dropped_steps, too_big.backlog) == (1, 7, 0)


def test_socket_path_comes_from_the_environment_with_a_default():
    assert wire.socket_path({}) == wire.DEFAULT_SOCKET == "/run/kvwatch/vllm.sock"
    assert wire.socket_path({wire.SOCKET_ENV: "/tmp/x.sock"}) == "/tmp/x.sock"


def test_bind_refuses_to_replace_a_file_that_is_not_a_socket(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me")
    with pytest.raises(OSError, match="not a socket"):
        bind_socket(str(target))
    assert target.read_text() == "keep me"


async def test_receiver_counts_bad_datagrams_and_keeps_serving(tmp_path):
    counts: dict[tuple, float] = {}
    records, steps = [], []

    def count(family, *labels, amount=1):
        counts[(family, *labels)] = counts.get((family, *labels), 0) + amount

    path = str(tmp_path / "r0.sock")
    receiver = PluginReceiver(
        "r0", path, "tiny", records.append, lambda link, step: steps.append((link, step)), count
    )
    await receiver.start()
    (tmp_path / "stale").touch()
    try:
        sender = wire.DatagramSender(path)
        for data in (
            b"garbage",
            json.dumps({**header(), "v": 9}).encode(),
            b"y" * (MAX_DATAGRAM_BYTES + 10),
            wire.dumps(wire.encode(header(), [{"run": 1}], [FINISHED], [], 0)[0]),
        ):
            assert sender.send(data)
        deadline = time.monotonic() + 5
        while not records and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    finally:
        await receiver.stop()
    assert len(records) == 1 and records[0].preemptions == 2 and len(steps) == 1
    assert counts[("kvwatch_vllm_plugin_datagrams", "r0", "accepted")] == 1
    assert counts[("kvwatch_vllm_plugin_datagrams", "r0", "malformed")] == 1
    assert counts[("kvwatch_vllm_plugin_datagrams", "r0", "unknown_version")] == 1
    assert counts[("kvwatch_vllm_plugin_datagrams", "r0", "oversized")] == 1
    assert not Path(path).exists()  # the socket file goes with the receiver


async def test_a_stale_socket_file_from_a_dead_agent_is_replaced(tmp_path):
    path = str(tmp_path / "r0.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens
    receiver = PluginReceiver("r0", path, "m", lambda r: None, lambda link, step: None, lambda *a, **k: None)
    await receiver.start()
    try:
        assert wire.DatagramSender(path).send(b"{}")
    finally:
        await receiver.stop()
