"""Request streams for the simulator: synthetic profiles or replayed public traces.

Synthetic: Poisson arrivals (optionally multiplied inside burst windows), prompt and output lengths
from per-class distributions. The default ``reasoning`` class is inference-perf's reasoning input
profile (lognormal mean 1000, sd 800, clipped to [100, 5000]) with exponential outputs of mean 6,300
capped at 32,000, so about 45% of outputs exceed 5,000 tokens (e^(-5000/6300) = 0.452), the founding
study's figure.

Traces: Azure LLM inference (``TIMESTAMP,ContextTokens,GeneratedTokens``), BurstGPT (``Timestamp``,
``Request tokens``, ``Response tokens``, ...) and Mooncake JSONL (``timestamp`` in ms,
``input_length``, ``output_length``), recognised by their header.

Clients are impatient: a request carries how long its client waits for the first token and in
total; the driver (headless or HTTP load generator) disconnects it then, which aborts it.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from kvwatch.jsonsafe import loads


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request as the client will send it. Times are simulated seconds from workload start."""

    request_id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int  # where the "model" emits EOS
    max_tokens: int | None  # the client's budget; None: up to the context length
    klass: str = "default"
    prefix_id: str | None = None  # shared system prompt (prefix caching)
    prefix_tokens: int = 0
    first_token_patience: float | None = None  # client disconnects without a first token by then
    total_patience: float | None = None  # ... or when the whole request takes longer
    stream: bool = True


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token-length distribution: ``lognormal`` (mean, sd), ``exponential`` (mean), ``fixed``."""

    kind: str
    mean: float
    sd: float = 0.0
    low: int = 1
    high: int = 1 << 30

    def __post_init__(self) -> None:
        if self.kind not in ("lognormal", "exponential", "fixed"):
            raise ValueError(
                f"length distribution kind must be lognormal, exponential or fixed, not {self.kind!r}"
            )
        if self.mean <= 0 or self.low < 1 or self.high < self.low:
            raise ValueError(f"bad length distribution {self}: need mean > 0 and 1 <= low <= high")

    @classmethod
    def lognormal_from_quantiles(
        cls, median: float, p90: float, low: int = 1, high: int = 1 << 30
    ) -> LengthDist:
        """A lognormal through a trace's median and p90 (e.g. the Azure percentiles in the reference)."""
        sigma = (math.log(p90) - math.log(median)) / 1.2815515655446004
        mean = median * math.exp(sigma * sigma / 2)
        sd = mean * math.sqrt(math.exp(sigma * sigma) - 1)
        return cls("lognormal", mean, sd, low, high)

    def sampler(self, rng: random.Random) -> Callable[[], int]:
        """A zero-argument function drawing one clipped integer length."""
        low, high = self.low, self.high
        if self.kind == "fixed":
            value = min(max(round(self.mean), low), high)
            return lambda: value
        if self.kind == "exponential":
            lam = 1.0 / self.mean
            expo = rng.expovariate
            return lambda: min(max(math.ceil(expo(lam)), low), high)
        s2 = math.log(1 + (self.sd / self.mean) ** 2)
        mu, sigma = math.log(self.mean) - s2 / 2, math.sqrt(s2)
        logn = rng.lognormvariate
        return lambda: min(max(round(logn(mu, sigma)), low), high)


@dataclass(frozen=True, slots=True)
class RequestClass:
    """A kind of traffic in the mix (tenant, product surface)."""

    name: str
    prompt: LengthDist
    output: LengthDist
    max_tokens: int | None = 16384
    weight: float = 1.0
    system_prompt_tokens: int = 0  # shared prefix, one per class (prefix caching)
    stream_share: float = 1.0  # fraction of requests that stream


REASONING = RequestClass(
    "reasoning",
    prompt=LengthDist("lognormal", 1000, 800, 100, 5000),
    output=LengthDist("exponential", 6300, high=32000),
    max_tokens=16384,  # ~7% of targets exceed it: finish_reason length
    system_prompt_tokens=250,
)
CHAT = RequestClass(
    "chat",
    prompt=LengthDist.lognormal_from_quantiles(1020, 2734, 10, 8000),  # Azure 2023 conversation
    output=LengthDist.lognormal_from_quantiles(129, 424, 1, 2000),
    max_tokens=2048,
    system_prompt_tokens=250,
)

PROFILES: dict[str, tuple[RequestClass, ...]] = {
    "reasoning": (REASONING,),
    "chat": (CHAT,),
    "mixed": (replace(CHAT, weight=0.6), replace(REASONING, weight=0.4)),
}


@dataclass(frozen=True, slots=True)
class Burst:
    """Arrival rate is multiplied by ``multiplier`` for ``start <= t < end`` (simulated seconds)."""

    start: float
    end: float
    multiplier: float


