"""scrape_target against a real local server: state, error counters, log lines, no stale samples."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvwatch.agent import engines
from kvwatch.agent.engines import backoff_delay, scrape_target
from kvwatch.config import Config, ReplicaConfig, ScrapeConfig
from kvwatch.engines.llamacpp import EXTRA_PAGE
from kvwatch.export.replicas import ReplicaCollector
from kvwatch.model import LengthBands
from kvwatch.state import NodeState

from .helpers import LLAMACPP_TINY, page

LOGGER = "kvwatch.agent.engines"
SCRAPE = ScrapeConfig(timeout_s=2.0, max_response_bytes=1024 * 1024, backoff_max_s=60.0)


class Clock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def state() -> NodeState:
    return NodeState("node-a", LengthBands())


@pytest.fixture
def clock() -> Clock:
    return Clock()


def replica(url: str, **kw) -> ReplicaConfig:
    return ReplicaConfig(name="r0", metrics_url=url, **kw)


def log_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def exported(state: NodeState) -> str:
    registry = CollectorRegistry()
    registry.register(ReplicaCollector(state, Config()))
    return generate_latest(registry).decode()


async def scrape(client, server_url, state, clock, scrape_cfg=SCRAPE, **kw):
    await scrape_target(client, replica(server_url, **kw), scrape_cfg, state, now=clock)


async def test_good_scrape_marks_up_and_stores_samples(server, client, state, clock, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    await scrape(client, server.url, state, clock)
    target = state.target("r0")
    assert (target.up, target.backend, target.last_success_ts) == (True, "vllm", 1000.0)
    assert target.last_error is None
    (s,) = target.samples
    assert (s.replica, s.model_name, s.dp_rank, s.scraped_at) == ("r0", "tiny", "0", 1000.0)
    assert state.collectors["engine:r0"].success
    assert log_lines(caplog) == [
        "replica r0 up: vllm, 1 replica sample(s), vllm>=0.32 (prompt_tokens_cached_by_source)"
    ]


async def test_repeated_failures_log_once_count_each_and_serve_nothing_stale(
    server, client, state, clock, caplog
):
    caplog.set_level(logging.INFO, logger=LOGGER)
    await scrape(client, server.url, state, clock)
    assert 'kvwatch_kv_usage_ratio{backend="vllm"' in exported(state)
    server.status = 500
    for _ in range(3):
        clock.advance(120)  # past any backoff
        await scrape(client, server.url, state, clock)
    target = state.target("r0")
    assert (target.up, target.samples, target.consecutive_failures) == (False, (), 3)
    assert target.errors["http_status"] == 3
    assert target.last_success_ts == 1000.0
    lines = log_lines(caplog)
    assert len(lines) == 2  # up, then one down line for three failed scrapes
    assert lines[1].startswith("replica r0 down (http_status): replica r0: http://127.0.0.1:")
    assert "HTTP 500" in lines[1]
    text = exported(state)
    assert "kvwatch_kv_usage_ratio{" not in text and "kvwatch_replica_info{" not in text
    assert 'kvwatch_target_up{backend="vllm",replica="r0"} 0.0' in text
    assert 'kvwatch_target_scrape_errors_total{reason="http_status",replica="r0"} 3.0' in text
    assert not state.collectors["engine:r0"].success


async def test_backoff_skips_scrapes_and_grows_to_the_cap(server, client, state, clock):
    server.status = 503
    await scrape(client, server.url, state, clock)
    assert server.requests == 1
    target = state.target("r0")
    assert target.backoff_until == 1001.0
    await scrape(client, server.url, state, clock)  # still inside the 1 s backoff
    assert server.requests == 1 and target.errors["http_status"] == 1
    for expected in (2.0, 4.0, 8.0):
        clock.t = target.backoff_until
        await scrape(client, server.url, state, clock)
        assert target.backoff_until - clock.t == expected
    assert server.requests == 4
    assert [backoff_delay(n, 60.0) for n in (1, 2, 6, 7, 20)] == [1.0, 2.0, 32.0, 60.0, 60.0]


async def test_success_clears_backoff(server, client, state, clock):
    server.status = 500
    await scrape(client, server.url, state, clock)
    server.status = 200
    clock.advance(2)
    await scrape(client, server.url, state, clock)
    target = state.target("r0")
    assert (target.up, target.backoff_until, target.consecutive_failures) == (True, None, 0)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


async def test_timeout_with_a_slow_server(server, client, state, clock, caplog):
    await scrape(client, server.url, state, clock)
    server.delay_s = 5.0
    clock.advance(5)
    await scrape(client, server.url, state, clock, ScrapeConfig(timeout_s=0.3))
    target = state.target("r0")
    assert (target.up, target.samples, target.errors["timeout"]) == (False, (), 1)
    assert "kvwatch_kv_usage_ratio{" not in exported(state)
    (line,) = warnings(caplog)
    assert line.startswith("replica r0 down (timeout): replica r0: http://127.0.0.1:")
    assert "within 0.3s" in line


async def test_replica_scrape_timeout_overrides_the_global_one(server, client, state, clock):
    server.delay_s = 1.0
    await scrape(client, server.url, state, clock, ScrapeConfig(timeout_s=0.2), scrape_timeout_s=5.0)
    assert state.target("r0").up


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (lambda s: setattr(s, "body", s.body[:-40]), "malformed"),  # cut inside the last sample line
        (lambda s: setattr(s, "mode", "short_body"), "malformed"),
        (lambda s: setattr(s, "body", "<html><body>502 Bad Gateway</body></html>"), "not_metrics"),
        (lambda s: setattr(s, "body", "process_cpu_seconds_total 1.0\n"), "no_engine_metrics"),
        (lambda s: setattr(s, "body", "x 1\n" * 300_000), "too_large"),
    ],
)
async def test_bad_pages_are_counted_by_reason(server, client, state, clock, caplog, setup, reason):
    await scrape(client, server.url, state, clock)
    assert "kvwatch_kv_capacity_tokens{" in exported(state)
    setup(server)
    clock.advance(5)
    await scrape(client, server.url, state, clock)
    target = state.target("r0")
    assert (target.up, target.samples, dict(target.errors)) == (False, (), {reason: 1})
    assert "kvwatch_kv_capacity_tokens{" not in exported(state)  # the last good sample is not served
    assert warnings(caplog) == [f"replica r0 down ({reason}): {target.last_error.split(': ', 1)[1]}"]


async def test_a_new_reason_while_down_is_logged_once(server, client, state, clock, caplog, refused_url):
    server.status = 500
    await scrape(client, server.url, state, clock)
    clock.advance(120)
    await scrape(client, refused_url, state, clock)
    clock.advance(120)
    await scrape(client, refused_url, state, clock)
    lines = log_lines(caplog)
    assert len(lines) == 2
    assert lines[1].startswith("replica r0 still down, now (connect):")
    assert dict(state.target("r0").errors) == {"http_status": 1, "connect": 2}


async def test_a_password_or_query_in_the_url_stays_out_of_the_log_and_the_error(
    server, client, state, clock, caplog, refused_url
):
    # httpx sends user:password as Basic auth; the URL went whole into the log and the status page
    secret = refused_url.replace("http://", "http://user:s3cret@") + "?token=abc123"
    await scrape(client, secret, state, clock)
    server.status = 500
    await scrape(client, server.url.replace("http://", "http://user:s3cret@") + "?token=abc123", state, clock)
    shown = [*log_lines(caplog), state.target("r0").last_error or ""]
    assert not any("s3cret" in text or "abc123" in text for text in shown), shown
    assert any("***@127.0.0.1" in text for text in shown), shown


async def test_engine_restart_with_counters_reset(server, client, state, clock, caplog):
    server.body = page("vllm_0_32_cpu_preempting.prom")
    await scrape(client, server.url, state, clock)
    server.body = page("vllm_0_32_cpu_idle.prom")  # same replica key, counters back at 0
    clock.advance(5)
    await scrape(client, server.url, state, clock)
    target = state.target("r0")
    assert target.restarts == 1 and target.up
    assert target.samples[0].preemptions_total == 0.0
    line = log_lines(caplog)[-1]
    assert line.startswith("replica r0: engine restart detected (counters went backwards: ")
    assert "preemptions_total 8 -> 0" in line
    assert 'kvwatch_target_restarts_total{replica="r0"} 1.0' in exported(state)


async def test_counters_going_up_are_not_a_restart(server, client, state, clock):
    server.body = page("vllm_0_32_cpu_idle.prom")
    await scrape(client, server.url, state, clock)
    server.body = page("vllm_0_32_cpu_preempting.prom")
    clock.advance(5)
    await scrape(client, server.url, state, clock)
    assert state.target("r0").restarts == 0


async def test_replica_vanishes_and_returns_restarted(server, client, state, clock, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    server.body = page("vllm_0_32_cpu_preempting.prom")
    await scrape(client, server.url, state, clock)
    url, port = server.url, server.port
    await server.stop()
    for _ in range(2):
        clock.advance(120)
        await scrape(client, url, state, clock)
    target = state.target("r0")
    assert (target.up, target.samples, target.errors["connect"]) == (False, (), 2)
    assert "kvwatch_kv_capacity_tokens{" not in exported(state)

    server.body = page("vllm_0_32_cpu_idle.prom")
    await server.start(port)
    clock.advance(120)
    await scrape(client, url, state, clock)
    assert target.up and target.samples and target.restarts == 1
    lines = log_lines(caplog)
    assert lines[1].startswith("replica r0 down (connect):")
    assert "engine restart detected" in lines[2]
    assert lines[3].startswith("replica r0 up after 2 failed scrape(s): vllm")
    assert len(lines) == 4
    series = 'kvwatch_kv_capacity_tokens{backend="vllm",dp_rank="0",model_name="tiny",replica="r0"} 2560.0'
    assert series in exported(state)


async def test_llamacpp_slots_fill_kv_and_model_name_comes_from_config(server, client, state, clock):
    server.body = page(LLAMACPP_TINY)
    server.slots_body = page("llamacpp_slots_2026_two_slots.json")
    await scrape(client, server.url, state, clock, model_name="tiny-gguf")
    target = state.target("r0")
    (s,) = target.samples
    assert (s.model_name, s.kv_capacity_tokens, s.live_tokens) == ("tiny-gguf", 512.0, 42.0)
    assert s.version_hint.endswith("KV from /slots (2 slots)")
    assert target.extra_page_error is None


async def test_llamacpp_slots_failure_keeps_the_target_up_and_logs_once(server, client, state, clock, caplog):
    server.body = page(LLAMACPP_TINY)  # /slots answers 501
    for _ in range(3):
        await scrape(client, server.url, state, clock)
        clock.advance(5)
    target = state.target("r0")
    assert target.up and dict(target.errors) == {}
    assert target.samples[0].kv_capacity_tokens is None
    assert "HTTP 501" in target.extra_page_error
    lines = [line for line in log_lines(caplog) if "/slots" in line]
    assert len(lines) == 1 and "stays up" in lines[0]


@pytest.mark.parametrize(
    ("slots", "capacity"),
    [
        # a 400-digit n_ctx: float() of it raised OverflowError, which no except of the scrape caught
        ('[{"id": 0, "n_ctx": 1%s, "is_processing": true, "n_prompt_tokens": 5}]' % ("0" * 400), None),
        ('[{"id": 0, "n_ctx": -256, "is_processing": true, "n_prompt_tokens": 5}]', None),
        ('[{"id": 0, "n_ctx": 256, "is_processing": true, "n_prompt_tokens": 5}]', 256.0),
    ],
    ids=["huge", "negative", "sane"],
)
async def test_llamacpp_slots_out_of_range_numbers_are_missing_and_the_scrape_completes(
    server, client, state, clock, slots, capacity
):
    server.body = page(LLAMACPP_TINY)
    server.slots_body = slots
    await scrape(client, server.url, state, clock)
    target = state.target("r0")
    assert target.up and target.last_success_ts == clock() and target.extra_page_error is None
    (s,) = target.samples
    assert (s.kv_capacity_tokens, s.live_tokens) == (capacity, 5.0)


async def test_an_extra_page_adapter_bug_keeps_the_target_up(server, client, state, clock, monkeypatch):
    """Whatever the /slots reader raises (an adapter bug, as on the /metrics page) is that page's error."""

    def broken(body: bytes, samples: tuple) -> tuple:
        raise ZeroDivisionError("adapter bug")

    monkeypatch.setattr(engines, "extra_page", lambda backend: dataclasses.replace(EXTRA_PAGE, apply=broken))
    server.body = page(LLAMACPP_TINY)
    server.slots_body = page("llamacpp_slots_2026_two_slots.json")
    await scrape(client, server.url, state, clock)
    target = state.target("r0")
    assert target.up and target.samples and "adapter bug" in target.extra_page_error


