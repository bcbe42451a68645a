"""Native histograms against the real Debian Prometheus (2.42): quantiles, SLO rules and alerts agree.

One kvwatch agent (the real ``Agent`` and its HTTP server, in a thread of this process) is fed known
requests: ``N`` per output-length band, each band with its own TTFT and TPOT spread, some bands
breaching their SLO. Two real Prometheus servers scrape it every second:

* *classic*: no feature flag, so it asks for text and stores the classic ``_bucket`` series; it
  evaluates the shipped ``alerts/*.rules.yaml``;
* *native*: ``--enable-feature=native-histograms``, so it asks for protobuf and, 2.42 keeping one
  form per family (``model/textparse/protobufparse.go``; ``scrape_classic_histograms`` only came in
  2.45), stores the native series and no classic buckets of the families kvwatch sends natively;
  it evaluates ``alerts/native/*.rules.yaml`` (``kvwatch rules --native``).

Rates need an increase, and ``rate()`` extrapolates: the agent gets the same multiset of requests
twice, once before the servers start and once after both scraped it a few times. Every classic
series then starts at half its final value, so the zero clamp of the extrapolation never binds and
every series of a histogram gets the same factor; ratios and quantiles of the rates are those of
the requests fed, on both servers.

Bounds, each its own: ``histogram_quantile`` interpolates linearly within the bucket holding the
rank, so the classic estimate is within that classic bucket's width of the true quantile and the
native one within ``RELATIVE_ERROR`` (9.05 % at schema 3) of it. A latency SLI at a native-schema
boundary (TTFT 2 s) is exact both ways; elsewhere ``histogram_fraction`` is off by at most the share
of requests in the native bucket holding the threshold times the worse side of the interpolation.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from kvwatch.agent import Agent
from kvwatch.config import config_from_mapping
from kvwatch.gpu.fake import FakeNvml
from kvwatch.mixin.dashboards.check import panel_queries
from kvwatch.mixin.dashboards.scaffold import Options
from kvwatch.mixin.promql import CLASSIC, NATIVE, NATIVE_FAMILIES, selector
from kvwatch.mixin.rules import LATENCY_ALERT
from kvwatch.mixin.slo import LATENCY_SLIS, load_slo_file
from kvwatch.model import Outcome, RequestRecord
from kvwatch.native_histogram import RELATIVE_ERROR, SCHEMA, bucket_index, upper_bound

from .stack import ROOT, Prometheus, wait_until

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

NATIVE_RULES = tuple(sorted((ROOT / "alerts" / "native").glob("*.rules.yaml")))
SLO = load_slo_file(ROOT / "alerts" / "slo.yaml")
MODEL = "qwen3-32b"
N = 197  # requests per band and step; prime, so q * N is never a whole rank for the q below
QUANTILES = (0.5, 0.9, 0.99)
#: output tokens of each band's requests (default band edges 1k / 5k / 10k / 20k)
BAND_OUTPUTS = {"0-1k": 300, "1k-5k": 3000, "5k-10k": 7000, "10k-20k": 15000, "20k+": 25000}
HEALTHY_TTFT = (0.05, 1.5)  # below the native bucket of every TTFT threshold (2, 5, 10 s)
HEALTHY_TPOT = (0.01, 0.045)  # below the native bucket of every TPOT threshold (50, 60, 75 ms)
#: per band: (count, range) parts of its TTFTs and TPOTs; what is not listed is healthy
BREACHES: dict[str, dict[str, list[tuple[int, tuple[float, float]]]]] = {
    # over 2 s, a schema-3 boundary: exact natively
    "0-1k": {"ttft": [(59, (2.2, 6.0))]},
    # around 5 s, inside the native bucket (4.757, 5.187] s: interpolated natively
    "5k-10k": {"ttft": [(20, (4.77, 5.18)), (37, (6.0, 9.0))]},
    # around 75 ms, inside the native bucket (74.33, 81.05] ms
    "20k+": {"tpot": [(20, (0.0745, 0.0810)), (37, (0.09, 0.14))]},  # e2e stays under 3600 s
}
#: (slo, length_band) the data above must page and ticket for, on both servers
BREACHED = {("ttft-short", "0-1k"), ("ttft-medium", "5k-10k"), ("tpot-long", "20k+")}
FAMILIES = {sli: family for sli, (family, _) in LATENCY_SLIS.items()}


def _values(
    rng: random.Random, parts: list[tuple[int, tuple[float, float]]], healthy: tuple[float, float]
) -> list[float]:
    """N log-uniform values: each part's count in its range, the rest in ``healthy``; shuffled."""
    out: list[float] = []
    for count, (lo, hi) in [*parts, (N - sum(c for c, _ in parts), healthy)]:
        out += [math.exp(rng.uniform(math.log(lo), math.log(hi))) for _ in range(count)]
    rng.shuffle(out)
    return out


