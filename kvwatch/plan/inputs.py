"""What a replay replays: a kvwatch request ledger or a public trace, as simulator requests.

A ledger line becomes a request at its recorded arrival (``started_at``, relative to the first),
with its prompt and output lengths. How it ended decides what the twin is asked to do:

* ``completed``: the model stops (EOS) after ``output_tokens``;
* ``truncated``: ``max_tokens`` cut it, so the model would have gone on: it stops on the budget;
* ``aborted``: the client left after ``e2e_seconds``; the twin's client leaves at the same age;
* ``error`` and ``rejected``: not replayed (the engine never served them), counted.

Traces (Azure, BurstGPT, Mooncake) have no outcomes: each request stops at its recorded output
length (``sim.workload.load_trace``). Unlike ``kvwatch report`` (which skips and counts malformed
lines), a replay refuses a ledger line it cannot replay and names the line and key.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.jsonsafe import finite
from kvwatch.plan.jsonl import json_lines
from kvwatch.report.inputs import InputFile, ReportError, detect_format, expand, open_binary
from kvwatch.sim.workload import Trace, TraceError, WorkloadRequest, load_trace

REQUIRED = ("started_at", "prompt_tokens", "output_tokens", "outcome")
REPLAYED_OUTCOMES = ("completed", "truncated", "aborted")
SKIPPED_OUTCOMES = ("error", "rejected")


class PlanInputError(ValueError):
    """An input a replay cannot use; the message names the file, line and key."""


@dataclass(frozen=True, slots=True)
class Workload:
    """The requests to replay, where they came from, and what was left out."""

    kind: str  # ledger | azure | burstgpt | mooncake
    paths: tuple[str, ...]
    requests: tuple[WorkloadRequest, ...]
    skipped: dict[str, int]  # reason -> count
    start_unix: float | None  # the first request's recorded time (ledgers)

    @property
    def span_seconds(self) -> float:
        return self.requests[-1].arrival if self.requests else 0.0


def _number(obj: dict, key: str, where: str, *, integer: bool) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if finite(value) is None:
        raise PlanInputError(f"{where}: {key!r} is {value!r}, expected a number")
    if integer and (value != int(value) or value < 0):
        raise PlanInputError(f"{where}: {key!r} is {value!r}, expected a whole token count (0 or more)")
    return int(value) if integer else float(value)


def _ledger_lines(item: InputFile) -> list[tuple[str, dict]]:
    reader, raw = open_binary(item)
    rows = []
    try:
        for where, obj in json_lines(reader, item.path, PlanInputError):
            if not isinstance(obj, dict):
                raise PlanInputError(f"{where}: not a JSON object")
            rows.append((where, obj))
    finally:
        reader.close()
        raw.close()
    return rows


def _ledger_request(where: str, obj: dict, index: int) -> WorkloadRequest | str:
    """The request to replay, or the reason it is not replayed."""
    missing = [k for k in REQUIRED if obj.get(k) is None]
    if "outcome" not in missing and obj["outcome"] in SKIPPED_OUTCOMES:
        return f"outcome {obj['outcome']} (never served)"
    if missing:
        raise PlanInputError(
            f"{where}: missing {', '.join(map(repr, missing))} (a replay needs "
            f"{', '.join(REQUIRED)}; aborted lines also e2e_seconds)"
        )
    outcome = obj["outcome"]
    if outcome not in REPLAYED_OUTCOMES:
        raise PlanInputError(
            f"{where}: 'outcome' is {outcome!r}, expected one of "
            f"{', '.join(REPLAYED_OUTCOMES + SKIPPED_OUTCOMES)}"
        )
    started = _number(obj, "started_at", where, integer=False)
    prompt = _number(obj, "prompt_tokens", where, integer=True)
    output = _number(obj, "output_tokens", where, integer=True)
    max_tokens = _number(obj, "max_tokens", where, integer=True)
    assert started is not None and prompt is not None and output is not None
    if prompt < 1:
        raise PlanInputError(f"{where}: 'prompt_tokens' is {prompt}, expected >= 1")
    patience = None
    if outcome == "completed":
        target = max(int(output), 1)
    elif outcome == "truncated":
        budget = max_tokens if max_tokens is not None else output
        target, max_tokens = int(budget) + 1, int(budget)
    else:
        e2e = _number(obj, "e2e_seconds", where, integer=False)
        if e2e is None:
            raise PlanInputError(f"{where}: an aborted request needs 'e2e_seconds' (when its client left)")
        patience = max(e2e, 0.0)
        target = int(max_tokens) if max_tokens is not None else max(int(output), 1) * 4
    return WorkloadRequest(
        request_id=f"ledger-{index}",
        arrival=started,
        prompt_tokens=int(prompt),
        output_tokens=target,
        max_tokens=None if max_tokens is None else int(max_tokens),
        klass=str(obj.get("replica") or ""),
        total_patience=patience,
    )


def read_ledger(files: list[InputFile]) -> Workload:
    requests: list[WorkloadRequest] = []
    skipped: dict[str, int] = {}
    for item in files:
        for where, obj in _ledger_lines(item):
            result = _ledger_request(where, obj, len(requests))
            if isinstance(result, str):
                skipped[result] = skipped.get(result, 0) + 1
            else:
                requests.append(result)
    if not requests:
        names = ", ".join(str(f.path) for f in files)
        raise PlanInputError(f"{names}: no replayable request (empty, or only error/rejected lines)")
    requests.sort(key=lambda r: r.arrival)
    t0 = requests[0].arrival
    rebased = tuple(_at(r, r.arrival - t0) for r in requests)
    return Workload("ledger", tuple(str(f.path) for f in files), rebased, skipped, t0)


def _at(r: WorkloadRequest, arrival: float) -> WorkloadRequest:
    from dataclasses import replace

    return replace(r, arrival=arrival)


def read_workload(paths: list[str], *, limit: int | None = None) -> Workload:
    """A ledger (files, globs, rotations, gzip) or one trace file."""
    try:
        files = expand(paths)
        kinds = {detect_format(f) for f in files}
    except ReportError as exc:
        raise PlanInputError(str(exc)) from None
    if kinds == {"ledger"}:
        workload = read_ledger(files)
        if limit is not None:
            workload = Workload(
                workload.kind,
                workload.paths,
                workload.requests[:limit],
                workload.skipped,
                workload.start_unix,
            )
        return workload
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


def workload_of(paths: list[str], limit: int | None = None) -> Workload:
    """The ledger or trace named on the command line; none named: the demo's default workload."""
    return read_workload(paths, limit=limit) if paths else demo_workload_requests(limit=limit)
