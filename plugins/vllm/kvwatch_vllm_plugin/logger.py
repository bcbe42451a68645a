"""The vLLM side: a ``StatLoggerBase`` that turns each engine step into datagrams for kvwatch.

vLLM (v1 ``AsyncLLM``) constructs it once per engine index (the DP rank) and calls ``record`` on its
output-handler task after every engine step, so everything here is bounded, never blocks and never
raises: an exception out of ``record`` would fail the engine's output handler and every request in
flight. vLLM documents ``SchedulerStats`` / ``IterationStats`` as "not stable interfaces", so every
field is read with ``getattr`` and a missing or non-numeric one is sent as null (unknown), never 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from kvwatch_vllm_plugin.wire import (
    FLUSH_INTERVAL_S,
    MAX_EVICTIONS,
    MAX_STEPS_PER_DATAGRAM,
    WIRE_VERSION,
    BacklogDrainer,
    DatagramSender,
    dumps,
    encode,
    eviction_sample,
    number,
    socket_path,
)

log = logging.getLogger("vllm.kvwatch_vllm_plugin")
WARN_EVERY_S = 60.0

#: FinishedRequestStats durations -> datagram key
DURATION_FIELDS = (
    ("e2e_latency", "e2e"),
    ("queued_time", "queue"),
    ("prefill_time", "prefill"),
    ("decode_time", "decode"),
    ("inference_time", "inference"),
)
#: FinishedRequestStats counts -> datagram key (absent attributes are sent as null)
COUNT_FIELDS = (
    ("num_prompt_tokens", "prompt"),
    ("num_generation_tokens", "output"),
    ("num_cached_tokens", "cached"),
    ("num_preemptions", "preemptions"),
)
#: SchedulerIterationDetails attributes, in the order of the datagram's "it" list
ITERATION_FIELDS = (
    "num_ctx_requests",
    "num_ctx_tokens",
    "num_generation_requests",
    "num_generation_tokens",
    "elapsed_ms",
)
#: PrefixCacheStats attribute -> step key
PREFIX_FIELDS = (
    ("requests", "pc_req"),
    ("queries", "pc_q"),
    ("hits", "pc_h"),
    ("preempted_requests", "pre_req"),
    ("preempted_queries", "pre_q"),
    ("preempted_hits", "pre_h"),
)


def _get(obj: Any, name: str) -> int | float | None:
    return number(getattr(obj, name, None))


def _non_negative(obj: Any, name: str) -> int | float | None:
    value = _get(obj, name)
    return None if value is None or value < 0 else value


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the engine's configuration says about the stats it records (read once, at construction).

    ``local_prefix_counted``: vLLM records a request's local prefix-cache lookup only with prefix
    caching on (``KVCacheManager.record_prefix_cache_stats`` returns early otherwise), yet
    ``SchedulerStats.prefix_cache_stats`` is always there, zeroed; so without caching (or with an
    unreadable configuration) the lookups are sent as null, not as 0.
    ``per_admission``: vLLM records each lookup once, when the request is admitted (from 0.27.0,
    vLLM pull request 48860); before that it recorded every lookup, also those of a request that then
    could not be scheduled and was looked up again next step, so the resumed requests' lookups, and the
    recompute derived from them, are an upper bound. None: unknown.
    ``max_model_len`` and ``default_max_tokens`` tell a limit the client set from one vLLM resolved.
    """

    local_prefix_counted: bool = False
    per_admission: bool | None = None
    max_model_len: int | None = None
    default_max_tokens: tuple[int, ...] = ()


def _attr_path(obj: Any, *names: str) -> Any:
    for name in names:
        obj = getattr(obj, name, None)
    return obj


