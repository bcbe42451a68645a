"""The engine scrape job: one scrape of one replica, fetch, parse, and update its ``TargetState``.

Wiring (the agent layer): the one writer of ``NodeState.targets``. The agent calls
``scrape_target`` on an interval per replica. A failed scrape sets ``up = False`` and drops the
samples at once, so nothing stale is exported; the error is counted by reason; consecutive failures
back off exponentially (1 s, 2 s, 4 s, ... up to ``scrape.backoff_max``), so a dead engine is not
hammered; one log line per state change (up -> down with the reason, a new reason while down,
down -> up), never one per failed scrape. An engine restart shows as cumulative counters going
backwards between the last good scrape and this one.

An adapter that declares an ``EXTRA_PAGE`` (llama.cpp's ``/slots``) has it fetched after
``/metrics`` (``replicas[].slots_url``, or the metrics URL with ``/metrics`` replaced). Its failure
only loses what that page adds; the target stays up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

import httpx

from kvwatch.config import ReplicaConfig, ScrapeConfig
from kvwatch.cooperative import BudgetExceededError, run_sliced
from kvwatch.engines.base import RANK_LABELS, ExtraPage, with_capacity
from kvwatch.engines.exposition_parser import ExpositionError, Limits, TooManySeriesError, parse_steps
from kvwatch.engines.fetch import ScrapeError, fetch_body, metrics_text
from kvwatch.engines.page_worker import PageJob, parse_in_worker
from kvwatch.engines.registry import NoEngineMetricsError, ParseResult, extra_page, parse_families
from kvwatch.model import InFlightRequest, ReplicaSample
from kvwatch.safetext import shown_url
from kvwatch.state import NodeState, TargetState
from kvwatch.workers import WorkerFailedError, WorkerProcess, brief_error

log = logging.getLogger(__name__)

BACKOFF_BASE_S = 1.0
#: pages of more bytes than this are parsed in the worker process (``kvwatch.workers``): a real vLLM
#: page of one rank is ~50 KB; a page this size parsed in the agent adds at most ~15,000
#: containers to its heap, which a full garbage collection walks in a few ms
WORKER_PARSE_BYTES = 256 * 1024

#: cumulative ReplicaSample fields: one going backwards means the engine restarted
COUNTER_FIELDS = (
    "preemptions_total",
    "recomputed_tokens_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
)


def backoff_delay(consecutive_failures: int, backoff_max_s: float) -> float:
    """Seconds to wait after the n-th consecutive failure: 1, 2, 4, ... capped at ``backoff_max_s``."""
    return min(backoff_max_s, BACKOFF_BASE_S * 2.0 ** max(consecutive_failures - 1, 0))


def _counters(sample: ReplicaSample) -> Iterable[tuple[str, float | None]]:
    for name in COUNTER_FIELDS:
        yield name, getattr(sample, name)
    if sample.finished_requests_total:
        yield "finished_requests_total", sum(v for _, v in sample.finished_requests_total)
    for t in sample.tier_traffic:
        label = f"tier_traffic[{t.family} {t.src_tier}->{t.dst_tier}]"
        yield label, next((v for v in (t.bytes_total, t.tokens_total, t.blocks_total) if v is not None), None)


def counters_reset(previous: Iterable[ReplicaSample], current: Iterable[ReplicaSample]) -> list[str]:
    """Names of cumulative fields that went backwards for the same replica key (empty: no restart)."""
    before = {s.key: dict(_counters(s)) for s in previous}
    went_back = []
    for s in current:
        old = before.get(s.key)
        if old is None:
            continue
        for name, value in _counters(s):
            was = old.get(name)
            if value is not None and was is not None and value < was:
                went_back.append(f"{name} {was:g} -> {value:g}")
    return went_back


def page_limits(scrape_cfg: ScrapeConfig) -> Limits:
    return Limits(
        max_line_length=scrape_cfg.max_line_length,
        max_series=scrape_cfg.max_series,
        max_label_values=scrape_cfg.max_label_values,
        max_ranks=scrape_cfg.max_ranks,
        rank_labels=RANK_LABELS,
    )


async def _parse_here(
    text: str, replica_cfg: ReplicaConfig, scrape_cfg: ScrapeConfig, scraped_at: float
) -> ParseResult:
    """Parse in slices on the loop (other replicas and proxied streams keep moving), then run the
    adapter in a worker thread: its work is bounded by the page limits, and off the loop."""
    expo = await run_sliced(parse_steps(text, page_limits(scrape_cfg)), scrape_cfg.parse_budget_s)
    return await asyncio.to_thread(parse_families, expo, replica_cfg.name, replica_cfg.backend, scraped_at)


async def _parse(
    body: bytes,
    content_type: str,
    replica_cfg: ReplicaConfig,
    scrape_cfg: ScrapeConfig,
    scraped_at: float,
    worker: WorkerProcess | None,
) -> ParseResult:
    """A large page goes to the worker process (its objects would make the agent's garbage
    collections pause the loop for tenths of a second), a small one is parsed here."""
    where = f"replica {replica_cfg.name}: {shown_url(replica_cfg.metrics_url)}"
    try:
        if worker is not None and len(body) > WORKER_PARSE_BYTES:
            job = PageJob(
                content_type,
                replica_cfg.name,
                replica_cfg.metrics_url,
                replica_cfg.backend,
                scraped_at,
                page_limits(scrape_cfg),
                scrape_cfg.parse_budget_s,
            )
            return await parse_in_worker(worker, body, job)
        text = metrics_text(body, content_type, replica=replica_cfg.name, url=replica_cfg.metrics_url)
        return await _parse_here(text, replica_cfg, scrape_cfg, scraped_at)
    except ScrapeError:
        raise  # not_metrics, from the page's checks
    except WorkerFailedError as exc:
        raise ScrapeError("timeout", f"{where}: {exc}") from None
    except TooManySeriesError as exc:
        raise ScrapeError("too_large", f"{where}: {exc.message}; stopped reading") from None
    except ExpositionError as exc:
        raise ScrapeError("malformed", f"{where} is not valid Prometheus text: {exc}") from None
    except BudgetExceededError as exc:
        raise ScrapeError("too_large", f"{where}: parsing the page {exc} (scrape.parse_budget)") from None
    except NoEngineMetricsError as exc:
        raise ScrapeError("no_engine_metrics", f"{where}: {exc}") from None
    except Exception as exc:  # an adapter bug must not take the agent down; it shows as malformed
        log.debug("adapter failed on %s: %s", where, type(exc).__name__)
        raise ScrapeError(
            "malformed", f"{where} could not be read by the {replica_cfg.backend} adapter: {brief_error(exc)}"
        ) from None


def _with_model(samples: Iterable[ReplicaSample], model_name: str | None) -> tuple[ReplicaSample, ...]:
    """Engines without a model label (llama.cpp, TGI) get the configured model_name."""
    if not model_name:
        return tuple(samples)
    return tuple(s if s.model_name else dataclasses.replace(s, model_name=model_name) for s in samples)


async def _extra_page(
    client: httpx.AsyncClient,
    page: ExtraPage,
    replica_cfg: ReplicaConfig,
    scrape_cfg: ScrapeConfig,
    target: TargetState,
    samples: tuple[ReplicaSample, ...],
) -> tuple[ReplicaSample, ...]:
    url = page.url(replica_cfg.metrics_url, replica_cfg.slots_url)
    try:
        body, _ = await fetch_body(
            client,
            url,
            replica=replica_cfg.name,
            accept=page.accept,
            timeout_s=replica_cfg.scrape_timeout_s or scrape_cfg.timeout_s,
            max_bytes=scrape_cfg.max_response_bytes,
        )
        completed = page.apply(body, samples)
    except (ScrapeError, ValueError) as exc:
        return _extra_page_failed(page, target, f"{shown_url(url)}: {exc}", samples)
    except Exception as exc:  # an adapter bug must not take the agent down, as on the /metrics page
        return _extra_page_failed(
            page, target, f"{shown_url(url)} could not be read: {brief_error(exc)}", samples
        )
    if target.extra_page_error is not None:
        log.info("replica %s: %s works again", replica_cfg.name, page.path)
    target.extra_page_error = None
    return completed


def _extra_page_failed(
    page: ExtraPage, target: TargetState, error: str, samples: tuple[ReplicaSample, ...]
) -> tuple[ReplicaSample, ...]:
    """The /metrics samples as they were: the target stays up, the page's error is kept and logged once."""
    if target.extra_page_error is None:
        log.warning(
            "replica %s: %s failed (%s); %s, target stays up", target.name, page.path, error, page.lost
        )
    target.extra_page_error = error
    return samples


