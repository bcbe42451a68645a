"""Where calibration data comes from, in order of preference, each turned into step observations.

1. **Step samples** from the vLLM stat-logger plugin (``plugins/vllm``): its ``EngineStep`` records
   (``observations_from_engine_steps``), a JSON-lines capture of its datagrams
   (``read_plugin_datagrams``), or plain records, one per engine step,
   ``(context_tokens, generation_tokens, num_context_reqs, num_generation_reqs, elapsed_ms)``.
   ``context_tokens`` are the prefill tokens the step computed, ``num_generation_reqs`` the decoding
   sequences. Read from a JSON-lines file (one object with those keys, or a 5-element list, per line)
   or passed in as tuples (``observations_from_step_samples``). An optional ``tp`` key is the
   tensor-parallel degree of the engine that ran the step (``plan calibrate`` fits each degree apart).
2. **The engine's own histograms in Prometheus** (``prometheus.py``).
3. **A calibration load** the command drives itself against the engine's OpenAI API
   (``calibration_load``): prefill-only requests of several prompt sizes, then decode phases at
   several concurrencies. TTFT of a lone request is one prefill step (plus the frontend's own
   latency, left in its residual: the decode phases, which outweigh the prefills, set the
   overhead). While all ``c`` streams of a phase decode, each stream's time over the tokens it
   gained is the step with ``c`` sequences (``decode_observations``). Spans over tokens, not chunk
   gaps: the streams ask for ``continuous_usage_stats``, since vLLM folds several tokens into one
   chunk when its frontend falls behind, and a client that was descheduled reads a burst of chunks
   microseconds apart, so a median chunk gap measured the burst, not the step. Each decode
   observation weighs the steps it stands for, each prefill one step, so a few long prefills
   cannot outweigh hundreds of decode steps and push the per-step overhead to 0. Phases with long
   prompts (``long_context``, sized to fit a small cache) vary the KV tokens the batch reads, so
   ``per_kv_token_s`` is fitted.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvwatch.config import quoted
from kvwatch.jsonsafe import finite, loads
from kvwatch.model import MAX_COUNT, EngineStep
from kvwatch.plan.calibration import EngineShape
from kvwatch.plan.fit import StepObservation
from kvwatch.plan.jsonl import json_lines

STEP_SAMPLE_KEYS = (
    "context_tokens",
    "generation_tokens",
    "num_context_reqs",
    "num_generation_reqs",
    "elapsed_ms",
)


class SourceError(ValueError):
    """Calibration data that cannot be read; the message names the file, line or URL."""


def observations_from_step_samples(samples: Iterable[Sequence[float]]) -> list[StepObservation]:
    """The plugin's per-step records (module doc) as observations; KV tokens are not in them. A sixth
    element, where present, is the engine's TP degree."""
    out = []
    for row in samples:
        ctx_tokens, _gen_tokens, _n_ctx, n_gen, elapsed_ms = row[:5]
        tp = int(row[5]) if len(row) > 5 else None
        out.append(
            StepObservation(
                prefill_tokens=float(ctx_tokens),
                decode_seqs=float(n_gen),
                seconds=float(elapsed_ms) / 1000.0,
                tp=tp,
            )
        )
    return out