def band_records() -> list[RequestRecord]:
    """One step's requests: N per band, TTFT and TPOT as ``BREACHES`` says, e2e = TTFT + TPOT x (n - 1)."""
    rng = random.Random(22)
    records = []
    for band, output in BAND_OUTPUTS.items():
        ttfts = _values(rng, BREACHES.get(band, {}).get("ttft", []), HEALTHY_TTFT)
        tpots = _values(rng, BREACHES.get(band, {}).get("tpot", []), HEALTHY_TPOT)
        for ttft, tpot in zip(ttfts, tpots, strict=True):
            records.append(
                RequestRecord(
                    replica="replica-0",
                    model_name=MODEL,
                    source="proxy",
                    outcome=Outcome.COMPLETED,
                    started_at=time.time(),
                    prompt_tokens=1000,
                    output_tokens=output,
                    max_tokens=32000,
                    ttft_seconds=ttft,
                    e2e_seconds=ttft + tpot * (output - 1),
                )
            )
    return records


def observed(records: list[RequestRecord], family: str, band: str) -> list[float]:
    """The values of ``family`` kvwatch's histograms were fed for ``band``, sorted."""
    read: dict[str, Callable[[RequestRecord], float | None]] = {
        "kvwatch_request_ttft_seconds": lambda r: r.ttft_seconds,
        "kvwatch_request_tpot_seconds": lambda r: r.tpot_seconds,
        "kvwatch_request_duration_seconds": lambda r: r.e2e_seconds,
    }
    out = [read[family](r) for r in records if r.output_tokens == BAND_OUTPUTS[band]]
    return sorted(v for v in out if v is not None)


