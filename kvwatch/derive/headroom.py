"""KV headroom: seconds until a replica's KV pool is full at the current growth.

Growth, in tokens per second, over the interval between a baseline sample and the current one:

- **decode**: every running sequence grows by one token per decode step. Per-sequence decode rate =
  ``increase(generation_tokens) / dt / mean(running at both samples)``; decode growth = that rate x
  the requests running *now* (so a batch that just grew counts at its new size).
- **admitted**: prompt tokens the engine took in, ``increase(prompt_tokens) / dt`` (a cached
  prefix block taken into use leaves the free pool too). Optional (``include_admissions``).
- **freed**: completions release their whole context: ``increase(finished requests) / dt`` x the
  mean prompt + output tokens of the requests that finished in the interval (from the engine's
  per-request token histograms ``prompt_tokens`` and ``generation_tokens``); without those
  histograms, the mean allocation per running request now, which under-states a finishing request
  (it is at its longest), so headroom errs short.
- **batch growth**: while the running batch grows (``running`` now > at the baseline), each added
  sequence adds its own decode growth: an acceleration of ``sequences added per second x per-sequence
  rate``. A shrinking batch is not extrapolated (that would only lengthen the estimate).

``headroom`` solves ``net x T + acceleration x T² / 2 = free_tokens`` (``net`` = decode + admitted -
freed), i.e. ``free / net`` when the batch is steady. Blocks are allocated every ``block_size``
tokens per sequence, so on average block growth is token growth / block size and the block size
cancels: free blocks x block size / token growth.

It is ``0`` when the pool is full now or the engine preempted since the baseline (it ran out of
blocks within the window; the few blocks a preemption frees are not headroom), ``+Inf`` when
nothing runs or the pool does not grow, and ``None`` when it cannot be told (one sample only, a
counter missing, or the engine restarted between the samples: a fresh engine's growth is unknown,
and +Inf would claim it is safe). Accuracy against the simulator: docs/kv-signals.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvwatch.derive import counters, pool
from kvwatch.derive.recompute import is_preempting
from kvwatch.model import HistogramSnapshot, ReplicaSample

#: ReplicaSample.histograms keys of the per-finished-request token histograms
PROMPT_TOKENS_HISTOGRAM = "prompt_tokens"
GENERATION_TOKENS_HISTOGRAM = "generation_tokens"


@dataclass(frozen=True, slots=True)
class Growth:
    """Token flows into and out of the KV pool, tokens per second."""

    decode: float
    admitted: float
    freed: float
    per_sequence_decode: float  # tokens/s one running sequence adds
    batch_growth: float = 0.0  # running sequences added per second (>= 0: a shrinking batch counts 0)

    @property
    def net(self) -> float:
        return self.decode + self.admitted - self.freed

    @property
    def acceleration(self) -> float:
        """Tokens/s² from a growing batch: each added sequence decodes at the per-sequence rate."""
        return self.batch_growth * self.per_sequence_decode

    def seconds_to_fill(self, free_tokens: float) -> float:
        """Time until ``net x T + acceleration x T² / 2`` reaches ``free_tokens``; +Inf if never."""
        a, b = self.acceleration / 2, self.net
        if a <= 0:
            return free_tokens / b if b > 0 else math.inf
        return (-b + math.sqrt(b * b + 4 * a * free_tokens)) / (2 * a)


@dataclass(frozen=True, slots=True)
class Headroom:
    seconds: float | None
    free_tokens: float | None
    growth: Growth | None = None
    note: str = ""  # why seconds is None, or what bounded it (full, idle, not growing)


def finished_total(sample: ReplicaSample) -> float | None:
    """Requests the engine finished, all reasons together."""
    if not sample.finished_requests_total:
        return None
    return float(sum(count for _, count in sample.finished_requests_total))


def mean_finished_tokens(current: ReplicaSample, previous: ReplicaSample) -> float | None:
    """Mean prompt + output tokens of the requests that finished between the two samples."""
    prompt = _histogram_mean(
        current.histogram(PROMPT_TOKENS_HISTOGRAM), previous.histogram(PROMPT_TOKENS_HISTOGRAM)
    )
    output = _histogram_mean(
        current.histogram(GENERATION_TOKENS_HISTOGRAM), previous.histogram(GENERATION_TOKENS_HISTOGRAM)
    )
    if prompt is None or output is None:
        return None
    return prompt + output


def _histogram_mean(current: HistogramSnapshot | None, previous: HistogramSnapshot | None) -> float | None:
    if current is None or previous is None:
        return None
    count = current.count - previous.count
    if count <= 0:
        return None
    return (current.sum - previous.sum) / count


def kv_growth(
    current: ReplicaSample, previous: ReplicaSample, include_admissions: bool = True
) -> tuple[Growth | None, str]:
    """Token growth of the pool between two samples of the same unit, or the reason it is unknown."""
    dt = current.scraped_at - previous.scraped_at
    if dt <= 0:
        return None, "samples are not in time order"
    if current.requests_running is None:
        return None, "running requests unknown"
    if current.token_counters_at_finish:
        # a window where requests decode and none finishes reads as no growth (+Inf headroom)
        return None, "the engine counts tokens when requests finish, not as the pool grows"
    reads = [
        (previous.generation_tokens_total, current.generation_tokens_total),
        (finished_total(previous), finished_total(current)),
    ]
    if include_admissions:
        reads.append((previous.prompt_tokens_total, current.prompt_tokens_total))
    if any(counters.was_reset(before, now) for before, now in reads):
        return None, "engine restarted between samples"
    generated = counters.increase(previous.generation_tokens_total, current.generation_tokens_total)
    if generated is None:
        return None, "generation token counter missing"
    running_before = previous.requests_running
    mean_running = (
        current.requests_running
        if running_before is None
        else ((running_before + current.requests_running) / 2)
    )
    per_sequence = generated / dt / mean_running if mean_running > 0 else 0.0
    decode = per_sequence * current.requests_running
    admitted = 0.0
    if include_admissions:
        prompt = counters.increase(previous.prompt_tokens_total, current.prompt_tokens_total)
        if prompt is None:
            return None, "prompt token counter missing"
        admitted = prompt / dt
    finished = counters.increase(finished_total(previous), finished_total(current)) or 0.0
    freed = 0.0
    if finished > 0:
        size = mean_finished_tokens(current, previous)
        if size is None:
            allocated = pool.allocated_tokens(current)
            size = allocated / current.requests_running if allocated and current.requests_running else 0.0
        freed = finished * size / dt
    batch_growth = 0.0
    if running_before is not None and current.requests_running > running_before:
        batch_growth = (current.requests_running - running_before) / dt
    return Growth(decode, admitted, freed, per_sequence, batch_growth), ""


def headroom(
    current: ReplicaSample, previous: ReplicaSample | None, include_admissions: bool = True
) -> Headroom:
    """Seconds until the unit's KV pool is full at the growth since ``previous`` (see module doc)."""
    free = pool.free_tokens(current)
    if free is None:
        return Headroom(None, None, note="capacity or occupancy unknown")
    if free <= 0:
        return Headroom(0.0, free, note="full")
    if previous is None:
        return Headroom(None, free, note="needs two samples")
    if is_preempting(current, previous):
        return Headroom(0.0, free, note="preempting")
    if current.requests_running == 0:
        return Headroom(math.inf, free, note="idle")
    growth, note = kv_growth(current, previous, include_admissions)
    if growth is None:
        return Headroom(None, free, note=note)
    seconds = growth.seconds_to_fill(free)
    return Headroom(seconds, free, growth, "not growing" if math.isinf(seconds) else "")
