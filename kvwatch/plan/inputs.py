"""What a replay replays: a kvwatch request ledger or a public trace, as simulator requests.

A ledger line becomes a request at its recorded arrival (``started_at``, relative to the first),
with its prompt and output lengths. How it ended decides what the twin is asked to do:

* ``completed``: the model stops (EOS) after ``output_tokens``;
* ``truncated``: ``max_tokens`` cut it, so the model would have gone on: it stops on the budget;
* ``aborted``: the client left after ``e2e_seconds``; the twin's client leaves at the same age;
* ``error`` and ``rejected``: not replayed (the engine never served them), counted.

An aborted request often has no token counts: usage comes in a stream's last chunk, which a client
that leaves never gets, so the proxy records no prompt length (and no output length when it left
before the first token). Such a line is still replayed, since the load it put on the queue and the
KV cache is real: its prompt is the proxy's estimate from the request's size
(``prompt_tokens_estimate``) where the line has one, else the median prompt of its replica's lines
that have one (else of the whole ledger); its output so far is 0 when unknown; the count of lines
filled in each way is reported.

Traces (Azure, BurstGPT, Mooncake) have no outcomes: each request stops at its recorded output
length (``sim.workload.load_trace``). Unlike ``kvwatch report`` (which skips and counts malformed
lines), a replay refuses a ledger line it cannot replay and names the line and key.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from kvwatch.jsonsafe import finite
from kvwatch.plan.jsonl import json_records
from kvwatch.report.inputs import InputFile, ReportError, detect_formats, expand, open_binary
from kvwatch.sim.workload import Trace, TraceError, WorkloadRequest, load_trace

REQUIRED = ("started_at", "prompt_tokens", "output_tokens", "outcome")
REQUIRED_ABORTED = ("started_at", "outcome", "e2e_seconds")
REPLAYED_OUTCOMES = ("completed", "truncated", "aborted")
SKIPPED_OUTCOMES = ("error", "rejected")
PROMPT_FROM_SIZE = "aborted without usage: prompt length estimated from the request's size"
PROMPT_FROM_MEDIAN = "aborted without usage: prompt length from the ledger's median"
NO_PROMPT_KNOWN = "aborted without usage, and no line of the ledger gives a prompt length"


class PlanInputError(ValueError):
    """An input a replay cannot use; the message names the file, line and key."""


@dataclass(frozen=True, slots=True)
class LedgerLine:
    """A ledger line as read: the recorded report of a replay reads the lines it kept again, as
    ``kvwatch report`` reads them, so the twin and the node are compared over the same requests."""

    path: str
    where: str  # "<path> line N"
    text: bytes
    obj: dict


@dataclass(frozen=True, slots=True)
class Workload:
    """The requests to replay, where they came from, and what was left out."""

    kind: str  # ledger | azure | burstgpt | mooncake
    paths: tuple[str, ...]
    requests: tuple[WorkloadRequest, ...]
    skipped: dict[str, int]  # reason -> count
    start_unix: float | None  # the first request's recorded time (ledgers)
    estimated: dict[str, int] = field(default_factory=dict)  # what was filled in -> count of lines
    #: request_id -> output tokens its client received, for the aborted requests of a ledger (their
    #: ``output_tokens`` is what the twin's model would have gone on to, not what was served)
    received_tokens: dict[str, int] = field(default_factory=dict)
    #: a ledger's lines these requests came from and the lines not replayed among them, in file order
    #: (only when read with ``keep_lines``: the recorded side of a replay)
    lines: tuple[LedgerLine, ...] = ()

    @property
    def span_seconds(self) -> float:
        return self.requests[-1].arrival if self.requests else 0.0

    def caveats(self) -> list[str]:
        """What a reader of a replay or an export must know: the lines left out and filled in."""
        out = []
        if self.skipped:
            out.append("not replayed: " + ", ".join(f"{k} {v:,}" for k, v in self.skipped.items()))
        if self.estimated:
            out.append("filled in: " + ", ".join(f"{k} {v:,}" for k, v in self.estimated.items()))
        return out


def _number(obj: dict, key: str, where: str, *, integer: bool) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if finite(value) is None:
        raise PlanInputError(f"{where}: {key!r} is {value!r}, expected a number")
    if integer and (value != int(value) or value < 0):
        raise PlanInputError(f"{where}: {key!r} is {value!r}, expected a whole token count (0 or more)")
    return int(value) if integer else float(value)


def _ledger_lines(item: InputFile) -> list[LedgerLine]:
    reader, raw = open_binary(item)
    rows = []
    try:
        for where, obj, text in json_records(reader, item.path, PlanInputError):
            if not isinstance(obj, dict):
                raise PlanInputError(f"{where}: not a JSON object")
            rows.append(LedgerLine(str(item.path), where, text, obj))
    finally:
        reader.close()
        raw.close()
    return rows


@dataclass(frozen=True, slots=True)
class _Replayed:
    request: WorkloadRequest
    estimated: str | None = None  # what the line lacked and was filled in, if anything
    received: int | None = None  # an aborted request's output tokens, as its client got them


def _typical_prompts(rows: list[LedgerLine]) -> dict[str | None, int]:
    """Median prompt length per replica, and of the whole ledger (key None), over the lines that
    have one: what an aborted line without usage is replayed with."""
    by_replica: dict[str | None, list[int]] = {}
    for row in rows:
        obj = row.obj
        value = finite(obj.get("prompt_tokens"))
        if value is None or value < 1 or value != int(value):
            continue  # the line's own check names it, if it is replayed
        for key in (None, str(obj.get("replica") or "")):
            by_replica.setdefault(key, []).append(int(value))
    return {key: statistics.median_low(values) for key, values in by_replica.items()}


def _ledger_request(
    where: str, obj: dict, index: int, typical_prompts: dict[str | None, int]
) -> _Replayed | str:
    """The request to replay, or the reason it is not replayed."""
    outcome = obj.get("outcome")
    if outcome in SKIPPED_OUTCOMES:
        return f"outcome {outcome} (never served)"
    required = REQUIRED_ABORTED if outcome == "aborted" else REQUIRED
    missing = [k for k in required if obj.get(k) is None]
    if missing:
        needs = "an aborted line needs" if outcome == "aborted" else "a replay needs"
        raise PlanInputError(
            f"{where}: missing {', '.join(map(repr, missing))} ({needs} {', '.join(required)})"
        )
    if outcome not in REPLAYED_OUTCOMES:
        raise PlanInputError(
            f"{where}: 'outcome' is {outcome!r}, expected one of "
            f"{', '.join(REPLAYED_OUTCOMES + SKIPPED_OUTCOMES)}"
        )
    started = _number(obj, "started_at", where, integer=False)
    prompt = _number(obj, "prompt_tokens", where, integer=True)
    output = _number(obj, "output_tokens", where, integer=True)
    max_tokens = _number(obj, "max_tokens", where, integer=True)
    assert started is not None
    estimated = None
    if prompt is None:  # only an aborted line gets here (REQUIRED_ABORTED)
        prompt = _number(obj, "prompt_tokens_estimate", where, integer=True)
        estimated = PROMPT_FROM_SIZE
        if not prompt:
            prompt = typical_prompts.get(str(obj.get("replica") or ""), typical_prompts.get(None))
            estimated = PROMPT_FROM_MEDIAN
        if prompt is None:
            return NO_PROMPT_KNOWN
    if prompt < 1:
        raise PlanInputError(f"{where}: 'prompt_tokens' is {prompt}, expected >= 1")
    output = 0 if output is None else output  # an aborted line: no content reached its client
    patience = None
    if outcome == "completed":
        target = max(int(output), 1)
    elif outcome == "truncated":
        budget = max_tokens if max_tokens is not None else output
        target, max_tokens = int(budget) + 1, int(budget)
    else:
        e2e = _number(obj, "e2e_seconds", where, integer=False)
        assert e2e is not None  # REQUIRED_ABORTED
        patience = max(e2e, 0.0)
        target = int(max_tokens) if max_tokens is not None else max(int(output), 1) * 4
    request = WorkloadRequest(
        request_id=f"ledger-{index}",
        arrival=started,
        prompt_tokens=int(prompt),
        output_tokens=target,
        max_tokens=None if max_tokens is None else int(max_tokens),
        klass=str(obj.get("replica") or ""),
        total_patience=patience,
    )
    return _Replayed(request, estimated, int(output) if outcome == "aborted" else None)


def _check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise PlanInputError(f"--limit must be at least 1 (replay the first N requests), got {limit}")


def _ledger_results(rows: list[LedgerLine], typical_prompts: dict[str | None, int]) -> list[_Replayed | str]:
    """Each line's request (numbered in file order), or the reason it is not replayed."""
    results: list[_Replayed | str] = []
    replayed = 0
    for row in rows:
        result = _ledger_request(row.where, row.obj, replayed, typical_prompts)
        replayed += isinstance(result, _Replayed)
        results.append(result)
    return results


