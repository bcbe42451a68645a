"""The requests the proxy relays right now, with their generated tokens estimated from chunks."""

from __future__ import annotations

import threading

from kvwatch.model import InFlightRequest


class InFlightTracker:
    """Requests the proxy relays right now; the proxy updates content chunks as they pass.

    Generated tokens of a running stream are estimated as chunks x tokens-per-chunk, a per-replica
    moving average learned from finished streams whose usage gave the exact count: one chunk is
    one token on most engines at normal pace, several with stream intervals, speculative decoding,
    merged deltas under load, or the demo's accelerated clock.

    Prompt tokens are known only from the usage at a request's end, so a running request's prompt
    is its body's size / 4, scaled by a per-replica moving average of exact prompt / that estimate
    over finished requests: the chat template's tokens, JSON around the text, and text that is not
    four bytes a token (code, CJK, base64 images) move the ratio per workload.
    """

    CALIBRATION_WEIGHT = 0.2  # weight of the newest finished stream in the moving average
    #: one request's exact prompt / estimate, clamped: a body padded (or a prompt templated) out of
    #: all proportion moves the replica's scale by at most this factor's weight, not without bound
    PROMPT_RATIO_BOUNDS = (1 / 16, 16.0)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._requests: dict[int, InFlightRequest] = {}
        self._chunks: dict[int, int] = {}
        self._tokens_per_chunk: dict[str, float] = {}
        self._prompt_scale: dict[str, float] = {}

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
            if request is not None and prompt_tokens and request.prompt_tokens_estimate > 0:
                low, high = self.PROMPT_RATIO_BOUNDS
                ratio = min(max(prompt_tokens / request.prompt_tokens_estimate, low), high)
                self._fold(self._prompt_scale, request.replica, ratio)

    def calibrate(self, replica: str, output_tokens: int, content_chunks: int) -> None:
        """Fold one finished stream's exact tokens-per-chunk into the replica's average."""
        if output_tokens < 1 or content_chunks < 1:
            return
        ratio = max(1.0, output_tokens / content_chunks)
        with self._lock:
            self._fold(self._tokens_per_chunk, replica, ratio)

    def _fold(self, averages: dict[str, float], replica: str, value: float) -> None:
        old = averages.get(replica)
        w = self.CALIBRATION_WEIGHT
        averages[replica] = value if old is None else (1 - w) * old + w * value

    def tokens_per_chunk(self, replica: str) -> float:
        return self._tokens_per_chunk.get(replica, 1.0)

    def current(self, replica: str | None = None) -> list[InFlightRequest]:
        """Every request in flight now, or only ``replica``'s."""
        with self._lock:
            out = []
            for handle, req in self._requests.items():
                if replica is not None and req.replica != replica:
                    continue
                per_chunk = self._tokens_per_chunk.get(req.replica, 1.0)
                generated = round(self._chunks.get(handle, 0) * per_chunk)
                prompt = round(req.prompt_tokens_estimate * self._prompt_scale.get(req.replica, 1.0))
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