def engine_facts(vllm_config: Any) -> EngineFacts:
    """Read the facts from vLLM's ``VllmConfig`` (any attribute may be missing: then unknown)."""
    caching = _attr_path(vllm_config, "cache_config", "enable_prefix_caching")
    max_model_len = number(_attr_path(vllm_config, "model_config", "max_model_len"))
    defaults: list[int] = []
    with contextlib.suppress(Exception):
        # what vLLM's OpenAI server takes for a request without max_tokens (the generation config)
        defaults.append(vllm_config.model_config.get_diff_sampling_param().get("max_tokens"))
    with contextlib.suppress(Exception):
        # --override-generation-config '{"max_new_tokens": N}' caps every request, the client's too
        defaults.append(vllm_config.model_config.override_generation_config.get("max_new_tokens"))
    return EngineFacts(
        local_prefix_counted=caching is True,
        per_admission=prefix_stats_per_admission(),
        max_model_len=max_model_len if isinstance(max_model_len, int) else None,
        default_max_tokens=tuple(d for d in defaults if isinstance(number(d), int)),
    )


def prefix_stats_per_admission(manager: Any = None) -> bool | None:
    """Whether vLLM's ``KVCacheManager`` (the installed one by default) records prefix-cache lookups
    once per admission: a feature test, not a version number (renamed and patched builds carry the
    version of something else). vLLM 0.27.0 added ``record_prefix_cache_stats`` for it."""
    if manager is None:
        try:
            from vllm.v1.core.kv_cache_manager import KVCacheManager
        except Exception:
            return None
        manager = KVCacheManager
    return callable(getattr(manager, "record_prefix_cache_stats", None))


#: vLLM's own default limit: ``CompletionRequest.max_tokens`` (/v1/completions, after OpenAI's legacy
#: API, ``vllm/entrypoints/openai/completion/protocol.py``) and ``SamplingParams.max_tokens`` (offline)
VLLM_DEFAULT_MAX_TOKENS = 16


def client_max_tokens(resolved: Any, prompt_tokens: Any, facts: EngineFacts) -> int | None:
    """The client's ``max_tokens``, where vLLM's resolved limit proves the client set it; else None.

    vLLM passes the stat loggers ``SamplingParams.max_tokens`` after its OpenAI server resolved it:
    ``min(max_model_len - prompt tokens, the client's max_tokens or the generation config's default,
    the override's max_new_tokens)`` (``get_max_tokens`` in ``vllm/entrypoints/serve/utils/api_utils.py``),
    where /v1/completions reads a missing max_tokens as 16, and says nowhere whether the client sent
    one. A limit below the remaining context that is none of the server's defaults can only be the
    client's; one equal to any of them may be vLLM's own, so it is
    unknown (None), as the proxy records a request without max_tokens.
    """
    limit = number(resolved)
    prompt = number(prompt_tokens)
    if not isinstance(limit, int) or limit < 1 or facts.max_model_len is None or not isinstance(prompt, int):
        return None
    if (
        limit >= facts.max_model_len - prompt
        or limit == VLLM_DEFAULT_MAX_TOKENS
        or limit in facts.default_max_tokens
    ):
        return None
    return limit


def step_fields(scheduler_stats: Any, iteration_stats: Any, facts: EngineFacts) -> dict[str, Any]:
    """The batch-level facts of one step (pure: a dict of numbers and nulls)."""
    step: dict[str, Any] = {}
    if scheduler_stats is not None:
        step["run"] = _get(scheduler_stats, "num_running_reqs")
        step["wait"] = _get(scheduler_stats, "num_waiting_reqs")
        usage = _get(scheduler_stats, "kv_cache_usage")
        step["kv"] = usage if usage is not None else _get(scheduler_stats, "gpu_cache_usage")  # < 0.9
        prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
        if prefix is not None:
            for attr, key in PREFIX_FIELDS:
                step[key] = _get(prefix, attr) if facts.local_prefix_counted else None
        # a KV connector (OffloadingConnector, LMCache, NIXL) loads part of a resumed request's tokens:
        # vLLM records what it asked the connector (the tokens the local cache did not have) and
        # what the connector had, so queried - hit is what was computed again
        connector = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
        if connector is not None:
            step["cpre_q"] = _get(connector, "preempted_queries")
            step["cpre_h"] = _get(connector, "preempted_hits")
        details = getattr(scheduler_stats, "iteration_details", None)
        if details is not None and not getattr(details, "is_dummy", False):
            step["it"] = [_get(details, attr) for attr in ITERATION_FIELDS]
    if iteration_stats is not None:
        step["preempted"] = _get(iteration_stats, "num_preempted_reqs")
        step["gen"] = _get(iteration_stats, "num_generation_tokens")
        prompt = getattr(iteration_stats, "prompt_token_stats", None)
        if prompt is not None:
            step["pt_comp"] = _get(prompt, "computed")
            step["pt_local"] = _get(prompt, "local_cache_hit")
            step["pt_ext"] = _get(prompt, "external_kv_transfer")
    return step