def _arrived_by(obj: dict, cutoff: float) -> bool:
    started = finite(obj.get("started_at"))
    return started is not None and started <= cutoff


def _window(rows: list[LedgerLine], results: list[_Replayed | str], limit: int | None) -> list[int]:
    """The lines a replay of the first ``limit`` requests covers (every line without a limit): those
    requests, first by arrival as the twin replays them, and the lines not replayed that arrived by
    the last of them, so the recorded figures and the counts of what was left out cover the same
    stretch of the ledger as the twin."""
    replayed = sorted(
        ((i, r) for i, r in enumerate(results) if isinstance(r, _Replayed)),
        key=lambda p: p[1].request.arrival,
    )
    if limit is None or limit >= len(replayed):
        return list(range(len(rows)))
    chosen = {i for i, _ in replayed[:limit]}
    cutoff = replayed[limit - 1][1].request.arrival
    return [
        i
        for i, r in enumerate(results)
        if i in chosen or (isinstance(r, str) and _arrived_by(rows[i].obj, cutoff))
    ]


def read_ledger(files: list[InputFile], *, limit: int | None = None, keep_lines: bool = False) -> Workload:
    """The ledger's first ``limit`` requests by arrival (all without a limit). ``keep_lines``: keep the
    lines they cover (``Workload.lines``), for the recorded side of a replay."""
    _check_limit(limit)
    rows = [row for item in files for row in _ledger_lines(item)]
    results = _ledger_results(rows, _typical_prompts(rows))
    if not any(isinstance(r, _Replayed) for r in results):
        names = ", ".join(str(f.path) for f in files)
        counts = _counts(r for r in results if isinstance(r, str))
        why = "; ".join(f"{reason}: {n:,}" for reason, n in counts.items()) or "no lines"
        raise PlanInputError(f"{names}: no replayable request ({why})")
    window = _window(rows, results, limit)
    kept = [results[i] for i in window]
    replayed = [r for r in kept if isinstance(r, _Replayed)]
    skipped = _counts(r for r in kept if isinstance(r, str))
    estimated = _counts(r.estimated for r in replayed if r.estimated is not None)
    received = {r.request.request_id: r.received for r in replayed if r.received is not None}
    requests = sorted((r.request for r in replayed), key=lambda q: q.arrival)
    t0 = requests[0].arrival
    rebased = tuple(replace(r, arrival=r.arrival - t0) for r in requests)
    lines = tuple(rows[i] for i in window) if keep_lines else ()
    return Workload(
        "ledger", tuple(str(f.path) for f in files), rebased, skipped, t0, estimated, received, lines
    )