def _failed(target: TargetState, err: ScrapeError, started: float, backoff_max_s: float) -> None:
    was_up = target.up
    target.up = False
    target.samples = ()
    target.errors[err.reason] += 1
    target.consecutive_failures += 1
    target.backoff_until = started + backoff_delay(target.consecutive_failures, backoff_max_s)
    new_reason = target.last_error is None or not target.last_error.startswith(f"{err.reason}:")
    if was_up or target.consecutive_failures == 1:
        log.warning("replica %s down (%s): %s", target.name, err.reason, err.message)
    elif new_reason:
        log.warning("replica %s still down, now (%s): %s", target.name, err.reason, err.message)
    target.last_error = str(err)


def _succeeded(
    target: TargetState,
    result: ParseResult,
    samples: tuple[ReplicaSample, ...],
    started: float,
    in_flight: tuple[InFlightRequest, ...],
) -> None:
    reset = counters_reset(target.previous_samples, samples)
    if reset:
        target.restarts += 1
        log.warning(
            "replica %s: engine restart detected (counters went backwards: %s)",
            target.name,
            "; ".join(reset[:3]),
        )
    if not target.up:
        hint = samples[0].version_hint if samples else None
        failures = target.consecutive_failures
        after = f" after {failures} failed scrape(s)" if failures else ""
        log.info(
            "replica %s up%s: %s, %d replica sample(s), %s",
            target.name,
            after,
            result.backend,
            len(samples),
            hint,
        )
    target.backend = result.backend
    target.rejected_samples.update(dict(result.rejected))
    target.samples = samples
    target.in_flight = in_flight
    target.previous_samples = samples
    target.up = True
    target.last_success_ts = started
    target.last_error = None
    target.consecutive_failures = 0
    target.backoff_until = None


