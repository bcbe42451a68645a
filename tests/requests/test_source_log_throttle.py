"""Log lines an outsider can repeat, outside the proxy, are let through once per interval.

An OTLP sender posting garbage, an engine process sending bad datagrams, an SGLang file kvwatch
cannot read: each used to log one WARNING per event (an OTLP sender could write a line per POST).
They go through ``kvwatch.logthrottle.LogThrottle`` now; every event is still counted.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import ClientSession

from kvwatch.config import Config, HostPort, OtlpConfig, ReplicaConfig, SglangFilesConfig
from kvwatch.requests.otlp import REFUSED, OtlpReceiver
from kvwatch.requests.sglang_files import SglangFileFollower
from kvwatch.requests.vllm_plugin import DATAGRAMS, PluginReceiver


def _counter(counts: Counter):
    def count(family: str, *labels: str, amount: float = 1) -> None:
        counts[(family, *labels)] += amount

    return count


def _warnings(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


async def test_an_otlp_sender_posting_garbage_gets_one_log_line(
    http: ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    counts: Counter = Counter()
    config = Config(
        replicas=(ReplicaConfig("r0", "http://127.0.0.1:1/metrics"),),
        otlp=OtlpConfig(listen=HostPort("127.0.0.1", 0)),
    )
    receiver = OtlpReceiver(config, lambda record: None, _counter(counts))
    await receiver.start()
    caplog.set_level(logging.WARNING, logger="kvwatch.requests.otlp")
    try:
        for _ in range(30):
            async with http.post(
                f"http://127.0.0.1:{receiver.port}/v1/traces",
                data=b"\xff" * 64,
                headers={"Content-Type": "application/x-protobuf"},
            ) as response:
                assert response.status == 400
    finally:
        await receiver.stop()
    assert counts[(REFUSED, "undecodable")] == 30  # every refusal counted
    assert len(_warnings(caplog, "kvwatch.requests.otlp")) == 1


def test_bad_plugin_datagrams_get_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    counts: Counter = Counter()
    receiver = PluginReceiver(
        "r0", str(tmp_path / "s.sock"), "m", lambda record: None, lambda link, step: None, _counter(counts)
    )
    caplog.set_level(logging.WARNING, logger="kvwatch.requests.vllm_plugin")
    for _ in range(30):
        receiver.handle(b"not json")
    assert counts[(DATAGRAMS, "r0", "malformed")] == 30
    assert len(_warnings(caplog, "kvwatch.requests.vllm_plugin")) == 1


def test_an_unreadable_request_file_gets_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "sglang-request-metrics-20260101_00.log").mkdir()  # its name, but open() fails (even as root)
    follower = SglangFileFollower(
        SglangFilesConfig(replica="r0", directory=str(tmp_path)), "m", _counter(Counter()), from_start=True
    )
    caplog.set_level(logging.WARNING, logger="kvwatch.requests.sglang_files")
    for _ in range(30):
        assert follower.poll() == []
    warnings = _warnings(caplog, "kvwatch.requests.sglang_files")
    assert len(warnings) == 1 and "cannot read" in warnings[0]