def read_step_samples(path: str | Path) -> list[tuple[float, ...]]:
    """A JSON-lines file of step samples; SourceError names the line and key that is wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SourceError(f"cannot read step samples {path}: {exc.strerror or exc}") from None
    rows = []
    for where, parsed in json_lines(text.splitlines(), path, SourceError):
        obj = parsed
        if isinstance(parsed, list):
            if len(parsed) != len(STEP_SAMPLE_KEYS):
                raise SourceError(
                    f"{where}: a list needs {len(STEP_SAMPLE_KEYS)} numbers ({', '.join(STEP_SAMPLE_KEYS)})"
                )
            obj = dict(zip(STEP_SAMPLE_KEYS, parsed, strict=True))
        if not isinstance(obj, dict):
            raise SourceError(f"{where}: expected an object with {', '.join(STEP_SAMPLE_KEYS)}")
        values = []
        for key in STEP_SAMPLE_KEYS:
            value = obj.get(key)
            if value is None:
                raise SourceError(f"{where}: missing {key!r}")
            number = finite(value)  # NaN, infinity and 1 followed by 400 zeros are no sample
            if number is None or number < 0:
                raise SourceError(f"{where}: {key!r} is {quoted(value)}, expected a number >= 0")
            values.append(number)
        tp = obj.get("tp")
        if tp is not None:
            if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_COUNT:
                raise SourceError(
                    f"{where}: 'tp' is {quoted(tp)}, expected the engine's TP degree (an integer >= 1)"
                )
            values.append(float(tp))
        rows.append(tuple(values))
    if not rows:
        raise SourceError(f"{path}: no step samples")
    return rows


def observations_from_engine_steps(
    steps: Iterable[EngineStep], capacity_tokens: int | None = None
) -> list[StepObservation]:
    """The vLLM plugin's ``EngineStep`` records (``kvwatch/requests/vllm_plugin.py``) as observations.

    Only steps carrying the batch shape and ``elapsed_ms`` count (vLLM sends them with
    ``--enable-logging-iteration-details``). With the pool's ``capacity_tokens`` (the calibration's
    engine shape) the step's KV usage gives the KV tokens held, so ``per_kv_token_s`` is fitted too.
    """
    out = []
    for st in steps:
        if st.elapsed_ms is None or st.ctx_tokens is None or st.gen_requests is None:
            continue
        kv = (
            None
            if st.kv_usage_ratio is None or capacity_tokens is None
            else st.kv_usage_ratio * capacity_tokens
        )
        out.append(
            StepObservation(
                prefill_tokens=float(st.ctx_tokens),
                decode_seqs=float(st.gen_requests),
                seconds=st.elapsed_ms / 1000.0,
                kv_tokens=kv,
            )
        )
    return out


def read_plugin_datagrams(path: str | Path, capacity_tokens: int | None = None) -> list[StepObservation]:
    """A JSON-lines capture of the plugin's datagrams (wire format v1: a list of steps under ``"s"``),
    decoded by the agent's own decoder; SourceError names the line that is wrong."""
    from kvwatch.requests.vllm_plugin import DatagramError, decode

    steps: list[EngineStep] = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            steps.extend(decode(line.encode("utf-8"), "calibration", "").steps)
        except DatagramError as exc:
            raise SourceError(f"{path} line {number}: not a plugin datagram ({exc})") from None
    obs = observations_from_engine_steps(steps, capacity_tokens)
    if not obs:
        raise SourceError(
            f"{path}: no datagram carries a step's batch shape and elapsed_ms (start vLLM "
            "with --enable-logging-iteration-details)"
        )
    return obs


def is_datagram_file(path: str | Path) -> bool:
    try:
        with Path(path).open(encoding="utf-8") as fh:
            first = next((ln for ln in fh if ln.strip()), "")
        obj = loads(first)
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and "s" in obj and "v" in obj


# ---------------------------------------------------------------------------------------------
# the engine itself: its shape, and a calibration load
# ---------------------------------------------------------------------------------------------


def engine_shape(
    base_url: str,
    *,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    timeout_s: float = 10.0,
) -> EngineShape:
    """Block size and KV blocks from the engine's ``/metrics`` (vLLM ``cache_config_info``, read by
    kvwatch's own adapter), served name and ``max_model_len`` from ``/v1/models``. The scheduler
    limits are not exported by vLLM: they are what the caller says (its ``vllm serve`` flags)."""
    from kvwatch.engines.registry import parse_exposition

    try:
        page = httpx.get(f"{base_url}/metrics", timeout=timeout_s)
        models = httpx.get(f"{base_url}/v1/models", timeout=timeout_s)
        page.raise_for_status()
        models.raise_for_status()
    except httpx.HTTPError as exc:
        raise SourceError(f"{base_url}: cannot read /metrics and /v1/models: {exc}") from None
    sample = parse_exposition(page.text, "calibration").samples[0]
    try:
        entry = loads(models.content)["data"][0]
        if not isinstance(entry, dict):
            raise TypeError
    except (ValueError, KeyError, IndexError, TypeError):
        raise SourceError(f"{base_url}/v1/models: not a list of models as OpenAI's API has it") from None
    return EngineShape(
        model_name=str(entry.get("id")),
        block_size=sample.block_size,
        num_gpu_blocks=sample.num_gpu_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=entry.get("max_model_len"),
    )