class AgentThread:
    """The real ``Agent`` (no engines, one fake GPU) on its own event loop in a thread, so the
    module's Prometheus servers scrape it while the tests block."""

    def __init__(self) -> None:
        config = config_from_mapping({"node": "native-e2e", "listen": "127.0.0.1:0", "replicas": []})
        self.agent = Agent(config, nvml=FakeNvml(1))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="native-e2e-agent", daemon=True)

    def start(self) -> str:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.agent.start(), self._loop).result(timeout=60)
        return f"127.0.0.1:{self.agent.port}"

    def record(self, records: list[RequestRecord]) -> None:
        async def feed() -> None:
            for r in records:
                self.agent.record(r)

        asyncio.run_coroutine_threadsafe(feed(), self._loop).result(timeout=60)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.agent.stop(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


@dataclass
class NativeRun:
    instance: str
    classic: Prometheus
    native: Prometheus
    records: list[RequestRecord]  # one step's requests (the agent got them twice)


def _scrapes(prom: Prometheus) -> int:
    result = prom.query('count_over_time(up{job="kvwatch"}[5m])')
    return int(float(result[0]["value"][1])) if result else 0


def _latency_alerts(prom: Prometheus) -> set[tuple[str, str, str]]:
    return {
        (a["labels"]["slo"], a["labels"]["length_band"], a["labels"]["severity"])
        for a in prom.alerts()
        if a["labels"]["alertname"] == LATENCY_ALERT
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[NativeRun]:
    workdir = tmp_path_factory.mktemp("native-histograms")
    agent = AgentThread()
    started: list[Prometheus] = []
    try:
        instance = agent.start()
        records = band_records()
        agent.record(records)  # the baseline: every series starts at half its final value
        classic = Prometheus(workdir, [instance], name="classic")
        native = Prometheus(
            workdir,
            [instance],
            rule_files=NATIVE_RULES,
            name="native",
            extra_args=["--enable-feature=native-histograms"],
        )
        started += [classic, native]
        with ThreadPoolExecutor(2) as pool:  # Debian's prometheus takes a while to start
            list(pool.map(lambda p: p.start(ready_timeout_s=120), started))
        for prom in started:
            wait_until(lambda p=prom: _scrapes(p) >= 3, 60, f"{prom.workdir.name}: 3 scrapes of the baseline")
        agent.record(records)
        for prom in started:  # every breached band pages and tickets once the step is in the windows
            wait_until(
                lambda p=prom: {(s, b) for s, b, _ in _latency_alerts(p)} >= BREACHED,
                90,
                f"{prom.workdir.name}: the burn-rate alerts of {sorted(BREACHED)}",
                interval_s=1.0,
            )
        for _ in range(3):  # a few more evaluations of every group: chained rules have read the step
            moment = time.time()
            for prom in started:
                wait_until(
                    lambda p=prom, m=moment: p.evaluated_after(m), 30, f"{prom.workdir.name}: an evaluation"
                )
        yield NativeRun(instance, classic, native, records)
    finally:
        for prom in started:
            prom.stop()
        agent.stop()


def _most_extrapolation(prom: Prometheus, window_s: float) -> float:
    """The most that ``rate()`` scales an increase seen between a window's first and last samples
    (Prometheus's ``extrapolatedRate``): toward each edge of the window by at most 1.1 average scrape
    intervals, so by at most 2.2 of them over the span the samples cover. That span is read from the
    server's own scrape timestamps (every series here starts at the first scrape), less one interval:
    the recording rule ran up to an evaluation interval before this query. A step soon after the
    baseline leaves a short span: one run saw +21 % where the usual is a few %."""
    (scrapes,) = prom.query('up{job="kvwatch"}[10m]')
    times = [float(t) for t, _ in scrapes["values"]]
    interval = (times[-1] - times[0]) / (len(times) - 1)
    span = min(times[-1] - interval - times[0], window_s - interval)
    return 1 + 2.2 * interval / span


def _by_band(prom: Prometheus, expr: str) -> dict[str, float]:
    return {r["metric"]["length_band"]: float(r["value"][1]) for r in prom.query(expr)}


def _rated(series: str, *extra: object) -> str:
    return f"rate({selector(series, *extra)}[5m])"  # type: ignore[arg-type]


# ---- what each server scraped ----------------------------------------------------------------------


def test_without_the_flag_prometheus_scrapes_text_and_with_it_native_histograms(run: NativeRun) -> None:
    for family in sorted(NATIVE_FAMILIES & set(FAMILIES.values())):
        assert run.classic.query(f"count({family}_bucket)"), f"classic: no {family}_bucket"
        assert not run.classic.query(family), f"classic: a native {family}: it did not scrape text"
        native = run.native.query(family)
        assert native and all("histogram" in r for r in native), f"native: {family} is not native"
        assert not run.native.query(f"{family}_bucket"), f"native: {family}_bucket kept beside native"
    response = httpx.get(f"http://{run.instance}/metrics", timeout=10)  # no Accept at all
    assert response.headers["content-type"].startswith("text/plain")


# ---- quantiles ------------------------------------------------------------------------------------


def _classic_bucket_width(family: str, value: float) -> float:
    bounds = LATENCY_SLIS[next(s for s, f in FAMILIES.items() if f == family)][1]
    i = bisect.bisect_left(bounds, value)
    assert i < len(bounds), f"{value} is in the +Inf bucket of {family}"
    return bounds[i] - (bounds[i - 1] if i else 0.0)


@pytest.mark.parametrize("family", sorted(FAMILIES.values()))
def test_histogram_quantile_native_and_classic_are_each_within_their_bound_of_the_true_quantile(
    run: NativeRun, family: str
) -> None:
    worst_native, worst_classic = 0.0, 0.0
    for q in QUANTILES:
        classic = _by_band(run.classic, CLASSIC.quantile(q, family, _rated, "length_band"))
        native = _by_band(run.native, NATIVE.quantile(q, family, _rated, "length_band"))
        assert set(classic) == set(native) == set(BAND_OUTPUTS), (classic, native)
        for band in BAND_OUTPUTS:
            values = observed(run.records, family, band)
            true = values[math.ceil(q * len(values)) - 1]
            width = _classic_bucket_width(family, true)
            assert abs(classic[band] - true) <= width * (1 + 1e-9), (family, band, q, classic[band], true)
            assert abs(native[band] - true) <= RELATIVE_ERROR * true * (1 + 1e-9), (
                family,
                band,
                q,
                native[band],
                true,
            )
            worst_native = max(worst_native, abs(native[band] - true) / true)
            worst_classic = max(worst_classic, abs(classic[band] - true) / true)
    print(
        f"{family}: worst relative error native {worst_native:.2%} (bound {RELATIVE_ERROR:.2%}), "
        f"classic {worst_classic:.2%}"
    )


# ---- the SLO rules --------------------------------------------------------------------------------


def _native_bound(threshold: float, values: list[float]) -> float:
    """How far histogram_fraction's error ratio can be from the exact one: 0 at a native boundary,
    else the share of requests in the native bucket holding the threshold times the worse side."""
    index = bucket_index(threshold, SCHEMA)
    upper, lower = upper_bound(index, SCHEMA), upper_bound(index - 1, SCHEMA)
    if upper == threshold:
        return 0.0
    inside = sum(1 for v in values if lower < v <= upper) / len(values)
    side = (threshold - lower) / (upper - lower)
    return inside * max(side, 1 - side)


def test_slo_error_ratios_match_natively_exactly_at_a_native_boundary_and_within_the_bound_elsewhere(
    run: NativeRun,
) -> None:
    interpolated = 0
    for obj in (o for o in SLO.objectives if o.is_latency):
        assert obj.threshold is not None
        sel = f'{{slo="{obj.name}"}}'
        for window in ("5m", "1h", "6h", "3d"):
            classic = _by_band(run.classic, f"kvwatch:slo_errors:ratio_rate{window}{sel}")
            native = _by_band(run.native, f"kvwatch:slo_errors:ratio_rate{window}{sel}")
            assert set(classic) == set(native) == set(obj.bands), (obj.name, window, classic, native)
            for band in obj.bands:
                values = observed(run.records, obj.family, band)
                exact = sum(1 for v in values if v > obj.threshold) / len(values)
                assert classic[band] == pytest.approx(exact, rel=1e-9, abs=1e-12), (obj.name, band, window)
                bound = _native_bound(obj.threshold, values)
                where = (obj.name, band, window, native[band], exact, bound)
                assert abs(native[band] - exact) <= bound + 1e-9, where
                interpolated += bound > 0
                if window == "5m" and exact > 0:
                    print(
                        f"{obj.name} {band}: error ratio exact {exact:.4f}, classic {classic[band]:.4f}, "
                        f"native {native[band]:.4f} (bound {bound:.4f})"
                    )
        for window, seconds in (("5m", 300), ("1h", 3600)):  # N requests in the window, on both
            for prom in (run.classic, run.native):
                rates = _by_band(prom, f"kvwatch:slo_requests:rate{window}{sel}")
                most = N * _most_extrapolation(prom, seconds)
                for band in obj.bands:  # each server's own extrapolation: at least N, at most `most`
                    where = (obj.name, window, band, rates[band] * seconds, most)
                    assert N * (1 - 1e-9) <= rates[band] * seconds <= most, where
    assert interpolated, "no objective exercised the interpolation bound"


def test_the_native_ttft_2s_ratio_equals_the_classic_one(run: NativeRun) -> None:
    classic = _by_band(run.classic, 'kvwatch:slo_errors:ratio_rate5m{slo="ttft-short"}')
    native = _by_band(run.native, 'kvwatch:slo_errors:ratio_rate5m{slo="ttft-short"}')
    assert classic["0-1k"] == pytest.approx(59 / N, rel=1e-9)
    assert native == pytest.approx(classic, rel=1e-9, abs=1e-12)


def test_the_same_burn_rate_alerts_go_pending_on_both_servers(run: NativeRun) -> None:
    classic, native = _latency_alerts(run.classic), _latency_alerts(run.native)
    assert classic == {(s, b, sev) for s, b in BREACHED for sev in ("critical", "warning")}, classic
    assert native == classic


def test_both_rule_sets_evaluate_without_errors(run: NativeRun) -> None:
    assert not run.classic.rule_errors()
    assert not run.native.rule_errors()


def test_the_native_error_rate_is_zero_not_nan_while_a_band_has_no_requests(run: NativeRun) -> None:
    """Before the second step every rate was 0: histogram_fraction of an empty histogram is NaN, and
    one NaN in kvwatch:slo_errors:rate5m would make the period's sum_over_time NaN for 28 days."""
    for prom in (run.classic, run.native):
        series = prom.query("kvwatch:slo_errors:rate5m[10m]")
        values = [float(v) for s in series for _, v in s["values"]]
        assert values and not any(math.isnan(v) for v in values), prom.workdir.name
        assert 0.0 in values, f"{prom.workdir.name}: no evaluation saw a band without requests"


def test_every_native_dashboard_query_evaluates_and_the_latency_panels_have_data(run: NativeRun) -> None:
    wanted = {FAMILIES["ttft"], FAMILIES["tpot"], FAMILIES["e2e"]}
    empty = []
    for q in panel_queries({"__rate_interval": "5m", "__range": "5m"}, Options(native=True)):
        result = run.native.query(q.concrete)  # raises on a query Prometheus refuses
        reads = {f for f in wanted if f"{f}{{" in q.concrete}
        if reads and "vllm_plugin" not in q.concrete and not result:
            empty.append(f"{q.dashboard}: {q.panel}: {q.concrete}")
    assert not empty, "\n".join(empty)
