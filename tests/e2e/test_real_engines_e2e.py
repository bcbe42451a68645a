"""``kvwatch run`` (the real CLI, as a subprocess) in front of the real vLLM and the real llama.cpp
server, proxies on, scraped by a real Prometheus that evaluates the shipped rule files unmodified.

* Requests from the official ``openai`` client (chat and completions, streaming and not) through
  kvwatch's proxies land in ``kvwatch_requests_total`` and the request histograms of the right
  length band, with counts equal to what was sent.
* Eight-plus concurrent long ``ignore_eos`` streams make the tiny vLLM (20 KV blocks of 128 tokens)
  preempt: kvwatch's KV signals show it and Prometheus puts ``KVWatchPreemptionStorm`` in pending.
* The engines' own numbers come through normalized. kvwatch serves what its last scrape read, and
  under load vLLM's gauges move faster than any outside scrape can pin them, so kvwatch scrapes vLLM
  through a recording relay: every vLLM page kvwatch read is kept, and kvwatch's exported gauges
  and counters must equal, exactly, those of the page its scrape read (found by the scrape's
  ``source_last_success_timestamp``). Independently, counters are bracketed by scrapes of our own
  (engine A <= kvwatch <= engine B), and everything must agree exactly once the engine is idle.
  ``kvwatch inspect FILE`` on the same pages says what vLLM says in them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvwatch.model import OUTCOMES, LengthBands
from tests.engines.real_checks import inspect_json
from tests.local import until, wait_vllm_idle

from .stack import (
    KvwatchRun,
    Prometheus,
    RecordingRelay,
    Sample,
    free_port,
    one,
    parse,
    select,
    total,
    wait_until,
)

pytestmark = [pytest.mark.real_vllm, pytest.mark.real_llamacpp, pytest.mark.slow]

BANDS = LengthBands((8, 32))  # small edges: the tiny engines' short outputs span three bands
MAX_TOKENS = {"0-8": 4, "8-32": 16, "32+": 40}  # one output length per band (ignore_eos: exact)
CHAT = [{"role": "user", "content": "Say something long."}]
VLLM, LLAMA = "vllm-0", "llama-0"
LOAD_STREAMS = 10  # > max-num-seqs 8: two always wait, the running ones outgrow 20 blocks
LOAD_MAX_TOKENS = 1500
LOAD_DEADLINE_S = 240.0  # the alert: ~90 s here, 155 s in one CI run (a slower vLLM preempts less)
# a kvwatch scrape of vLLM that started after our own read, at most this long: one scrape may run out
# its 10 s timeout and back off 2 s before the next takes up to 10 s, and on this VM under the load a
# sleeping process pinned to either core woke 1-9 s late (every process stalls, kvwatch included);
# a clean-clone CI run waited 30 s in vain
BRACKET_WAIT_S = 90.0
ALERT = "KVWatchPreemptionStorm"
PRESSURE = "KVWatchKVCachePressure"


def agent_config(vllm, llama, vllm_metrics_url: str | None = None) -> dict[str, Any]:
    return {
        "node": "e2e-node",
        "metrics": {"profile": "full"},  # request series per replica: what these tests count
        "log_level": "info",
        "length_bands": list(BANDS.edges),
        "intervals": {"engine": "0.5s"},  # short brackets: vLLM's gauges move every few hundred ms
        "scrape": {"timeout": "10s", "backoff_max": "2s"},  # vLLM's frontend stalls on a busy 2-core box
        "nvml": {"enabled": False},
        "replicas": [
            {
                "name": VLLM,
                "backend": "vllm",
                "metrics_url": vllm_metrics_url or vllm.metrics_url,
                "api_url": vllm.base_url,
                "proxy_listen": f"127.0.0.1:{free_port()}",
                "model_name": "tiny",
            },
            {
                "name": LLAMA,
                "backend": "llamacpp",
                "metrics_url": llama.metrics_url,
                "api_url": llama.base_url,
                "proxy_listen": f"127.0.0.1:{free_port()}",
                "model_name": llama.model,
            },
        ],
    }


def proxy_url(agent: KvwatchRun, replica: str) -> str:
    (rep,) = [r for r in agent.config["replicas"] if r["name"] == replica]
    return f"http://{rep['proxy_listen']}/v1"


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], KvwatchRun]]:
    started: list[KvwatchRun] = []

    def start(config: dict[str, Any]) -> KvwatchRun:
        agent = KvwatchRun(config, tmp_path, name=f"kvwatch-{len(started)}")
        started.append(agent)
        return agent.start()

    try:
        yield start
    finally:
        for agent in started:
            agent.stop()


def engine_samples(url: str) -> list[Sample]:
    return parse(httpx.get(url, timeout=30).text)


# -- 1. requests through the proxies, per band ------------------------------------------------------


def _usage_chunks(chunks: list) -> list:
    """Usage-only chunks (``choices: []``), the ones kvwatch asks for and must strip again. (llama.cpp
    puts usage on its final content chunk of /v1/completions by itself; that one stays.)"""
    return [c for c in chunks if c.usage is not None and not c.choices]


def _content_chunks(chunks: list) -> int:
    """Content-bearing chunks as the client saw them (kvwatch's definition, ``requests/sse.py``): a
    random-weight model's token can be an incomplete UTF-8 byte that the engine sends no text for."""

    def text(c) -> str:
        choice = c.choices[0]
        delta = getattr(choice, "delta", None)
        return (delta.content if delta is not None else choice.text) or ""

    return sum(1 for c in chunks if c.choices and text(c))


def _send_every_shape(base_url: str, model: str) -> dict[str, list[int]]:
    """Chat and completions, streaming and not, one of each per band. Returns, per band, the
    content-bearing chunk count of each streaming request (what TTFT and gaps are measured on)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    streamed: dict[str, list[int]] = {}
    try:
        for band, max_tokens in MAX_TOKENS.items():
            extra = {"max_tokens": max_tokens, "extra_body": {"ignore_eos": True}}
            chunks = list(client.chat.completions.create(model=model, messages=CHAT, stream=True, **extra))
            assert chunks and not _usage_chunks(chunks), "kvwatch's usage chunk reached the client"
            assert chunks[-1].choices[0].finish_reason == "length"
            reply = client.chat.completions.create(model=model, messages=CHAT, **extra)
            assert reply.usage.completion_tokens == max_tokens and reply.choices[0].finish_reason == "length"
            text = list(
                client.completions.create(model=model, prompt="Once upon a time", stream=True, **extra)
            )
            assert text and not _usage_chunks(text)
            done = client.completions.create(model=model, prompt="Once upon a time", **extra)
            assert done.usage.completion_tokens == max_tokens
            streamed[band] = [_content_chunks(chunks), _content_chunks(text)]
    finally:
        client.close()
    return streamed


def _observed(samples: list[Sample], name: str, **labels: str) -> float:
    """The value of the one series ``name`` has there; 0 where it has none: a request histogram's
    series appear with its first observation, and a random-weight model's short stream can carry no
    content chunk, or one (no gap), in a band."""
    found = select(samples, name, **labels)
    assert len(found) <= 1, found
    return found[0].value if found else 0.0


def test_openai_traffic_through_both_proxies_is_counted_per_band(real_vllm, real_llamacpp, start_agent):
    """4 requests per band and replica (chat/completions x streaming/not), all cut by max_tokens.
    Streaming requests have a TTFT when at least one content chunk came, a TPOT with it, and
    (chunks - 1) inter-chunk gaps; every request has an e2e and an output-token count."""
    agent = start_agent(agent_config(real_vllm, real_llamacpp))
    streamed = {
        VLLM: _send_every_shape(proxy_url(agent, VLLM), "tiny"),
        LLAMA: _send_every_shape(proxy_url(agent, LLAMA), real_llamacpp.model),
    }
    wait_until(
        lambda: total(agent.metrics(), "kvwatch_requests_total") == 24,
        30,
        "every request in kvwatch_requests_total",
    )
    m = agent.metrics()
    for replica, model in ((VLLM, "tiny"), (LLAMA, real_llamacpp.model)):
        mine = dict(replica=replica, model_name=model, source="proxy")
        counted = {
            (s.labels["length_band"], s.labels["outcome"]): s.value
            for s in select(m, "kvwatch_requests_total", **mine)
            if s.value
        }
        assert counted == {(band, "truncated"): 4 for band in MAX_TOKENS}, (replica, counted)
        # pre-created: every band x outcome has a series from the start, zero where nothing happened
        assert len(select(m, "kvwatch_requests_total", **mine)) == len(BANDS.all_names) * len(OUTCOMES)
        for band, max_tokens in MAX_TOKENS.items():
            where = dict(mine, length_band=band)
            with_first_chunk = sum(1 for n in streamed[replica][band] if n > 0)
            gaps = sum(n - 1 for n in streamed[replica][band] if n > 1)
            assert one(m, "kvwatch_request_duration_seconds_count", **where) == 4  # every request
            assert one(m, "kvwatch_request_output_tokens_count", **where) == 4
            assert one(m, "kvwatch_request_output_tokens_sum", **where) == 4 * max_tokens
            assert _observed(m, "kvwatch_request_ttft_seconds_count", **where) == with_first_chunk
            assert _observed(m, "kvwatch_request_ttft_seconds_bucket", le="+Inf", **where) == with_first_chunk
            assert _observed(m, "kvwatch_request_tpot_seconds_count", **where) == with_first_chunk
            assert _observed(m, "kvwatch_request_inter_chunk_seconds_count", **where) == gaps
            assert _observed(m, "kvwatch_request_ttft_seconds_sum", **where) <= one(
                m, "kvwatch_request_duration_seconds_sum", **where
            )
        assert sum(n > 0 for band in MAX_TOKENS for n in streamed[replica][band]) >= 4, streamed
        assert total(m, "kvwatch_request_output_tokens_estimated_total", **mine) == 0
        assert not select(m, "kvwatch_request_duration_seconds_count", length_band="unknown", **mine)
        assert total(m, "kvwatch_requests_in_flight", replica=replica) == 0


# -- 2. preemptions under memory pressure: KV signals and the alert -----------------------------------


@dataclass
class Bracket:
    engine_before: list[Sample]
    kvwatch: list[Sample]
    engine_after: list[Sample]
    scrape_started: float  # when the first kvwatch scrape of vLLM after engine_before started
    rendered: float  # when kvwatch's render of ``kvwatch`` had been read in full
    pages_read: list[list[Sample]] = field(default_factory=list)  # relay pages in between
    page_texts: list[str] = field(default_factory=list)  # the same pages as vLLM served them


@dataclass
class LoadRun:
    """What one preempting load through kvwatch's vLLM proxy showed (collected once per module)."""

    agent_series: list[list[Sample]] = field(default_factory=list)  # kvwatch's vLLM series over time
    brackets: list[Bracket] = field(default_factory=list)
    alert_states: dict[str, set[str]] = field(default_factory=dict)
    seconds_to_alert: float | None = None
    streams_finished: int = 0
    duration_s: float = 0.0
    alerts_recorded: list[dict[str, Any]] = field(default_factory=list)  # ALERTS in Prometheus' TSDB
    rule_errors: list[str] = field(default_factory=list)
    from_prometheus: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # query -> result
    idle_engine: list[Sample] = field(default_factory=list)
    idle_kvwatch: list[Sample] = field(default_factory=list)


async def _engine_page(http: httpx.AsyncClient, engine_url: str) -> list[Sample]:
    # a fresh connection each time: brackets are about as far apart as uvicorn's 5 s keep-alive, and a
    # pooled connection the server is closing just then fails with "disconnected without a response"
    return parse((await http.get(engine_url, timeout=60, headers={"Connection": "close"})).text)


def _vllm_scrape_started(mine: list[Sample]) -> float:
    """When kvwatch's last successful scrape of vLLM started, by its own metrics (0: none yet)."""
    stamp = select(mine, "kvwatch_source_last_success_timestamp_seconds", source=f"engine:{VLLM}")
    return stamp[0].value if stamp else 0.0


def _scrape_diagnosis(mine: list[Sample], agent: KvwatchRun) -> str:
    """What kvwatch said about its vLLM target when no scrape of it succeeded in time."""
    target = [
        f"{s.name}{s.labels} = {s.value:g}"
        for s in mine
        if s.name.startswith("kvwatch_target_") and s.labels.get("replica") == VLLM
        if s.value or s.name == "kvwatch_target_up"  # up, and the counters that moved
    ]
    return (
        "kvwatch's vLLM target: " + "; ".join(target) + "\nkvwatch's log, last lines:\n" + agent.log()[-3000:]
    )


async def _read_bracket(http: httpx.AsyncClient, agent: KvwatchRun, engine_url: str) -> Bracket:
    before = await _engine_page(http, engine_url)
    after_before = time.time()

    seen: list[Sample] = []

    async def scrape_after_a() -> float | None:
        nonlocal seen
        seen = parse((await http.get(f"{agent.url}/metrics", timeout=30)).text)
        started = _vllm_scrape_started(seen)
        return started if started > after_before else None

    try:
        started = await until(
            scrape_after_a, BRACKET_WAIT_S, "a kvwatch scrape of vLLM that started after A", 0.1
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_scrape_diagnosis(seen, agent)}") from None
    # read once more: the render runs in a thread and may have read the samples just before the
    # scrape that set the timestamp; one that starts now sees samples of that scrape or a later one
    # (scrapes run every 0.5 s, and a render on this loaded box can take seconds), so the page it
    # shows is among those served from ``started`` until the render was read
    mine = parse((await http.get(f"{agent.url}/metrics", timeout=30)).text)
    rendered = time.time()
    after = await _engine_page(http, engine_url)
    return Bracket(before, mine, after, started, rendered)


async def _long_stream(client: openai.AsyncOpenAI, i: int) -> int:
    stream = await client.completions.create(
        model="tiny",
        prompt="hello world " * (20 + i % 40),
        max_tokens=LOAD_MAX_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return sum([1 async for _ in stream])


async def _alerts(http: httpx.AsyncClient, prom: Prometheus) -> list[dict[str, Any]]:
    """Prometheus' alerts now; none this round if the poll times out (this box under the load has
    stalled a connect to Prometheus for over 10 s; the next round asks again)."""
    try:
        reply = await http.get(f"{prom.url}/api/v1/alerts", timeout=30)
    except httpx.TimeoutException:
        return []
    return reply.json()["data"]["alerts"]


async def _drive_load(agent: KvwatchRun, prom: Prometheus, engine_url: str) -> LoadRun:
    run = LoadRun()
    client = openai.AsyncOpenAI(
        base_url=proxy_url(agent, VLLM),
        api_key="unused",
        max_retries=0,
        timeout=openai.Timeout(600, connect=60),  # the HTTP library openai itself uses (httpx2 from 3.x)
    )
    streams: list[asyncio.Task] = []
    started = time.monotonic()
    try:
        async with httpx.AsyncClient() as http:
            streams = [asyncio.create_task(_long_stream(client, i)) for i in range(LOAD_STREAMS)]
            sent = LOAD_STREAMS
            while time.monotonic() - started < LOAD_DEADLINE_S:
                for i, task in enumerate(streams):  # keep LOAD_STREAMS in flight
                    if task.done():
                        assert task.result() > 0  # re-raises a failed stream
                        run.streams_finished += 1
                        streams[i] = asyncio.create_task(_long_stream(client, sent))
                        sent += 1
                bracket = await _read_bracket(http, agent, engine_url)
                run.brackets.append(bracket)
                run.agent_series.append([s for s in bracket.kvwatch if s.labels.get("replica") == VLLM])
                for alert in await _alerts(http, prom):
                    run.alert_states.setdefault(alert["labels"]["alertname"], set()).add(alert["state"])
                if ALERT in run.alert_states and run.seconds_to_alert is None:
                    run.seconds_to_alert = time.monotonic() - started
                if not _still_missing(run):
                    break
    finally:
        run.duration_s = time.monotonic() - started
        for task in streams:
            task.cancel()  # the client goes away: kvwatch closes upstream, vLLM aborts and frees KV
        await asyncio.gather(*streams, return_exceptions=True)
        await client.close()
    return run


def _gauges(samples: list[Sample], prefix: str) -> tuple[float, ...]:
    if prefix == "vllm:":
        names = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
        return tuple(total(samples, n) for n in names)
    names = ("kvwatch_kv_usage_ratio", "kvwatch_requests_running", "kvwatch_requests_waiting")
    return tuple(total(samples, n, replica=VLLM) for n in names)


def _still_missing(run: LoadRun) -> list[str]:
    """What the tests below look for that this load has not shown yet: the load stops once it is all
    there (or at LOAD_DEADLINE_S), so a fast machine does not wait for a slow one's deadline."""

    def peak(name: str, **labels: str) -> float:
        return max(_series(run, name, **labels), default=0.0)

    def grew(name: str, **labels: str) -> bool:
        values = _series(run, name, **labels)
        return len(values) > 1 and values[-1] > values[0]

    wanted = {
        "preemption alert": run.seconds_to_alert is not None,
        "pressure alert": PRESSURE in run.alert_states,
        "busy brackets": sum(1 for b in run.brackets if _busy(b.engine_before)) >= 3,
        "full KV pool": peak("kvwatch_kv_usage_ratio") >= 0.95,
        "waiting requests": peak("kvwatch_requests_waiting") > 0,
        "all streams in flight": peak("kvwatch_requests_in_flight") == LOAD_STREAMS,
        "zero headroom": min(_series(run, "kvwatch_kv_headroom_seconds"), default=1.0) == 0,
        "preemptions": grew("kvwatch_preemptions_total"),
        "recomputation": grew("kvwatch_recomputed_tokens_total", source="estimate"),
    }
    return [what for what, seen in wanted.items() if not seen]


def _busy(engine: list[Sample]) -> bool:
    _, running, waiting = _gauges(engine, "vllm:")
    return running + waiting > 0


@pytest.fixture(scope="module")
def preempting_load(real_vllm, real_llamacpp, tmp_path_factory) -> Iterator[LoadRun]:
    """kvwatch + Prometheus (shipped rules, 1 s scrape and evaluation); 10 long streams through the
    proxy until the alert is pending (at most LOAD_DEADLINE_S); then everything stops and vLLM is
    left idle for the other tests that share it."""
    workdir = tmp_path_factory.mktemp("preempting-load")
    relay = RecordingRelay(real_vllm.metrics_url, workdir).start()
    agent = KvwatchRun(agent_config(real_vllm, real_llamacpp, relay.url), workdir)
    prom = Prometheus(workdir, [f"127.0.0.1:{agent.port}"])
    try:
        agent.start()
        prom.start()
        wait_until(lambda: prom.query('up{job="kvwatch"} == 1'), 60, "Prometheus to scrape kvwatch")
        run = asyncio.run(_drive_load(agent, prom, real_vllm.metrics_url))
        for bracket in run.brackets:
            bracket.page_texts = relay.pages_between(bracket.scrape_started, bracket.rendered)
            bracket.pages_read = [parse(page) for page in bracket.page_texts]
        wait_vllm_idle(real_vllm.metrics_url)
        idle_at = time.time()
        # the streams cancelled at the end are recorded as they close: read back from a scrape after
        # that (a clean-clone run read 9 of the 10 load requests from the scrape before)
        wait_until(
            lambda: prom.query(f'timestamp(up{{job="kvwatch"}}) > {idle_at + 1}'),
            30,
            "a Prometheus scrape of kvwatch after the load",
        )
        run.alerts_recorded = prom.query("max_over_time(ALERTS[10m])")
        run.rule_errors = prom.rule_errors()
        for expr in READ_BACK:
            run.from_prometheus[expr] = prom.query(expr)
        run.idle_engine = engine_samples(real_vllm.metrics_url)
        wait_until(
            lambda: _vllm_scrape_started(agent.metrics()) > idle_at, 30, "a kvwatch scrape of the idle vLLM"
        )
        # read once more: a render may hold the samples of the scrape before the one that set the stamp
        run.idle_kvwatch = agent.metrics()
        yield run
    finally:
        prom.stop()
        agent.stop()
        relay.stop()
        with contextlib.suppress(AssertionError, httpx.HTTPError):
            wait_vllm_idle(real_vllm.metrics_url, 60)


def _series(run: LoadRun, name: str, **labels: str) -> list[float]:
    """kvwatch's value of ``name`` at each bracket where it was exported."""
    return [total(m, name, **labels) for m in run.agent_series if select(m, name, **labels)]


@pytest.mark.prometheus
def test_vllm_preemptions_show_up_in_kvwatchs_kv_signals(preempting_load: LoadRun):
    run = preempting_load
    preemptions = _series(run, "kvwatch_preemptions_total")
    assert len(preemptions) == len(run.agent_series), "vLLM's series dropped out while it was up"
    assert preemptions[-1] > preemptions[0], f"no preemption in {run.duration_s:.0f} s of load: {preemptions}"
    assert preemptions == sorted(preemptions)
    usage = _series(run, "kvwatch_kv_usage_ratio")
    # a 1 s sample sees the pool just after a preemption freed its victim's blocks: 18 of the 19
    # usable blocks (0.947) is as full as CI's samples have caught it
    assert max(usage) >= 0.9, f"the KV pool never filled: {usage}"
    assert max(_series(run, "kvwatch_requests_waiting")) > 0
    assert _series(run, "kvwatch_kv_capacity_tokens") == [2560.0] * len(run.agent_series)
    # headroom is 0 while the engine preempts (it ran out of blocks within the window)
    headroom = _series(run, "kvwatch_kv_headroom_seconds")
    assert headroom and min(headroom) == 0, headroom
    # vLLM does not count recomputed tokens: kvwatch estimates them, and says so in the label
    recomputed = _series(run, "kvwatch_recomputed_tokens_total", source="estimate")
    assert recomputed and recomputed[-1] > recomputed[0] >= 0, recomputed
    assert _series(run, "kvwatch_kv_live_tokens", source="proxy_estimate"), "no live-token estimate"
    in_flight = _series(run, "kvwatch_requests_in_flight")
    assert max(in_flight) == LOAD_STREAMS, in_flight


READ_BACK = (  # kvwatch series read back through Prometheus' HTTP API
    'kvwatch_target_up{job="kvwatch"}',
    'kvwatch_kv_capacity_tokens{job="kvwatch"}',
    'max_over_time(kvwatch_kv_usage_ratio{job="kvwatch"}[10m])',
    'increase(kvwatch_preemptions_total{job="kvwatch"}[10m])',
    'sum by (replica, length_band) (kvwatch_requests_total{job="kvwatch"})',
    'kvwatch_build_info{job="kvwatch"}',
)


@pytest.mark.prometheus
def test_prometheus_stores_kvwatchs_series_as_exported(preempting_load: LoadRun):
    """A real Prometheus scraping ``kvwatch run``: the series come back through its HTTP API with the
    values and labels kvwatch exported (the exposition is valid for Prometheus, not only promtool)."""
    got = {
        expr: {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in result}
        for expr, result in preempting_load.from_prometheus.items()
    }

    def by_replica(expr: str) -> dict[str, float]:
        return {dict(k)["replica"]: v for k, v in got[expr].items()}

    assert by_replica(READ_BACK[0]) == {VLLM: 1.0, LLAMA: 1.0}
    assert by_replica(READ_BACK[1])[VLLM] == 2560.0
    assert by_replica(READ_BACK[2])[VLLM] >= 0.9  # as in the KV-signals test: sampled after preemptions
    assert by_replica(READ_BACK[3])[VLLM] > 0
    bands = {(dict(k)["replica"], dict(k)["length_band"]): v for k, v in got[READ_BACK[4]].items()}
    assert "unknown" in {band for replica, band in bands if replica == VLLM}  # zero-initialised bands
    assert sum(v for (replica, _), v in bands.items() if replica == VLLM) >= LOAD_STREAMS
    (build,) = got[READ_BACK[5]]
    assert dict(build)["version"] and dict(build)["instance"]


@pytest.mark.prometheus
def test_preemption_storm_alert_goes_pending_in_prometheus_with_the_shipped_rules(preempting_load: LoadRun):
    """``KVWatchPreemptionStorm``: preemptions above 0.05/s over 10 minutes and above half the
    finishing rate, ``for: 10m``. The tiny vLLM preempts ~0.2-1/s under this load, so the 10-minute
    rate of a series Prometheus has seen for ~1 minute crosses 0.05/s (30 preemptions) within the
    time box; ``for: 10m`` then holds it in pending (firing would take 10 more minutes). The load
    runs until the alert is seen or LOAD_DEADLINE_S is up; the bracket that sees it may end a few
    seconds past that."""
    run = preempting_load
    print(
        f"{ALERT} pending after {run.seconds_to_alert} s; load ran {run.duration_s:.0f} s, "
        f"{len(run.brackets)} brackets, {run.streams_finished} streams finished; seen {run.alert_states}"
    )
    assert not run.rule_errors, run.rule_errors
    recorded = {(a["metric"]["alertname"], a["metric"]["alertstate"]) for a in run.alerts_recorded}
    seen = run.alert_states.get(ALERT, set()) | {state for name, state in recorded if name == ALERT}
    assert "pending" in seen or "firing" in seen, (
        f"{ALERT} never pending in {run.duration_s:.0f} s; alerts seen: {run.alert_states}, "
        f"recorded: {sorted(recorded)}"
    )
    assert run.seconds_to_alert is not None, f"{ALERT} went pending only after the load stopped"
    storm = [a for a in run.alerts_recorded if a["metric"]["alertname"] == ALERT]
    assert {a["metric"]["replica"] for a in storm} == {VLLM}
    assert all(a["metric"]["job"] == "kvwatch" and a["metric"]["severity"] == "warning" for a in storm)
    # the KV pressure alert (pool > 95% full while preempting) went pending on the way
    assert PRESSURE in run.alert_states or (PRESSURE, "pending") in recorded


COUNTERS = (  # vLLM family -> kvwatch family
    ("vllm:num_preemptions_total", "kvwatch_preemptions_total"),
    ("vllm:generation_tokens_total", "kvwatch_generation_tokens_total"),
    ("vllm:prompt_tokens_total", "kvwatch_prompt_tokens_total"),
    ("vllm:prefix_cache_queries_total", "kvwatch_prefix_cache_queried_tokens_total"),
    ("vllm:prefix_cache_hits_total", "kvwatch_prefix_cache_hit_tokens_total"),
    ("vllm:request_success_total", "kvwatch_engine_finished_requests_total"),
)


def _exported(samples: list[Sample], prefix: str = "kvwatch_") -> tuple[float, ...]:
    """Every gauge and counter both sides carry, in one tuple: equal means the same moment."""
    index = 0 if prefix == "vllm:" else 1
    return _gauges(samples, prefix) + tuple(total(samples, names[index]) for names in COUNTERS)


def _capacity(engine: list[Sample]) -> tuple[float, float]:
    (info,) = select(engine, "vllm:cache_config_info")
    block_size = float(info.labels["block_size"])
    return float(info.labels["num_gpu_blocks"]) * block_size, block_size


@pytest.mark.prometheus
def test_kvwatch_agrees_with_vllms_own_metrics_bracketed(preempting_load: LoadRun):
    run = preempting_load
    capacity, block_size = _capacity(run.idle_engine)
    assert (capacity, block_size) == (2560.0, 128.0)
    busy = 0
    for b in run.brackets:
        mine = [s for s in b.kvwatch if s.labels.get("replica") == VLLM]
        assert one(mine, "kvwatch_kv_capacity_tokens") == capacity
        assert one(mine, "kvwatch_kv_block_size_tokens") == block_size
        for engine_name, kvwatch_name in COUNTERS:
            lo, hi = total(b.engine_before, engine_name), total(b.engine_after, engine_name)
            got = total(mine, kvwatch_name)
            assert lo <= got <= hi, (kvwatch_name, lo, got, hi)
        # exactly the samples of one page vLLM served between the scrape and the render
        assert b.pages_read, f"the relay served nothing after kvwatch's scrape at {b.scrape_started}"
        read = [page for page in b.pages_read if _exported(mine) == _exported(page, "vllm:")]
        assert read, (
            f"kvwatch exported {_exported(mine)}; vLLM's pages at that scrape said "
            f"{[_exported(page, 'vllm:') for page in b.pages_read]}"
        )
        busy += _busy(read[0])
    assert busy >= 3, f"only {busy} brackets while vLLM was busy, of {len(run.brackets)}"
    # idle: everything agrees exactly
    mine = [s for s in run.idle_kvwatch if s.labels.get("replica") == VLLM]
    assert _gauges(mine, "kvwatch_") == _gauges(run.idle_engine, "vllm:") == (0.0, 0.0, 0.0)
    for engine_name, kvwatch_name in COUNTERS:
        assert total(mine, kvwatch_name) == total(run.idle_engine, engine_name), kvwatch_name
    for reason in ("length", "abort", "stop"):
        assert total(mine, "kvwatch_engine_finished_requests_total", finished_reason=reason) == total(
            run.idle_engine, "vllm:request_success_total", finished_reason=reason
        )
    assert one(run.idle_kvwatch, "kvwatch_target_up", replica=VLLM) == 1


@pytest.mark.prometheus
def test_kvwatch_inspect_reads_vllms_pages_under_preemption_as_vllm_does(
    preempting_load: LoadRun, tmp_path: Path
):
    """``kvwatch inspect FILE`` on the pages vLLM served during the preempting load: what a user
    checking their engine would see, equal to vLLM's own numbers on the same page."""
    busy = 0
    for n, b in enumerate(run for run in preempting_load.brackets if run.page_texts):
        page = tmp_path / f"vllm-{n}.prom"
        page.write_text(b.page_texts[0])
        engine = b.pages_read[0]
        (x,) = inspect_json(str(page))["replicas"]
        assert (x["backend"], x["kv_capacity_tokens"], x["block_size"]) == ("vllm", 2560.0, 128)
        assert (x["kv_usage_ratio"], x["requests_running"], x["requests_waiting"]) == _gauges(engine, "vllm:")
        assert x["preemptions_total"] == total(engine, "vllm:num_preemptions_total")
        assert x["generation_tokens_total"] == total(engine, "vllm:generation_tokens_total")
        assert x["prompt_tokens_total"] == total(engine, "vllm:prompt_tokens_total")
        busy += _busy(engine)
    assert busy >= 3, f"only {busy} of the pages were read while vLLM was busy"


# -- 3. llama.cpp: its numbers, normalized ---------------------------------------------------------


def _llama_bracket(agent: KvwatchRun, llama) -> tuple[list[Sample], list[Sample], list[Sample], list[dict]]:
    before = engine_samples(llama.metrics_url)
    slots = httpx.get(f"{llama.base_url}/slots", timeout=10).json()
    after_before = time.time()

    def fresh() -> list[Sample] | None:
        m = agent.metrics()
        stamp = select(m, "kvwatch_source_last_success_timestamp_seconds", source=f"engine:{LLAMA}")
        return m if stamp and stamp[0].value > after_before else None

    wait_until(fresh, 30, "a kvwatch scrape of llama-server")
    mine = [s for s in agent.metrics() if s.labels.get("replica") == LLAMA]
    after = engine_samples(llama.metrics_url)
    return before, mine, after, slots


LLAMA_COUNTERS = (
    ("llamacpp:tokens_predicted_total", "kvwatch_generation_tokens_total"),
    ("llamacpp:prompt_tokens_total", "kvwatch_prompt_tokens_total"),
)


def test_kvwatch_agrees_with_llamacpps_own_metrics(real_vllm, real_llamacpp, start_agent):
    agent = start_agent(agent_config(real_vllm, real_llamacpp))
    client = openai.OpenAI(base_url=proxy_url(agent, LLAMA), api_key="unused", max_retries=0, timeout=60)
    try:
        for _ in range(3):  # some traffic, then a bracket; llama.cpp finishes these in milliseconds
            client.completions.create(
                model=real_llamacpp.model, prompt="hello", max_tokens=32, extra_body={"ignore_eos": True}
            )
            before, mine, after, slots = _llama_bracket(agent, real_llamacpp)
            for engine_name, kvwatch_name in LLAMA_COUNTERS:
                lo, got, hi = total(before, engine_name), total(mine, kvwatch_name), total(after, engine_name)
                if kvwatch_name == "kvwatch_prompt_tokens_total":  # 2026 builds: processed + cached
                    lo += total(before, "llamacpp:prompt_tokens_cached_total")
                    hi += total(after, "llamacpp:prompt_tokens_cached_total")
                assert lo <= got <= hi, (kvwatch_name, lo, got, hi)
    finally:
        client.close()
    # idle: gauges and capacity exactly (capacity = the slots' n_ctx, llama.cpp has no KV gauge)
    assert one(mine, "kvwatch_requests_running") == total(after, "llamacpp:requests_processing") == 0
    assert one(mine, "kvwatch_requests_waiting") == total(after, "llamacpp:requests_deferred") == 0
    assert one(mine, "kvwatch_kv_capacity_tokens") == sum(s["n_ctx"] for s in slots) == 512
    assert one(mine, "kvwatch_kv_usage_ratio") == 0
    assert not select(mine, "kvwatch_kv_block_size_tokens"), "llama.cpp has no KV blocks to report"
    (info,) = select(mine, "kvwatch_replica_info")
    assert (info.labels["backend"], info.labels["model_name"]) == ("llamacpp", real_llamacpp.model)
