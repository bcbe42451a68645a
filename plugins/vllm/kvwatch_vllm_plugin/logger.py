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

#: FinishedRequestStats attribute -> datagram key (absent attributes are sent as null)
FINISHED_FIELDS = (
    ("e2e_latency", "e2e"),
    ("queued_time", "queue"),
    ("prefill_time", "prefill"),
    ("decode_time", "decode"),
    ("inference_time", "inference"),
    ("num_prompt_tokens", "prompt"),
    ("num_generation_tokens", "output"),
    ("num_cached_tokens", "cached"),
    ("max_tokens_param", "max_tokens"),
    ("num_preemptions", "preemptions"),
)
#: SchedulerIterationDetails attributes, in the order of the datagram's "it" list
ITERATION_FIELDS = ("num_ctx_requests", "num_ctx_tokens", "num_generation_requests",
                    "num_generation_tokens", "elapsed_ms")


def _get(obj: Any, name: str) -> int | float | None:
    return number(getattr(obj, name, None))


def step_fields(scheduler_stats: Any, iteration_stats: Any) -> dict[str, Any]:
    """The batch-level facts of one step (pure: a dict of numbers and nulls)."""
    step: dict[str, Any] = {}
    if scheduler_stats is not None:
        step["run"] = _get(scheduler_stats, "num_running_reqs")
        step["wait"] = _get(scheduler_stats, "num_waiting_reqs")
        usage = _get(scheduler_stats, "kv_cache_usage")
        step["kv"] = usage if usage is not None else _get(scheduler_stats, "gpu_cache_usage")  # < 0.9
        prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
        if prefix is not None:
            for attr, key in (("requests", "pc_req"), ("queries", "pc_q"), ("hits", "pc_h"),
                              ("preempted_requests", "pre_req"), ("preempted_queries", "pre_q"),
                              ("preempted_hits", "pre_h")):
                step[key] = _get(prefix, attr)
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


def finished_fields(finished: Any) -> dict[str, Any]:
    """One finished request: numbers and the finish reason only (no text, no request id)."""
    reason = getattr(finished, "finish_reason", None)
    out: dict[str, Any] = {"reason": None if reason is None else str(reason)[:16]}
    for attr, key in FINISHED_FIELDS:
        out[key] = _get(finished, attr)
    return out


def eviction_fields(scheduler_stats: Any) -> tuple[list[list[Any]], int]:
    events = getattr(scheduler_stats, "kv_cache_eviction_events", None) or ()
    kept = [eviction_sample(getattr(e, "lifetime_seconds", None), getattr(e, "idle_seconds", None),
                            getattr(e, "reuse_gaps_seconds", None) or ())
            for e in list(events)[:MAX_EVICTIONS]]
    return kept, max(0, len(events) - MAX_EVICTIONS)


class KvwatchStatLogger(StatLoggerBase):
    """Per-engine stat logger; ``$KVWATCH_VLLM_SOCKET`` (default /run/kvwatch/vllm.sock)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.engine_index = engine_index
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

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        try:
            self._record(scheduler_stats, iteration_stats)
        except Exception:
            self.failures += 1
            self._warn("kvwatch stat logger: a step could not be encoded (%d so far); vLLM is unaffected",
                       self.failures, exc_info=True)

    def _record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is None and iteration_stats is None:
            return
        finished = [finished_fields(f) for f in (getattr(iteration_stats, "finished_requests", None) or ())]
        if scheduler_stats is not None:
            evictions, left_out = eviction_fields(scheduler_stats)
            room = max(0, MAX_EVICTIONS - len(self._evictions))
            self._evictions += evictions[:room]
            self._evictions_left_out += left_out + len(evictions) - len(evictions[:room])
        step = step_fields(scheduler_stats, iteration_stats)
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
        steps, finished, evictions, left_out = (self._steps, self._finished, self._evictions,
                                                self._evictions_left_out)
        self._steps, self._finished, self._evictions, self._evictions_left_out = [], [], [], 0
        self._flushed_at = time.monotonic() if now is None else now
        if not steps and not finished:
            self.sender.drain()  # what a slow agent could not take yet
        else:
            self._send(steps, finished, evictions, left_out)
        if self.sender.backlog:
            self.drainer.wake()

    def _send(self, steps: list[dict[str, Any]], finished: list[dict[str, Any]],
              evictions: list[list[Any]], left_out: int) -> None:
        header = {"v": WIRE_VERSION, "e": self.engine_index, "p": self.pid, "n": 0, "t": time.time(),
                  "d": 0, "ds": 0}
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
                self._warn("kvwatch stat logger: %d datagrams dropped so far (no kvwatch agent listening "
                           "on %s, or it is too slow); vLLM is unaffected", dropped, self.path)
                self._dropped_warned = dropped
        except Exception:
            pass

    def log_engine_initialized(self) -> None:
        with contextlib.suppress(Exception):
            log.info("kvwatch stat logger: engine %d sends step and request stats to %s",
                     self.engine_index, self.path)

    def _warn(self, message: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            with contextlib.suppress(Exception):
                log.warning(message, *args, exc_info=exc_info)
