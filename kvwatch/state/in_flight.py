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
    """

    CALIBRATION_WEIGHT = 0.2  # weight of the newest finished stream in the moving average

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._requests: dict[int, InFlightRequest] = {}
        self._chunks: dict[int, int] = {}
        self._tokens_per_chunk: dict[str, float] = {}

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

    def finish(self, handle: int) -> None:
        with self._lock:
            self._requests.pop(handle, None)
            self._chunks.pop(handle, None)

    def calibrate(self, replica: str, output_tokens: int, content_chunks: int) -> None:
        """Fold one finished stream's exact tokens-per-chunk into the replica's average."""
        if output_tokens < 1 or content_chunks < 1:
            return
        ratio = max(1.0, output_tokens / content_chunks)
        with self._lock:
            old = self._tokens_per_chunk.get(replica)
            w = self.CALIBRATION_WEIGHT
            self._tokens_per_chunk[replica] = ratio if old is None else (1 - w) * old + w * ratio

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
                out.append(
                    InFlightRequest(
                        req.replica,
                        req.model_name,
                        req.admission_band,
                        req.prompt_tokens_estimate,
                        generated,
                        req.started_at,
                        req.max_tokens,
                    )
                )
            return out
