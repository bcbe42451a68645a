"""Live tokens and internal fragmentation per replica and DP rank.

*Live tokens* are the tokens running requests hold. The engine's own count is used where it
exists; otherwise the proxy's in-flight accounting, labelled ``proxy_estimate`` so an estimate never
poses as a measurement.

*Internal fragmentation* = ``1 - live_tokens / allocated_tokens``: the share of allocated KV slots
that sit empty in partly filled blocks (at most ``block_size - 1`` per sequence). It is ``None`` when
an input is missing, and also when live tokens exceed the allocation: that cannot happen for
distinct tokens, so the count is known to be wrong for this purpose (the proxy over-estimated
prompts, or shared prefix blocks were counted once per request). Clamping it to 0 would claim
"no fragmentation", which nobody measured.

The proxy cannot tell a replica's DP ranks apart (one HTTP endpoint), so with more than one rank
the estimate is made once per replica, against the sum of the ranks' allocations (``dp_rank=None``).
When the engine runs more requests than the proxy relays (clients reach the engine directly), the
proxy's sum is a part of the live tokens, and no estimate is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvwatch.derive import counters, pool
from kvwatch.model import InFlightRequest, ReplicaSample

ENGINE = "engine"
PROXY_ESTIMATE = "proxy_estimate"

#: live may exceed allocated by this relative amount from float rounding and still count as equal
_ROUNDING = 1e-9


@dataclass(frozen=True, slots=True)
class Fragmentation:
    """Live tokens and fragmentation of one replica (one DP rank, or the whole replica)."""

    replica: str
    model_name: str | None
    backend: str
    dp_rank: str | None
    live_tokens: float | None
    source: str | None  # ENGINE | PROXY_ESTIMATE; None when there is no live count at all
    allocated_tokens: float | None
    ratio: float | None
    note: str = ""  # why ratio is None


def engine_live_tokens(sample: ReplicaSample) -> float | None:
    """Tokens held by running requests as the engine measures them; ``None`` when it does not.

    - ``live_tokens``, as the adapter read it (SGLang's used slots at page size 1, llama.cpp's
      processing slots): taken as is. It is not zeroed when nothing is counted as running: SGLang's
      running count leaves out a request in chunked prefill, whose tokens are held all the same (that
      made an idle-looking pool read 100% fragmented).
    - Page size 1 (SGLang default): allocated slots are exactly the tokens held.
    """
    if sample.live_tokens is not None:
        return float(sample.live_tokens)
    if sample.block_size == 1 and sample.kv_used_tokens is not None:
        return float(sample.kv_used_tokens)
    return None


def running_requests(requests: Sequence[InFlightRequest], running: float | None) -> list[InFlightRequest]:
    """The requests the engine is running, as far as the proxy can tell.

    The proxy cannot see the engine's queue. When the engine reports ``running``, that many in-flight
    requests are taken as running: those already streaming first (a request without its first token
    is most likely still queued), oldest first within each group (first come, first served); the
    rest are queued and hold no KV. Without a running count every in-flight request counts.
    """
    ordered = sorted(requests, key=lambda r: (r.generated_tokens == 0, r.started_at))
    if running is None:
        return ordered
    return ordered[: max(int(running), 0)]


def estimated_live_tokens(requests: Sequence[InFlightRequest], running: float | None) -> float:
    """Proxy estimate: prompt estimate + tokens generated so far, over the running requests."""
    held = running_requests(requests, running)
    return float(sum(r.prompt_tokens_estimate + r.generated_tokens for r in held))


def fragmentation_ratio(
    live_tokens: float | None, allocated_tokens: float | None
) -> tuple[float | None, str]:
    """``1 - live / allocated`` with the reason when undefined.

    Nothing allocated and nothing live is 0 (no slot is wasted).
    """
    if live_tokens is None:
        return None, "no live-token count"
    if allocated_tokens is None:
        return None, "allocation unknown"
    if allocated_tokens <= 0:
        if live_tokens <= 0:
            return 0.0, ""
        return None, "live tokens but nothing allocated"
    if live_tokens > allocated_tokens * (1 + _ROUNDING):
        return None, "live tokens exceed allocation (over-estimated prompts or shared prefix blocks)"
    return max(1.0 - live_tokens / allocated_tokens, 0.0), ""


def replica_fragmentation(
    samples: Sequence[ReplicaSample], in_flight: Sequence[InFlightRequest], proxied: bool
) -> list[Fragmentation]:
    """Fragmentation of one replica: per DP rank from engine counts, else one proxy estimate.

    ``samples`` are the replica's current samples (one per DP rank); ``in_flight`` the proxy's
    in-flight requests for this replica; ``proxied`` whether a kvwatch proxy fronts it at all (without
    one, an empty in-flight list means "not seen", not "no live tokens").
    """
    engine = [engine_live_tokens(s) for s in samples]
    if not proxied or all(live is not None for live in engine):
        return [
            _result(s, live, ENGINE if live is not None else None, pool.allocated_tokens(s))
            for s, live in zip(samples, engine, strict=True)
        ]
    unit = samples[0] if len(samples) == 1 else replace(samples[0], dp_rank=None)
    running = counters.total([s.requests_running for s in samples])
    allocated = counters.total([pool.allocated_tokens(s) for s in samples])
    if running is not None and len(in_flight) < running:
        return [
            Fragmentation(
                unit.replica,
                unit.model_name,
                unit.backend,
                unit.dp_rank,
                None,
                None,
                allocated,
                None,
                "the engine runs requests the proxy does not relay",
            )
        ]
    return [_result(unit, estimated_live_tokens(in_flight, running), PROXY_ESTIMATE, allocated)]


def _result(
    sample: ReplicaSample, live: float | None, source: str | None, allocated: float | None
) -> Fragmentation:
    ratio, note = fragmentation_ratio(live, allocated)
    return Fragmentation(
        sample.replica,
        sample.model_name,
        sample.backend,
        sample.dp_rank,
        live,
        source,
        allocated,
        ratio,
        note,
    )
