"""The requests the proxy relays right now, with their generated tokens estimated from chunks."""

from __future__ import annotations

import threading

from kvwatch.model import InFlightRequest


class InFlightTracker:
    """Requests the proxy relays right now; the proxy updates content chunks as they pass.

    A running request's KV is estimated from what the proxy sees, each part scaled per replica by
    what finished requests taught (their usage gives the engine's exact counts):

    - generated tokens: counted chunks x tokens a chunk (one on most engines at normal pace,
      several with stream intervals, speculative decoding, merged deltas under load, or the demo's
      accelerated clock);
    - prompt tokens: the body's size / 4 x exact / estimated prompt tokens (a chat template's
      tokens, JSON around the text, and text that is not four bytes a token, such as code, CJK or
      base64 images, move it per workload).

    Each scale is a ratio of moving sums (newest request's weight ``CALIBRATION_WEIGHT``), not a
    moving mean of per-request ratios: a stream's short first and last chunks and a body's fixed
    overhead make short requests' ratios low, and the long requests, which hold the KV, would be
    under-counted by their mean (in ``kvwatch demo``, by 2.7% of the KV at the median; docs/kv-signals.md).
    """

    CALIBRATION_WEIGHT = 0.2  # weight of the newest finished request in the moving sums
    #: one request's exact / estimated prompt, clamped by shrinking the larger side: a body padded
    #: (or a prompt templated) out of all proportion weighs no more than a request of its smaller side
    PROMPT_RATIO_BOUNDS = (1 / 16, 16.0)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._requests: dict[int, InFlightRequest] = {}
        self._chunks: dict[int, int] = {}
        self._output_per_chunks: dict[str, tuple[float, float]] = {}  # moving (output tokens, chunks)
        self._prompt_per_estimate: dict[str, tuple[float, float]] = {}  # moving (exact, estimated) prompts

    def start(self, request: InFlightRequest) -> int:
        with self._lock:
            self._next += 1
            handle = self._next
            self._requests[handle] = request
            self._chunks[handle] = 0
            return handle

    def progress(self, handle: int, content_chunks: int) -> None:
        # plain dict store: cheap enough for the per-chunk path, atomic under the GIL
        if handle in self._chunks:
            self._chunks[handle] = content_chunks

    def finish(self, handle: int, prompt_tokens: int | None = None) -> None:
        """The request left; ``prompt_tokens``, its exact prompt where usage gave it, teaches the
        replica's prompt scale."""
        with self._lock:
            request = self._requests.pop(handle, None)
            self._chunks.pop(handle, None)
            if request is None or not prompt_tokens or request.prompt_tokens_estimate <= 0:
                return
            low, high = self.PROMPT_RATIO_BOUNDS
            estimate = request.prompt_tokens_estimate
            self._fold(
                self._prompt_per_estimate,
                request.replica,
                min(prompt_tokens, estimate * high),
                min(estimate, prompt_tokens / low),
            )

    def calibrate(self, replica: str, output_tokens: int, content_chunks: int) -> None:
        """Fold one finished stream's exact output tokens and its counted chunks into the replica's sums."""
        if output_tokens < 1 or content_chunks < 1:
            return
        with self._lock:
            self._fold(self._output_per_chunks, replica, output_tokens, content_chunks)

    def _fold(
        self, sums: dict[str, tuple[float, float]], replica: str, numerator: float, denominator: float
    ) -> None:
        old_numerator, old_denominator = sums.get(replica, (0.0, 0.0))
        keep, w = 1 - self.CALIBRATION_WEIGHT, self.CALIBRATION_WEIGHT
        sums[replica] = (keep * old_numerator + w * numerator, keep * old_denominator + w * denominator)

    @staticmethod
    def _ratio(sums: dict[str, tuple[float, float]], replica: str) -> float:
        numerator, denominator = sums.get(replica, (0.0, 0.0))
        return numerator / denominator if denominator > 0 else 1.0

    def tokens_per_chunk(self, replica: str) -> float:
        """At least one: a chunk that carries content carries a token."""
        return max(1.0, self._ratio(self._output_per_chunks, replica))

    def forget(self, replica: str) -> None:
        """Drop the scales a replica that went away taught. Its requests still in flight stay: its
        proxy outlives a reload (a listener needs a restart), and each leaves with its exchange."""
        with self._lock:
            self._output_per_chunks.pop(replica, None)
            self._prompt_per_estimate.pop(replica, None)

    def current(self, replica: str | None = None) -> list[InFlightRequest]:
        """Every request in flight now, or only ``replica``'s."""
        with self._lock:
            out = []
            for handle, req in self._requests.items():
                if replica is not None and req.replica != replica:
                    continue
                per_chunk = self.tokens_per_chunk(req.replica)
                generated = round(self._chunks.get(handle, 0) * per_chunk)
                prompt = round(
                    req.prompt_tokens_estimate * self._ratio(self._prompt_per_estimate, req.replica)
                )
                out.append(
                    InFlightRequest(
                        req.replica,
                        req.model_name,
                        req.admission_band,
                        prompt,
                        generated,
                        req.started_at,
                        req.max_tokens,
                    )
                )
            return out
