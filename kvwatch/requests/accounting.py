"""Per-request accounting for the proxy: what a request asked for, and what its stream did.

The proxy's byte relay calls a ``RequestMeter`` once per upstream read and once at the end; the meter
turns that into one ``RequestRecord``. Everything here may fail without hurting the client: the
proxy wraps each call, counts the failure and keeps relaying.

Definitions (docs/requests.md quotes them):

- **received** (``t0``): the first byte of the request reached kvwatch's socket callback.
- **TTFT**: received → the first content-bearing event (``sse.py``) was written to the client.
- **inter-chunk gap**: between successive content-bearing events as written to the client; events
  that reach the client in one write are separate chunks with a zero gap. The longest gap and when it
  ended (``started_at`` + its offset from ``t0``) are kept too, to tell preemption stalls.
- **e2e**: received → the last byte written to the client (or the moment the exchange ended early:
  client gone, upstream broken).
- **output tokens**: ``usage.completion_tokens``; without usage, the number of content-bearing events
  (``output_tokens_estimated``).
- **TPOT**: ``RequestRecord.tpot_seconds`` = (e2e − TTFT) / (output_tokens − 1).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar, Protocol

from kvwatch import buckets
from kvwatch.jsonsafe import loads
from kvwatch.model import MAX_COUNT, InFlightRequest, Outcome, RequestRecord
from kvwatch.requests import sse
from kvwatch.requests.values import bounded_count
from kvwatch.safetext import terminal_safe

OTHER_MODEL = "other"
#: rough bytes of request body per prompt token (BPE on English text is ~4 characters per token;
#: JSON framing and chat roles add a little, images in base64 far more). Used only for estimates: the
#: live in-flight tokens until the engine's usage says otherwise, and the record of a request whose
#: usage never came (``RequestRecord.prompt_tokens_estimate``).
PROMPT_BYTES_PER_TOKEN = 4
MAX_LEARNED_MODELS = 16


class InFlight(Protocol):
    """What the proxy needs of ``state.InFlightTracker`` (sources do not import state)."""

    def start(self, request: InFlightRequest) -> int: ...
    def progress(self, handle: int, content_chunks: int) -> None: ...
    def finish(self, handle: int, prompt_tokens: int | None = None) -> None: ...
    def calibrate(self, replica: str, output_tokens: int, content_chunks: int) -> None: ...


class End(Enum):
    """How an exchange ended, from the relay's point of view."""

    COMPLETE = "complete"  # the response was relayed in full
    CLIENT_GONE = "client_gone"  # the client disconnected first; upstream was closed at once
    UPSTREAM_FAILED = "upstream_failed"  # refused, timed out, 5xx-free but broken/reset stream


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the client asked for, read once from the request body."""

    endpoint: str  # chat | completions
    parsed: bool  # the body was a JSON object
    model: str | None  # as the client sent it: never exported, only mapped by ModelLabels
    streaming: bool
    max_tokens: int | None
    wants_usage: bool  # the client itself set stream_options.include_usage
    stream_options_present: bool
    choices: int = 1  # sequences the engine runs: n, times the prompts of a completions list
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    max_tokens_out_of_range: bool = False  # a limit over MAX_COUNT: max_tokens is None, and noted
    body_bytes: int = 0  # the request body's size, for a prompt estimate where no usage comes


#: strings pydantic (lax mode, which vLLM's request models use) reads as ``True`` for a bool field,
#: compared lower-cased; the numbers 1 and 1.0 are ``True`` too
LAX_TRUE_STRINGS = frozenset({"true", "1", "yes", "on", "t", "y"})


def inspect_request(body: bytes, endpoint: str) -> RequestInfo:
    try:
        doc = loads(body)
    except ValueError:  # UnicodeDecodeError is one, and jsonsafe.loads raises one for deep nesting
        doc = None
    if not isinstance(doc, dict):
        return RequestInfo(endpoint, False, None, False, None, False, False, body_bytes=len(body))
    n = doc.get("n")
    model = doc.get("model")
    options = doc.get("stream_options")
    limit = doc.get("max_completion_tokens")
    if limit is None:  # null or absent: vLLM falls back to max_tokens (`is not None`)
        limit = doc.get("max_tokens")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        limit = None
    return RequestInfo(
        endpoint=endpoint,
        parsed=True,
        model=model if isinstance(model, str) else None,
        streaming=doc.get("stream") is True,
        max_tokens=limit if limit is None or limit <= MAX_COUNT else None,
        wants_usage=isinstance(options, dict) and _lax_true(options.get("include_usage")),
        stream_options_present="stream_options" in doc,
        choices=(n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1)
        * (_prompts(doc) if endpoint == "completions" else 1),
        continuous_usage=isinstance(options, dict) and _lax_true(options.get("continuous_usage_stats")),
        max_tokens_out_of_range=limit is not None and limit > MAX_COUNT,
        body_bytes=len(body),
    )


def _prompts(doc: dict) -> int:
    """Prompts in one completions request: a list of strings or of token lists is a batch (vLLM
    merges their outputs into one stream, choice index = prompt x n + i); a string or one list of
    token ids is one prompt."""
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return min(len(prompt), MAX_COUNT)
    return 1


def _lax_true(value: object) -> bool:
    """Whether the engine will read ``value`` as true (so the client asked for usage itself)."""
    if isinstance(value, str):
        return value.lower() in LAX_TRUE_STRINGS
    return isinstance(value, (bool, int, float)) and value == 1


def body_requesting_usage(body: bytes, info: RequestInfo) -> bytes | None:
    """The body with ``stream_options.include_usage`` set, or None where it must stay as sent.

    Only a body that is a JSON object in UTF-8 (RFC 8259's encoding, no BOM) is touched: the key
    is inserted as text after its opening brace, which keeps a valid object valid and every other
    byte as the client wrote it (json.loads also reads UTF-16 and UTF-32, where that insertion
    would corrupt the body). A body that has ``stream_options`` already is re-serialised, unless
    that would change a value (a number beyond a float's range becomes ``Infinity``). With several
    choices (``n`` > 1) nothing is asked: the relay could not put the engine's final-chunk fields
    back in place without reordering choices, so those streams are counted from chunks.
    """
    if not (info.parsed and info.streaming) or info.wants_usage or info.choices > 1 or info.continuous_usage:
        # continuous_usage_stats alone does nothing on a direct connection; with include_usage added
        # the engine would put usage on every chunk the client reads
        return None
    if body.lstrip(b" \t\r\n")[:1] != b"{" or not _utf8(body):
        return None
    if not info.stream_options_present:
        brace = body.find(b"{")
        return body[: brace + 1] + b'"stream_options":{"include_usage":true},' + body[brace + 1 :]
    doc = loads(body)
    options = doc.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return None  # the engine will judge this body as sent
    doc["stream_options"] = {**(options or {}), "include_usage": True}
    try:
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except (ValueError, UnicodeEncodeError):  # Infinity/NaN, or a lone surrogate escape
        return None


def _utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def estimate_prompt_tokens(body_bytes: int) -> int:
    return body_bytes // PROMPT_BYTES_PER_TOKEN


class ModelLabels:
    """Maps a client-chosen model name onto the bounded label set; the rest is ``other``.

    Served names come from the engine (``/v1/models``): a label made of one is ``terminal_safe``."""

    def __init__(self, known: Iterable[str], default: str | None) -> None:
        self.known = set(known)
        self.default = default
        if default:
            self.known.add(default)

    def learn(self, served: Iterable[str]) -> None:
        """Add the engine's own served names (from ``/v1/models``), capped."""
        served = [s for s in served if isinstance(s, str) and s][:MAX_LEARNED_MODELS]
        self.known.update(served)
        if self.default is None and len(served) == 1:
            self.default = terminal_safe(served[0])

    def label(self, requested: str | None) -> str:
        if requested is None:
            return self.default or OTHER_MODEL
        return terminal_safe(requested) if requested in self.known else OTHER_MODEL


def decide_outcome(
    status: int | None, end: End, finish_reason: str | None, stream_error: bool = False
) -> Outcome:
    """``stream_error``: the engine wrote an error event into its 200 stream (a generation that failed
    after it began), which is an error whatever finish reason a choice had reached."""
    if end is End.CLIENT_GONE:
        return Outcome.ABORTED
    if status is None or end is End.UPSTREAM_FAILED or status >= 500:
        return Outcome.ERROR
    if status >= 400:
        return Outcome.REJECTED
    if stream_error:
        return Outcome.ERROR
    if finish_reason == "length":
        return Outcome.TRUNCATED
    if finish_reason in ("abort", "error"):
        return Outcome.ERROR
    return Outcome.COMPLETED


@dataclass(slots=True, eq=False)
class RequestMeter:
    """One request's timings and counts while it streams; ``record()`` builds the RequestRecord.

    ``on_events`` runs once per upstream read that yielded complete events (the hot path): a regex
    search per event, a bisect per read with content, a compare (and two stores when a gap is the
    longest yet), a dict store for the in-flight estimate.
    """

    GAP_BOUNDS: ClassVar[tuple[float, ...]] = buckets.INTER_CHUNK_SECONDS

    replica: str
    model_name: str
    info: RequestInfo
    started_at: float
    t0: float
    in_flight: InFlight | None = None
    handle: int | None = None
    _bins: list[int] = field(init=False, default_factory=lambda: [0] * (len(RequestMeter.GAP_BOUNDS) + 1))
    _first: float | None = field(init=False, default=None)
    _last: float = field(init=False, default=0.0)
    _max_gap: float = field(init=False, default=0.0)
    _max_gap_end: float | None = field(init=False, default=None)
    gap_sum: float = field(init=False, default=0.0)
    chunks: int = field(init=False, default=0)
    e2e: float | None = field(init=False, default=None)
    finish_reason: str | None = field(init=False, default=None)
    usage: sse.Usage | None = field(init=False, default=None)
    prompt_tokens: int | None = field(init=False, default=None)
    finished_choices: int = field(init=False, default=0)  # finish reasons seen (one a choice)
    stream_error: bool = field(init=False, default=False)  # an engine error event in the stream

    def on_events(self, events: bytes, separator: bytes, now: float) -> None:
        """Complete SSE events just written to the client at ``now`` (perf_counter seconds)."""
        n = sse.count_content_events(events, separator)
        if n:
            self.on_content(n, now)
        reason, finished = sse.finishes(events)
        if reason is not None:
            # a token-budget cut on any choice stays: a later read's ``stop`` must not hide it
            self.finish_reason = "length" if self.finish_reason == "length" else reason
            self.finished_choices += finished  # each finishing chunk carries one reason
        if sse.has_error_event(events):
            self.stream_error = True

    @property
    def every_choice_finished(self) -> bool:
        """Every choice (``n``, and every prompt of a list) reached its finish reason."""
        return self.finished_choices >= self.info.choices

    def on_content(self, n: int, now: float) -> None:
        """``n`` content-bearing events written together at ``now``, none with a finish reason: the
        proxy's per-chunk path calls this directly for a read that is one content event."""
        if self._first is None:
            self._first = now
            self._bins[0] += n - 1
        else:
            gap = now - self._last
            self._bins[bisect.bisect_left(self.GAP_BOUNDS, gap)] += 1
            self._bins[0] += n - 1
            self.gap_sum += gap
            if gap > self._max_gap:
                self._max_gap = gap
                self._max_gap_end = now
        self._last = now
        self.chunks += n
        if self.handle is not None and self.in_flight is not None:
            self.in_flight.progress(self.handle, self.chunks)

    def on_usage(self, usage: sse.Usage) -> None:
        self.usage = usage

    def on_json_body(self, body: bytes) -> None:
        """A non-streaming response: usage and finish reason come from its JSON once."""
        usage, reason = sse.usage_from_body(body)
        if usage is not None:
            self.usage = usage
        if reason is not None:
            self.finish_reason = reason
            self.finished_choices = self.info.choices  # the whole answer is in the body

    def on_end(self, now: float) -> None:
        self.e2e = now - self.t0

    @property
    def ttft(self) -> float | None:
        return None if self._first is None else self._first - self.t0

    def record(self, status: int | None, end: End) -> RequestRecord:
        outcome = decide_outcome(status, end, self.finish_reason, self.stream_error)
        usage = self.usage
        dropped = ["max_tokens"] if self.info.max_tokens_out_of_range else []
        output, estimated = None, False
        prompt = bounded_count(usage.prompt_tokens, "prompt_tokens", dropped) if usage is not None else None
        if usage is not None and usage.completion_tokens is not None:
            output = bounded_count(usage.completion_tokens, "output_tokens", dropped)
        ended = outcome in (Outcome.COMPLETED, Outcome.TRUNCATED)
        if output is None and self.info.streaming and (self.chunks or ended):
            output, estimated = self.chunks, True
        choices = self.info.choices
        if output is not None and choices > 1:
            # the engine runs one sequence a choice (vLLM: n child requests), and the band, TPOT and
            # the output histograms describe a sequence; the ledger keeps ``choices`` for the total
            output = round(output / choices)
        gaps = tuple(self._bins) if self.chunks > 1 else ()
        gap_end = self._max_gap_end if self._max_gap_end is not None else self._first
        return RequestRecord(
            replica=self.replica,
            model_name=self.model_name,
            source="proxy",
            outcome=outcome,
            started_at=self.started_at,
            endpoint=self.info.endpoint,
            streaming=self.info.streaming,
            status_code=status,
            finish_reason=self.finish_reason,
            prompt_tokens=prompt,
            output_tokens=output,
            output_tokens_estimated=estimated,
            max_tokens=self.info.max_tokens,
            ttft_seconds=self.ttft,
            e2e_seconds=self.e2e,
            chunks=self.chunks if self.info.streaming else None,
            gap_bounds=self.GAP_BOUNDS if gaps else (),
            gap_counts=gaps,
            gap_sum=self.gap_sum if gaps else 0.0,
            max_gap_seconds=self._max_gap if gaps else None,
            max_gap_ended_at=self.started_at + (gap_end - self.t0) if gaps and gap_end is not None else None,
            dropped_values=tuple(dropped),
            prompt_tokens_estimate=estimate_prompt_tokens(self.info.body_bytes) if prompt is None else None,
            choices=choices,
        )
