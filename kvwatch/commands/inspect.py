"""``kvwatch inspect SOURCE``: what kvwatch reads from one engine metrics page."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily: `kvwatch --help` stays fast
    from kvwatch.engines.registry import ParseResult
    from kvwatch.model import ReplicaSample, SlotSample

    #: llama.cpp's /slots: the slots, why they could not be read, or None (no llama.cpp page)
    Slots = tuple[SlotSample, ...] | str | None

HELP = "show what kvwatch reads from an engine's /metrics (URL, file or -)"
DESCRIPTION = """\
Fetch (or read) one engine metrics page and print, per replica (model and data-parallel rank), what
kvwatch understood: backend and version hint, model, dp_rank, KV capacity in tokens, occupancy,
running/waiting requests, preemptions, KV tier traffic, and the fields this engine does not expose.
Use it to check a new target before adding it to the config, or to see why a panel is empty.

SOURCE is an http(s) URL (e.g. http://127.0.0.1:8000/metrics), a file holding a saved page, or -
for stdin. For a llama.cpp page, /slots is fetched too (the only KV source of recent builds): beside
a SOURCE URL, or from --slots-url (which a saved page needs).

Examples:
  kvwatch inspect http://127.0.0.1:8000/metrics
  kvwatch inspect --backend sglang --json saved-page.prom
  curl -s http://127.0.0.1:30000/metrics | kvwatch inspect -

Exit status 0 when the page was read, 1 on a fetch or parse error (the message says what failed)."""

BACKEND_CHOICES = ("auto", "vllm", "sglang", "trtllm", "dynamo", "llamacpp", "tgi")
REPLICA = "inspect"


MAX_TIMEOUT_S = 3600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SOURCE", help="metrics URL, file path, or - for stdin")
    parser.add_argument(
        "--backend",
        choices=BACKEND_CHOICES,
        default="auto",
        help="engine adapter to use (default: detect from the page)",
    )
    parser.add_argument("--json", action="store_true", help="print one machine-readable JSON document")
    parser.add_argument(
        "--timeout", type=float, default=10.0, metavar="S", help="seconds to wait for a URL (default 10)"
    )
    parser.add_argument(
        "--slots-url",
        metavar="URL",
        help="llama.cpp /slots URL (default: beside a SOURCE URL; none for a file or stdin)",
    )


def _is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


async def _fetch(url: str, timeout_s: float) -> str:
    import httpx

    from kvwatch.config import ScrapeConfig
    from kvwatch.engines.fetch import fetch_metrics

    async with httpx.AsyncClient() as client:
        return await fetch_metrics(
            client, url, replica="", timeout_s=timeout_s, max_bytes=ScrapeConfig().max_response_bytes
        )


async def _fetch_slots(url: str, timeout_s: float) -> Slots:
    """llama.cpp's ``/slots``, or why it could not be read (the page is still shown)."""
    import httpx

    from kvwatch.config import ScrapeConfig
    from kvwatch.engines import llamacpp
    from kvwatch.engines.fetch import ACCEPT_JSON, ScrapeError, fetch_body

    limit = ScrapeConfig().max_response_bytes
    async with httpx.AsyncClient() as client:
        try:
            body, _ = await fetch_body(
                client, url, replica="", timeout_s=timeout_s, max_bytes=limit, accept=ACCEPT_JSON
            )
            return llamacpp.parse_slots(body)
        except (ScrapeError, llamacpp.SlotsError) as exc:
            return f"{url}: {exc}"


def _slots_url(args: argparse.Namespace, text: str) -> str | None:
    """Where a llama.cpp page's ``/slots`` is: ``--slots-url``, else beside a SOURCE URL."""
    from kvwatch.engines import llamacpp

    if args.backend not in ("auto", "llamacpp") or "llamacpp:" not in text:
        return None
    if _is_url(args.source):
        return llamacpp.EXTRA_PAGE.url(args.source, args.slots_url)
    return args.slots_url


def _read(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    return Path(source).read_text(encoding="utf-8")


def _replica_doc(sample: ReplicaSample) -> dict[str, object]:
    from kvwatch.engines.base import missing_fields

    doc = {
        f.name: getattr(sample, f.name)
        for f in dataclasses.fields(sample)
        if f.name not in ("tier_traffic", "histograms", "finished_requests_total")
    }
    doc["finished_requests_total"] = dict(sample.finished_requests_total)
    doc["tier_traffic"] = [dataclasses.asdict(t) for t in sample.tier_traffic]
    doc["histograms"] = {
        name: {
            "count": h.count,
            "sum": h.sum,
            "buckets": list(zip(h.bounds, h.cumulative_counts, strict=True)),
        }
        for name, h in sample.histograms
    }
    doc["missing"] = missing_fields(sample)
    return doc


def _num(value: float | None, fmt: str = "{:g}") -> str:
    return "-" if value is None else fmt.format(value)


def _print_text(source: str, result: ParseResult, slots: Slots) -> None:
    from kvwatch.engines.base import missing_fields

    print(f"source   {source}")
    print(f"backend  {result.backend}")
    for note in result.notes:
        print(f"note     {note}")
    if isinstance(slots, str):
        print(f"slots    unavailable: {slots}")
    elif slots is not None:
        print(
            f"slots    {len(slots)}: "
            + ", ".join(
                f"#{s.slot_id} {'busy' if s.is_processing else 'idle'} "
                f"{_num(s.tokens_in_use)}/{_num(s.n_ctx)}"
                for s in slots
            )
        )
    for i, s in enumerate(result.samples, 1):
        print()
        print(
            f"[{i}] model {s.model_name or '-'}  dp_rank {s.dp_rank or '-'}  ({s.version_hint or 'no hint'})"
        )
        blocks = f" ({s.num_gpu_blocks} blocks x {s.block_size})" if s.num_gpu_blocks and s.block_size else ""
        print(f"    KV capacity   {_num(s.kv_capacity_tokens)} tokens{blocks}, dtype {s.cache_dtype or '-'}")
        print(
            f"    occupancy     {_num(s.kv_usage_ratio, '{:.1%}')}; used blocks {_num(s.kv_used_blocks)}, "
            f"used tokens {_num(s.kv_used_tokens)}, evictable {_num(s.kv_evictable_tokens)}, "
            f"live {_num(s.live_tokens)}"
        )
        print(
            f"    requests      running {_num(s.requests_running)}, waiting {_num(s.requests_waiting)}, "
            f"paused/swapped {_num(s.requests_swapped_or_paused)}"
        )
        print(
            f"    preemptions   {_num(s.preemptions_total)} "
            f"(recomputed tokens {_num(s.recomputed_tokens_total)})"
        )
        print(
            f"    tokens        prompt {_num(s.prompt_tokens_total)}, "
            f"generation {_num(s.generation_tokens_total)}, "
            f"prefix cache {_num(s.prefix_cache_hits_total)} hit of {_num(s.prefix_cache_queries_total)}"
        )
        for t in s.tier_traffic:
            amounts = ", ".join(
                f"{_num(v)} {unit}"
                for unit, v in (
                    ("bytes", t.bytes_total),
                    ("tokens", t.tokens_total),
                    ("blocks", t.blocks_total),
                    ("s", t.seconds_total),
                )
                if v is not None
            )
            print(f"    tier          {t.family}: {t.src_tier} -> {t.dst_tier}: {amounts}")
        if s.histograms:
            print("    histograms    " + ", ".join(f"{name} (n={h.count:g})" for name, h in s.histograms))
        missing = missing_fields(s)
        print(f"    missing       {', '.join(missing) if missing else 'none'}")


def _unreadable(source: str, exc: Exception) -> str:
    """Why ``source`` gave no samples, in the words the operator can act on."""
    from kvwatch.engines.exposition_parser import ExpositionError
    from kvwatch.engines.fetch import ScrapeError

    if isinstance(exc, ScrapeError):
        return f"fetch failed ({exc.reason}): {exc.message}"
    if isinstance(exc, OSError):
        return f"cannot read {source}: {exc.strerror or exc}"
    if isinstance(exc, UnicodeDecodeError):
        return f"{source} is not UTF-8 text ({exc.reason})"
    if isinstance(exc, ExpositionError):
        return f"{source} is not valid Prometheus text: {exc}"
    return f"no engine metrics in {source}: {exc}"  # NoEngineMetricsError


def main(args: argparse.Namespace) -> int:
    from kvwatch.engines import llamacpp
    from kvwatch.engines.exposition_parser import ExpositionError
    from kvwatch.engines.fetch import ScrapeError
    from kvwatch.engines.registry import NoEngineMetricsError, parse_exposition
    from kvwatch.jsonsafe import jsonable

    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN too: "deadline must not be NaN" from deep inside
        print(
            f"kvwatch inspect: --timeout must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:g}, "
            f"got {args.timeout:g}",
            file=sys.stderr,
        )
        return 2
    slots: Slots = None
    try:
        text = asyncio.run(_fetch(args.source, args.timeout)) if _is_url(args.source) else _read(args.source)
        slots_url = _slots_url(args, text)
        if slots_url is not None:
            slots = asyncio.run(_fetch_slots(slots_url, args.timeout))
        result = parse_exposition(text, REPLICA, args.backend)
    except (ScrapeError, OSError, UnicodeDecodeError, ExpositionError, NoEngineMetricsError) as exc:
        print(f"kvwatch inspect: {_unreadable(args.source, exc)}", file=sys.stderr)
        return 1
    samples = result.samples
    if isinstance(slots, tuple):
        samples = tuple(llamacpp.apply_slots(s, slots) for s in samples)
        result = dataclasses.replace(result, samples=samples)
    if args.json:
        doc = {
            "source": args.source,
            "backend": result.backend,
            "notes": list(result.notes),
            "replicas": [_replica_doc(s) for s in samples],
            "slots": ([dataclasses.asdict(s) for s in slots] if isinstance(slots, tuple) else None),
            "slots_error": slots if isinstance(slots, str) else None,
        }
        print(json.dumps(jsonable(doc), indent=2))
    else:
        _print_text(args.source, result, slots)
    return 0