async def scrape_target(
    client: httpx.AsyncClient,
    replica_cfg: ReplicaConfig,
    scrape_cfg: ScrapeConfig,
    state: NodeState,
    now: Callable[[], float] = time.time,
    worker: WorkerProcess | None = None,
) -> None:
    """Scrape one replica and update ``state.target(name)`` and ``state.report("engine:<name>")``.

    ``worker`` parses pages over ``WORKER_PARSE_BYTES`` (without one, every page is parsed here).

    Never raises: every failure becomes a counted, logged ``ScrapeError`` and ``up = False``.
    Skips the scrape (returns at once) while the target is in backoff.
    """
    target = state.target(replica_cfg.name)
    started = now()
    if target.backoff_until is not None and started < target.backoff_until:
        return
    clock = time.perf_counter()
    try:
        body, content_type = await fetch_body(
            client,
            replica_cfg.metrics_url,
            replica=replica_cfg.name,
            timeout_s=replica_cfg.scrape_timeout_s or scrape_cfg.timeout_s,
            max_bytes=scrape_cfg.max_response_bytes,
        )
        # the requests the page's counts were taken with, before they move on while it is parsed
        in_flight = tuple(state.in_flight.current(replica_cfg.name))
        result = await _parse(body, content_type, replica_cfg, scrape_cfg, started, worker)
    except ScrapeError as err:
        target.scrape_duration_s = time.perf_counter() - clock
        _failed(target, err, started, scrape_cfg.backoff_max_s)
        state.report(f"engine:{replica_cfg.name}", False, target.scrape_duration_s, str(err), now=started)
        return
    samples = _with_model(result.samples, replica_cfg.model_name)
    page = extra_page(result.backend)
    if page is not None:
        samples = await _extra_page(client, page, replica_cfg, scrape_cfg, target, samples)
    if replica_cfg.kv_capacity_tokens is not None:
        samples = tuple(with_capacity(s, replica_cfg.kv_capacity_tokens) for s in samples)
    target.scrape_duration_s = time.perf_counter() - clock
    _succeeded(target, result, samples, started, in_flight)
    state.report(f"engine:{replica_cfg.name}", True, target.scrape_duration_s, now=started)