@dataclass(frozen=True, slots=True)
class StreamRead:
    """One streamed calibration request as the client read it: when it was sent, when each chunk
    with a token came (``time.perf_counter``), the engine's count of output tokens at each chunk
    where it said, and the usage it reported at the end."""

    sent: float
    chunks: tuple[float, ...]
    generated: tuple[int | None, ...]
    usage: Mapping[str, Any]


#: what ``decode_phase`` leaves for a request that failed
NOT_READ = StreamRead(0.0, (), (), {})


def _stream(client: httpx.Client, base_url: str, model: str, prompt: str, max_tokens: int) -> StreamRead:
    """One streamed completion: chunk arrival times and the usage the engine reported."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    sent = time.perf_counter()
    chunks: list[float] = []
    generated: list[int | None] = []  # the engine's count of output tokens at each chunk, if it says
    usage: dict[str, Any] = {}
    with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SourceError(
                f"{base_url}: calibration request refused ({response.status_code}): {response.read()[:300]!r}"
            )
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                obj = loads(line[6:])
            except ValueError as exc:
                raise SourceError(f"{base_url}: a calibration stream event is not JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise SourceError(f"{base_url}: a calibration stream event is not a JSON object")
            has_usage = isinstance(obj.get("usage"), dict)
            if obj.get("choices"):  # a token (its text may be empty: a partial UTF-8 sequence)
                chunks.append(time.perf_counter())
                generated.append(_count(obj["usage"].get("completion_tokens")) if has_usage else None)
            if has_usage:
                usage = obj["usage"]
    return StreamRead(sent, tuple(chunks), tuple(generated), usage)


def _count(value: Any) -> int | None:
    """A token count the engine reported: an integer within ``MAX_COUNT``, else None."""
    number = finite(value)
    return int(number) if number is not None and 0 <= number <= MAX_COUNT else None


def _prompt_tokens(result: StreamRead, default: float) -> float:
    """The prompt tokens the engine reported for one calibration request, else ``default``."""
    reported = _count(result.usage.get("prompt_tokens"))
    return float(reported) if reported else default


#: the calibration load's decode phases: streams at a short prompt, and (streams, prompt tokens)
CONCURRENCIES = (1, 2, 3, 4, 6, 8)
LONG_CONTEXT = ((1, 1024), (2, 1024), (4, 400))
DECODE_PHASES = len(CONCURRENCIES) + len(LONG_CONTEXT)


def calibration_load(
    base_url: str,
    model: str,
    *,
    prompt_sizes: Sequence[int] = (16, 256, 768, 1536),
    concurrencies: Sequence[int] = CONCURRENCIES,
    decode_prompt: int = 64,
    long_context: Sequence[tuple[int, int]] = LONG_CONTEXT,
    decode_tokens: int = 96,
    repeats: int = 2,
    attempts: int = 3,
    timeout_s: float = 120.0,
) -> list[StepObservation]:
    """Drive the engine (module doc) and return one observation per phase measurement. A decode
    phase that gives nothing (its streams did not decode together, or a burst swallowed the
    window) runs again, up to ``attempts`` times: a frontend starved for a moment spoils one run,
    and a fit short of decode phases extrapolates the cost per sequence from one or two."""
    obs: list[StepObservation] = []
    with httpx.Client(timeout=timeout_s) as client:
        probe = _stream(client, base_url, model, _filler(64), 1)
        per_word = _prompt_tokens(probe, 64) / 64
        words = lambda tokens: max(1, int(tokens / per_word))  # noqa: E731 - the engine's tokenizer
        for size in prompt_sizes:
            for _ in range(repeats):
                r = _stream(client, base_url, model, _filler(words(size)), 2)
                if not r.chunks:
                    raise SourceError(f"{base_url}: a calibration request streamed no token")
                prompt = _prompt_tokens(r, size)
                obs.append(
                    StepObservation(
                        prefill_tokens=prompt,
                        decode_seqs=0.0,
                        kv_tokens=prompt,
                        seconds=r.chunks[0] - r.sent,
                    )
                )
        for c, context in [(c, decode_prompt) for c in concurrencies] + list(long_context):
            for _ in range(attempts):
                prompts = filler_prompts(words(context), c)
                seen = decode_observations(
                    decode_phase(base_url, model, c, prompts, decode_tokens, timeout_s)
                )
                obs += seen
                if seen:
                    break
    return obs


def filler_prompts(words: int, count: int) -> list[str]:
    """``count`` prompts of ``words`` filler words each, no two sharing a prefix (``_filler``)."""
    return [_filler(words) for _ in range(count)]


def decode_phase(
    base_url: str, model: str, c: int, prompts: list[str], tokens: int, timeout_s: float
) -> list[StreamRead]:
    """``c`` streams started together (clients made first, then a barrier), as ``_stream`` read
    them (``NOT_READ`` for a request that failed)."""
    clients = [httpx.Client(timeout=timeout_s) for _ in range(c)]
    results = [NOT_READ] * c
    barrier = threading.Barrier(c)

    def run(k: int) -> None:
        barrier.wait(timeout_s)
        results[k] = _stream(clients[k], base_url, model, prompts[k], tokens)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(c)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
    finally:
        for client in clients:
            client.close()
    return results


def decode_observations(streams: Sequence[StreamRead], min_steps: float = 8.0) -> list[StepObservation]:
    """The step with all of a phase's streams decoding (module doc), or nothing where they did not
    decode together for ``min_steps`` steps.

    The window runs from the last stream's first chunk to the first stream's last. In it, each
    stream gives its time over the tokens it gained, from its first chunk there to its last: only
    the span counts, so chunks read in a burst (the client descheduled, tokens folded into one
    chunk) cost nothing, where a median gap between chunks measured the burst. But a burst that
    swallows the window's start shrinks the span too: a starved frontend sent a lone stream's 96
    tokens within 1 ms, and a late stream's first chunk can be read in another's burst. So a window
    that steps at under half of ``_upper_step`` (0.67-0.91 of it in phases that were not bursts) is
    dropped."""
    lines = [_token_line(s) for s in streams]
    if not lines or any(len(line) < 2 for line in lines):
        return []
    start = max(line[0][0] for line in lines)
    end = min(line[-1][0] for line in lines)
    seconds = tokens = kv_token_tokens = 0.0
    for line, stream in zip(lines, streams, strict=True):
        window = [point for point in line if start <= point[0] <= end]
        if len(window) < 2 or window[-1][1] <= window[0][1]:
            continue
        (t1, n1), (t2, n2) = window[0], window[-1]
        seconds += t2 - t1
        tokens += n2 - n1
        kv_token_tokens += (n2 - n1) * (_prompt_tokens(stream, 0.0) + (n1 + n2) / 2)
    c = len(lines)
    if tokens / c < min_steps or seconds / tokens < _upper_step(streams, lines) / 2:
        return []
    return [
        StepObservation(
            prefill_tokens=0.0,
            decode_seqs=float(c),
            kv_tokens=c * kv_token_tokens / tokens,
            seconds=seconds / tokens,
            weight=tokens / c,
        )
    ]


def _upper_step(streams: Sequence[StreamRead], lines: list[list[tuple[float, int]]]) -> float:
    """Seconds per token from each request's sending to its last chunk: more than the step (it
    holds the prefill and any wait), but a burst cannot shrink it."""
    elapsed = sum(line[-1][0] - stream.sent for line, stream in zip(lines, streams, strict=True))
    return elapsed / max(1, sum(line[-1][1] for line in lines))


def _token_line(stream: StreamRead) -> list[tuple[float, int]]:
    """(time, output tokens so far) at each of a stream's chunks: the engine's count where every
    chunk carried one, else one token a chunk."""
    counts = [n for n in stream.generated if n is not None]
    if len(counts) == len(stream.chunks):
        return list(zip(stream.chunks, counts, strict=True))
    return [(t, n) for n, t in enumerate(stream.chunks, start=1)]


_FILLER_RNG = random.Random(16)


def _filler(words: int) -> str:
    """``words`` random words of filler: no two prompts share a prefix, so the engine's prefix cache
    cannot skip the prefill being measured. The engine's usage gives the exact token count."""
    return " ".join(str(_FILLER_RNG.randrange(10**5)) for _ in range(max(1, words)))
