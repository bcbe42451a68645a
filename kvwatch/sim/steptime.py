"""A linear step-time model fitted on a real engine, in place of the datasheet roofline.

``kvwatch plan calibrate`` fits it from the node's own data; an ``EngineConfig`` carrying one
(``step_cost``) times every step with it::

    step = overhead + prefill tokens x per_prefill_token + decode sequences x per_decode_seq
           + KV tokens the batch reads x per_kv_token

A sum, not the roofline's max: on a CPU, and on a GPU at small batch, the parts do not overlap
enough for a max to fit (the fit's R² says how well a sum does).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds per step and per unit of work; every coefficient >= 0."""

    overhead_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_kv_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("overhead_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"step cost {name} must be a number >= 0, got {value!r}")

    def seconds(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int) -> float:
        return (
            self.overhead_s
            + prefill_tokens * self.per_prefill_token_s
            + decode_seqs * self.per_decode_seq_s
            + kv_tokens * self.per_kv_token_s
        )