@dataclass(frozen=True, slots=True)
class Patience:
    """How long clients wait. ``exponential``: each client's patience is drawn with that mean
    (Erlang-A's impatient customers); ``fixed``: every client has the same timeout."""

    first_token_s: float | None = 60.0
    total_s: float | None = None
    distribution: str = "fixed"

    def __post_init__(self) -> None:
        if self.distribution not in ("fixed", "exponential"):
            raise ValueError(f"patience distribution must be fixed or exponential, not {self.distribution!r}")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A synthetic workload: arrival process, traffic mix, client patience, seed."""

    rate: float = 1.0  # requests per simulated second
    classes: tuple[RequestClass, ...] = PROFILES["reasoning"]
    bursts: tuple[Burst, ...] = ()
    patience: Patience = field(default_factory=Patience)
    seed: int = 0

    @classmethod
    def profile(
        cls,
        name: str,
        *,
        rate: float = 1.0,
        bursts: tuple[Burst, ...] = (),
        patience: Patience = Patience(),
        seed: int = 0,
    ) -> WorkloadSpec:
        try:
            classes = PROFILES[name]
        except KeyError:
            raise ValueError(f"unknown workload profile {name!r}; known: {', '.join(PROFILES)}") from None
        return cls(rate=rate, classes=classes, bursts=bursts, patience=patience, seed=seed)


def _rate_multiplier(bursts: tuple[Burst, ...], t: float) -> tuple[float, float | None]:
    """The multiplier at ``t`` and the next time it may change."""
    mult = 1.0
    nxt = None
    for b in bursts:
        if b.start <= t < b.end:
            mult *= b.multiplier
            edge = b.end
        elif t < b.start:
            edge = b.start
        else:
            continue
        nxt = edge if nxt is None else min(nxt, edge)
    return mult, nxt


def arrival_times(
    rate: float, bursts: tuple[Burst, ...], rng: random.Random, start: float = 0.0
) -> Iterator[float]:
    """Poisson arrivals with a piecewise-constant rate (exact: the exponential is memoryless, so a
    gap that crosses a rate change is redrawn from the change)."""
    if rate <= 0:
        raise ValueError(f"arrival rate must be > 0 requests/s, got {rate}")
    t = start
    while True:
        mult, nxt = _rate_multiplier(bursts, t)
        r = rate * mult
        if r <= 0:
            if nxt is None:
                return
            t = nxt
            continue
        gap = rng.expovariate(r)
        if nxt is not None and t + gap >= nxt:
            t = nxt
            continue
        t += gap
        yield t


def generate(
    spec: WorkloadSpec, *, count: int | None = None, duration: float | None = None
) -> Iterator[WorkloadRequest]:
    """Draw requests until ``count`` requests or ``duration`` simulated seconds (one is required)."""
    if count is None and duration is None:
        raise ValueError("generate() needs count= or duration=")
    rng = random.Random(spec.seed)
    classes = spec.classes
    weights = [c.weight for c in classes]
    samplers = [(c, c.prompt.sampler(rng), c.output.sampler(rng)) for c in classes]
    patience = _patience_sampler(spec.patience, rng)
    for i, t in enumerate(arrival_times(spec.rate, spec.bursts, rng)):
        if (count is not None and i >= count) or (duration is not None and t >= duration):
            return
        c, prompt_of, output_of = samplers[0] if len(samplers) == 1 else rng.choices(samplers, weights)[0]
        prompt = prompt_of()
        prefix = min(c.system_prompt_tokens, prompt)
        first, total = patience()
        yield WorkloadRequest(
            request_id=f"req-{spec.seed}-{i}",
            arrival=t,
            prompt_tokens=prompt,
            output_tokens=output_of(),
            max_tokens=c.max_tokens,
            klass=c.name,
            prefix_id=f"system-{c.name}" if prefix else None,
            prefix_tokens=prefix,
            first_token_patience=first,
            total_patience=total,
            stream=c.stream_share >= 1.0 or rng.random() < c.stream_share,
        )


def _patience_sampler(p: Patience, rng: random.Random) -> Callable[[], tuple[float | None, float | None]]:
    """Draws (first-token patience, total patience) per request; None: waits forever."""

    def draw(mean: float | None) -> float | None:
        if mean is None:
            return None
        return rng.expovariate(1.0 / mean) if p.distribution == "exponential" else mean

    return lambda: (draw(p.first_token_s), draw(p.total_s))


def output_sampler(klass: RequestClass = REASONING, seed: int = 0) -> Callable[[], int]:
    """Output lengths of one class, for servers that get no ``output_tokens`` hint."""
    return klass.output.sampler(random.Random(seed))


# ---------------------------------------------------------------------------------------------
# Trace replay
# ---------------------------------------------------------------------------------------------

TRACE_FORMATS = (
    "Azure LLM inference CSV with columns TIMESTAMP,ContextTokens,GeneratedTokens",
    "BurstGPT CSV with columns Timestamp,...,Request tokens,Response tokens,...",
    "Mooncake JSONL with keys timestamp (ms), input_length, output_length",
)


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file, line and what to fix."""