def durations(finished: Any) -> dict[str, int | float | None]:
    """The request's durations, null where vLLM had no event to time.

    vLLM computes them from per-request timestamps (``IterationStats.update_from_finished_request``,
    ``vllm/v1/metrics/stats.py``): queue = scheduled - queued, prefill = first token - scheduled,
    decode = last - first token, inference = last - scheduled. A request never scheduled (queue < 0:
    its scheduled stamp stayed 0.0) has none of the last three. One that finished without a token
    (FINISHED_ERROR, an engine-side abort) has no prefill, decode or inference either, though vLLM
    reports them: ``update_from_output`` runs on the finishing output first and stamps the first
    and last token there, token or not, so prefill reads scheduled -> failure and decode 0.0. Any
    other negative value is null too.
    """
    out = {key: _get(finished, attr) for attr, key in DURATION_FIELDS}
    queue = out["queue"]
    tokens = _get(finished, "num_generation_tokens")
    unset = (
        ("queue", "prefill", "decode", "inference")
        if queue is not None and queue < 0
        else ("prefill", "decode", "inference")
        if tokens == 0 or (out["prefill"] is not None and out["prefill"] < 0)
        else ()
    )
    return {
        key: None if key in unset or (value is not None and value < 0) else value
        for key, value in out.items()
    }


def finished_fields(finished: Any, facts: EngineFacts) -> dict[str, Any]:
    """One finished request: numbers and the finish reason only (no text, no request id)."""
    reason = getattr(finished, "finish_reason", None)
    out: dict[str, Any] = {"reason": None if reason is None else str(reason)[:16]}
    out.update(durations(finished))
    for attr, key in COUNT_FIELDS:
        out[key] = _non_negative(finished, attr)
    out["max_tokens"] = client_max_tokens(
        getattr(finished, "max_tokens_param", None), getattr(finished, "num_prompt_tokens", None), facts
    )
    return out


def eviction_fields(scheduler_stats: Any) -> tuple[list[list[Any]], int]:
    events = getattr(scheduler_stats, "kv_cache_eviction_events", None) or ()
    kept = [
        eviction_sample(
            getattr(e, "lifetime_seconds", None),
            getattr(e, "idle_seconds", None),
            getattr(e, "reuse_gaps_seconds", None) or (),
        )
        for e in list(events)[:MAX_EVICTIONS]
    ]
    return kept, max(0, len(events) - MAX_EVICTIONS)