def test_slots_url_is_derived_from_the_metrics_url():
    assert EXTRA_PAGE.url("http://h:8080/metrics") == "http://h:8080/slots"
    assert EXTRA_PAGE.url("http://h:8080/llama/metrics?x=1") == "http://h:8080/llama/slots"
    assert EXTRA_PAGE.url("http://h/m", "http://h/s") == "http://h/s"


async def test_live_tokens_are_compared_with_the_requests_in_flight_when_the_page_was_read(
    server, client, state, clock
):
    """The page says 3 running in 18 of 19 usable 128-token blocks (2,304 tokens allocated); the
    proxy relayed 3 requests then. They end before the next derive (it also runs after GPU polls and
    other replicas' scrapes) and a new one starts: the estimate is still that of the page's moment."""
    from kvwatch.agent.derived import update_derived
    from kvwatch.config import HostPort
    from kvwatch.derive.fragmentation import PROXY_ESTIMATE
    from kvwatch.model import InFlightRequest

    server.body = page("vllm_0_32_cpu_preempting.prom")
    config = Config(
        replicas=(replica(server.url, api_url="http://127.0.0.1:1", proxy_listen=HostPort("127.0.0.1", 0)),)
    )

    def request(started_at: float, generated: int) -> int:
        handle = state.in_flight.start(InFlightRequest("r0", "tiny", "0-1k", 100, 0, started_at))
        state.in_flight.progress(handle, generated)
        return handle

    at_page = [request(1.0, 600), request(2.0, 650), request(3.0, 700)]
    await scrape_target(client, config.replicas[0], SCRAPE, state, now=clock)
    for handle in at_page:
        state.in_flight.finish(handle)
    request(4.0, 50)  # started after the page was read: the engine's counts do not hold it

    view = update_derived(state, config, clock.t + 2.0)
    [frag] = view.fragmentation
    assert (frag.source, frag.live_tokens, frag.allocated_tokens) == (PROXY_ESTIMATE, 2250.0, 2304.0)
    assert frag.ratio == pytest.approx(1 - 2250 / 2304)