@dataclass(frozen=True, slots=True)
class Trace:
    format: str  # azure | burstgpt | mooncake
    requests: tuple[WorkloadRequest, ...]
    skipped: int  # rows without output tokens (BurstGPT failures)


def load_trace(
    path: str | Path,
    *,
    max_tokens: int | None = None,
    time_scale: float = 1.0,
    patience: Patience | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> Trace:
    """Read a trace; arrivals are seconds from its first request times ``time_scale``. ``max_tokens``
    None sends each request with its recorded output length as the budget (as ``vllm bench`` does
    for ShareGPT), so a replayed request finishes with ``stop`` at that length."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if not first:
        raise TraceError(f"trace {path} is empty; expected one of: {'; '.join(TRACE_FORMATS)}")
    if first.lstrip().startswith("{"):
        fmt, rows = "mooncake", _mooncake_rows(path, text)
    else:
        fmt, rows = _csv_rows(path, text)
    rows.sort(key=lambda r: r[0])
    rng = random.Random(seed)
    draw = _patience_sampler(patience or Patience(first_token_s=None), rng)
    out: list[WorkloadRequest] = []
    skipped = 0
    t0 = rows[0][0] if rows else 0.0
    for ts, prompt, output in rows:
        if output < 1 or prompt < 1:
            skipped += 1
            continue
        if limit is not None and len(out) >= limit:
            break
        first_p, total_p = draw()
        out.append(
            WorkloadRequest(
                request_id=f"{fmt}-{len(out)}",
                arrival=(ts - t0) * time_scale,
                prompt_tokens=prompt,
                output_tokens=output,
                max_tokens=output if max_tokens is None else max_tokens,
                klass=fmt,
                first_token_patience=first_p,
                total_patience=total_p,
            )
        )
    return Trace(fmt, tuple(out), skipped)


def _int(path: Path, line: int, column: str, value: object) -> int:
    if isinstance(value, str | int | float):
        try:
            return int(float(value))
        except (ValueError, OverflowError):  # not a number, or inf
            pass
    raise TraceError(f"{path} line {line}: {column!r} is not a number: {value!r}")


def _finite(value: object) -> float | None:
    """A time as a finite float; None for text, NaN or infinity (an arrival at NaN never comes)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    try:
        number = float(value)
    except (ValueError, OverflowError):  # OverflowError: an int too large for a float
        return None
    return number if math.isfinite(number) else None


def _csv_rows(path: Path, text: str) -> tuple[str, list[tuple[float, int, int]]]:
    reader = csv.DictReader(text.splitlines())
    header = {(h or "").strip() for h in (reader.fieldnames or [])}
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= header:
        fmt, cols = "azure", ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    elif {"Timestamp", "Request tokens", "Response tokens"} <= header:
        fmt, cols = "burstgpt", ("Timestamp", "Request tokens", "Response tokens")
    else:
        raise TraceError(
            f"{path}: unrecognised trace header {sorted(header)}; expected one of: {'; '.join(TRACE_FORMATS)}"
        )
    ts_col, in_col, out_col = cols
    rows = []
    for line, raw in enumerate(reader, start=2):
        row = {(k or "").strip(): v for k, v in raw.items()}
        stamp = (row.get(ts_col) or "").strip()
        ts: float | None
        if fmt == "azure":
            try:
                ts = datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp()  # naive: no DST jumps
            except ValueError:
                raise TraceError(
                    f"{path} line {line}: TIMESTAMP {stamp!r} is not a date-time "
                    "like 2023-11-16 18:15:46.6805900"
                ) from None
        else:
            ts = _finite(stamp)
        if ts is None:
            raise TraceError(f"{path} line {line}: Timestamp {stamp!r} is not a number of seconds")
        rows.append(
            (ts, _int(path, line, in_col, row.get(in_col)), _int(path, line, out_col, row.get(out_col)))
        )
    return fmt, rows


def _mooncake_rows(path: Path, text: str) -> list[tuple[float, int, int]]:
    rows = []
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = loads(raw)
        except ValueError as exc:
            raise TraceError(f"{path} line {line}: not JSON ({exc}); expected {TRACE_FORMATS[2]}") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{path} line {line}: not a JSON object; expected {TRACE_FORMATS[2]}")
        missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
        if missing:
            raise TraceError(f"{path} line {line}: missing {missing}; expected {TRACE_FORMATS[2]}")
        ms = _finite(obj["timestamp"])
        if ms is None:
            raise TraceError(f"{path} line {line}: timestamp {obj['timestamp']!r} is not milliseconds")
        ts = ms / 1000.0
        rows.append(
            (
                ts,
                _int(path, line, "input_length", obj["input_length"]),
                _int(path, line, "output_length", obj["output_length"]),
            )
        )
    return rows
