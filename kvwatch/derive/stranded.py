"""Stranded KV capacity: memory data parallelism cannot pool.

Per model on the node, the free KV tokens of replicas (DP ranks) that have nothing waiting and are
not preempting, counted only while another replica (rank) of the same model is under pressure: it
queues (``waiting > 0`` now and at the previous sample: a queue that lasted, not a request caught
between arrival and admission) or preempts (its preemption counter rose since the previous sample).
A request queued on one rank cannot use another rank's free blocks, so that memory is stranded.

A model served by one unit, or whose units are all idle or all pressured, strands nothing (0).
Units whose queue length is unknown are neither idle nor pressured, nor are units with a queue
that did not last (its requests are being admitted, so its free blocks are about to be used); idle
units whose free tokens are unknown add nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvwatch.derive import pool
from kvwatch.derive.recompute import is_preempting
from kvwatch.model import ReplicaSample

SampleKey = tuple[str, str | None, str | None]


@dataclass(frozen=True, slots=True)
class Stranded:
    model_name: str
    stranded_tokens: float
    idle_units: int  # units with nothing waiting and no new preemption
    pressured_units: int  # units that queue or preempt
    replicas: tuple[str, ...] = ()  # replicas whose samples went into it


def stranded_capacity(
    current: Sequence[ReplicaSample], previous: Mapping[SampleKey, ReplicaSample]
) -> dict[str, Stranded]:
    """Stranded tokens per model name, for every model with a sample (0 when nothing is stranded).

    ``previous`` maps ``ReplicaSample.key`` to an earlier sample of the same unit (the baseline for
    "queues" and "preempts"); without one a unit queues when it has waiting requests now and does not
    preempt. Samples without a model name are skipped: they cannot be grouped.
    """
    idle: dict[str, list[float | None]] = {}
    pressured: dict[str, int] = {}
    replicas: dict[str, dict[str, None]] = {}
    for sample in current:
        if sample.model_name is None:
            continue
        model = sample.model_name
        idle.setdefault(model, [])
        pressured.setdefault(model, 0)
        replicas.setdefault(model, {})[sample.replica] = None
        before = previous.get(sample.key)
        if is_preempting(sample, before) or _queues(sample, before):
            pressured[model] += 1
        elif sample.requests_waiting is not None and sample.requests_waiting <= 0:
            idle[model].append(pool.free_tokens(sample))
    out = {}
    for model, free in idle.items():
        tokens = sum(f for f in free if f is not None) if pressured[model] else 0.0
        out[model] = Stranded(model, float(tokens), len(free), pressured[model], tuple(replicas[model]))
    return out


def _queues(sample: ReplicaSample, previous: ReplicaSample | None) -> bool:
    if not (sample.requests_waiting or 0) > 0:
        return False
    return previous is None or (previous.requests_waiting or 0) > 0