class KvwatchStatLogger(StatLoggerBase):
    """Per-engine stat logger; ``$KVWATCH_VLLM_SOCKET`` (default /run/kvwatch/vllm.sock)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.facts = engine_facts(vllm_config)
        self.path = socket_path()
        self.sender = DatagramSender(self.path)
        self.drainer = BacklogDrainer(self.sender)
        self.pid = os.getpid()
        self.seq = 0
        self.failures = 0  # record() calls that raised inside (and were swallowed)
        self._warned_at = -WARN_EVERY_S
        self._dropped_warned = 0
        self._steps: list[dict[str, Any]] = []
        self._finished: list[dict[str, Any]] = []
        self._evictions: list[list[Any]] = []
        self._evictions_left_out = 0
        self._flushed_at = time.monotonic()
        _register_after_fork(self)

    def after_fork_in_child(self) -> None:
        """A forked child (vLLM forks workers; a user may fork the API server) starts clean: its own
        pid in the datagrams, a fresh drain lock (the parent's may have been held by its drain thread,
        which the child does not have) and socket, nothing of the parent's buffers sent twice."""
        self.pid = os.getpid()
        self.seq = 0
        self.sender.after_fork_in_child()
        self.drainer.after_fork_in_child()
        self._steps, self._finished, self._evictions, self._evictions_left_out = [], [], [], 0

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        try:
            self._record(scheduler_stats, iteration_stats)
        except Exception:
            self.failures += 1
            self._warn(
                "kvwatch stat logger: a step could not be encoded (%d so far); vLLM is unaffected",
                self.failures,
                exc_info=True,
            )

    def _record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is None and iteration_stats is None:
            return
        finished = [
            finished_fields(f, self.facts)
            for f in (getattr(iteration_stats, "finished_requests", None) or ())
        ]
        if scheduler_stats is not None:
            evictions, left_out = eviction_fields(scheduler_stats)
            room = max(0, MAX_EVICTIONS - len(self._evictions))
            self._evictions += evictions[:room]
            self._evictions_left_out += left_out + len(evictions) - len(evictions[:room])
        step = step_fields(scheduler_stats, iteration_stats, self.facts)
        step["t"] = time.time()
        self._steps.append(step)
        if self.sender.backlog:
            self.sender.drain()
        self._finished += finished
        now = time.monotonic()
        full = len(self._steps) >= MAX_STEPS_PER_DATAGRAM
        if finished or full or now - self._flushed_at >= FLUSH_INTERVAL_S:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Send what is buffered (a request's last step never waits: it carries the finished request)."""
        steps, finished, evictions, left_out = (
            self._steps,
            self._finished,
            self._evictions,
            self._evictions_left_out,
        )
        self._steps, self._finished, self._evictions, self._evictions_left_out = [], [], [], 0
        self._flushed_at = time.monotonic() if now is None else now
        if not steps and not finished:
            self.sender.drain()  # what a slow agent could not take yet
        else:
            self._send(steps, finished, evictions, left_out)
        if self.sender.backlog:
            self.drainer.wake()

    def _send(
        self,
        steps: list[dict[str, Any]],
        finished: list[dict[str, Any]],
        evictions: list[list[Any]],
        left_out: int,
    ) -> None:
        header = {
            "v": WIRE_VERSION,
            "e": self.engine_index,
            "p": self.pid,
            "n": 0,
            "t": time.time(),
            "d": 0,
            "ds": 0,
        }
        if self.facts.per_admission is not None:
            header["pa"] = 1 if self.facts.per_admission else 0
        for body in encode(header, steps, finished, evictions, left_out):
            self.seq += 1
            body["n"] = self.seq
            body["d"], body["ds"] = self.sender.dropped, self.sender.dropped_steps
            self.sender.send(dumps(body), sum(1 for step in body.get("s", ()) if "it" in step))

    def log(self) -> None:
        """vLLM calls this every stats interval (10 s): send what waits, say so when datagrams drop."""
        try:
            self.flush()
            dropped = self.sender.dropped
            if dropped > self._dropped_warned:
                self._warn(
                    "kvwatch stat logger: %d datagrams dropped so far (no kvwatch agent listening "
                    "on %s, or it is too slow); vLLM is unaffected",
                    dropped,
                    self.path,
                )
                self._dropped_warned = dropped
        except Exception:
            pass

    def log_engine_initialized(self) -> None:
        with contextlib.suppress(Exception):
            log.info(
                "kvwatch stat logger: engine %d sends step and request stats to %s",
                self.engine_index,
                self.path,
            )

    def _warn(self, message: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            with contextlib.suppress(Exception):
                log.warning(message, *args, exc_info=exc_info)


#: every logger of this process, for the at-fork handler (registered once, at import: it cannot be
#: unregistered, and a logger that is gone drops out of the set by itself)
_loggers: weakref.WeakSet[KvwatchStatLogger] = weakref.WeakSet()


def _register_after_fork(logger: KvwatchStatLogger) -> None:
    _loggers.add(logger)


def _after_fork_in_child() -> None:
    for logger in list(_loggers):
        with contextlib.suppress(Exception):
            logger.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
