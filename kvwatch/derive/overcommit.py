"""KV over-commitment: running requests that could not all finish if each ran to its ``max_tokens``.

Definition (exported as ``kvwatch_kv_overcommitted_requests``):

1. Take the replica's in-flight requests (the ones the proxy relays) in admission order
   (``started_at``). When the engine reports ``running = N``, the oldest N are the running ones
   (first come, first served); later ones are queued, hold no KV, and are left out.
2. A running request's worst-case footprint is ``prompt_tokens_estimate + max_tokens``, rounded up
   to whole blocks when the block size is known. A request without ``max_tokens`` has no stated
   limit: it adds what it holds now (prompt + generated) and is never counted itself.
3. Walk the running requests in admission order, adding footprints. A request with ``max_tokens``
   is over-committed when the running total through it exceeds the usable KV capacity: if every
   request ran to its limit, the engine would have to preempt it (or one admitted before it).

It counts only requests the proxy sees; requests sent straight to the engine are invisible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvwatch.derive.fragmentation import running_requests
from kvwatch.model import InFlightRequest


@dataclass(frozen=True, slots=True)
class Overcommit:
    requests: int  # over-committed running requests
    running: int  # running requests considered
    worst_case_tokens: float  # footprint if every running request ran to its max_tokens
    capacity_tokens: float


def footprint(tokens: float, block_size: int | None) -> float:
    """Token slots ``tokens`` occupy: whole blocks when the block size is known."""
    if block_size and block_size > 1:
        return math.ceil(tokens / block_size) * block_size
    return float(tokens)


def overcommitted_requests(
    requests: Sequence[InFlightRequest],
    capacity_tokens: float,
    block_size: int | None = None,
    running: float | None = None,
) -> Overcommit:
    """Count over-committed running requests of one replica (see module doc)."""
    held = running_requests(requests, running)
    total = 0.0
    count = 0
    for request in held:
        if request.max_tokens is None:
            total += footprint(request.prompt_tokens_estimate + request.generated_tokens, block_size)
            continue
        total += footprint(request.prompt_tokens_estimate + request.max_tokens, block_size)
        if total > capacity_tokens:
            count += 1
    return Overcommit(count, len(held), total, capacity_tokens)