def _counts(values: Iterable[str]) -> dict[str, int]:
    """How often each value comes, in order of first appearance (the order the output lists them)."""
    out: dict[str, int] = {}
    for value in values:
        out[value] = out.get(value, 0) + 1
    return out


def read_workload(paths: list[str], *, limit: int | None = None, keep_lines: bool = False) -> Workload:
    """A ledger (files, globs, rotations, gzip) or one trace file; ``limit``: its first N requests by
    arrival. ``keep_lines``: a ledger's ``Workload.lines``, for the recorded side of a replay."""
    _check_limit(limit)
    try:
        files = expand(paths)
        formats = detect_formats(files)  # an empty file (a ledger's newest after rotation) has none
    except ReportError as exc:
        raise PlanInputError(str(exc)) from None
    kinds = set(formats.values())
    if kinds == {"ledger"}:
        return read_ledger(files, limit=limit, keep_lines=keep_lines)
    files = [f for f in files if f.path in formats]
    if len(files) != 1 or len(kinds) != 1:
        raise PlanInputError(
            f"replay one ledger (any number of its files) or one trace file, got "
            f"{len(files)} file(s) in format(s) {', '.join(sorted(kinds))}"
        )
    try:
        trace: Trace = load_trace(files[0].path, limit=limit)
    except TraceError as exc:
        raise PlanInputError(str(exc)) from None
    if not trace.requests:
        raise PlanInputError(f"{files[0].path}: the trace has no request to replay")
    skipped = {"no output tokens (failed in the trace)": trace.skipped} if trace.skipped else {}
    return Workload(trace.format, (str(files[0].path),), trace.requests, skipped, None)


#: what ``replay``/``compare`` replay when given no ledger or trace: the first simulated hour of the demo
DEMO_WORKLOAD_HOURS = 1


def demo_workload_requests(*, limit: int | None = None, seed: int = 0) -> Workload:
    """``kvwatch demo``'s default workload (``sim.presets.demo_workload``: reasoning requests at 1/s,
    a 1.5x burst from minute 30 to 40, clients that leave after 120 s without a first token), its
    first simulated hour, so a newcomer sees a plan without a trace of their own."""
    from kvwatch.sim.presets import demo_workload
    from kvwatch.sim.workload import generate

    spec = demo_workload(seed, hours=DEMO_WORKLOAD_HOURS)
    requests = tuple(generate(spec, count=limit, duration=3600.0 * DEMO_WORKLOAD_HOURS))
    where = (
        f"workload: reasoning at {spec.rate:g}/s, 1.5x burst at minute 30-40, seed {seed}, "
        f"first {DEMO_WORKLOAD_HOURS} simulated hour"
    )
    return Workload("demo", (where,), requests, {}, None)


def workload_of(paths: list[str], limit: int | None = None, *, keep_lines: bool = False) -> Workload:
    """The ledger or trace named on the command line; none named: the demo's default workload."""
    if not paths:
        _check_limit(limit)
        return demo_workload_requests(limit=limit)
    return read_workload(paths, limit=limit, keep_lines=keep_lines)
