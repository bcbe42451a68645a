"""``kvwatch plan calibrate | replay | compare | export``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the subcommands import lazily: `kvwatch --help` stays fast
    from kvwatch.model import LengthBands
    from kvwatch.plan.replay import ReplayResult

HELP = "capacity planning: calibrate the simulator on a node, replay its ledger on candidate configs"
DESCRIPTION = """\
Plan capacity from the node's own traffic (docs/planning.md):

  kvwatch plan calibrate --step-samples steps.jsonl -o calibration.yaml
  kvwatch plan calibrate --prometheus http://127.0.0.1:9090 --since 1h -o calibration.yaml
  kvwatch plan calibrate --load http://127.0.0.1:8000 --max-num-seqs 8 -o calibration.yaml
  kvwatch plan replay LEDGER_OR_TRACE [--calibration calibration.yaml] [--candidate c.yaml] [--html out.html]
  kvwatch plan compare LEDGER --slo alerts/slo.yaml --gpus 8 [--html out.html]
  kvwatch plan replay | kvwatch plan compare   (no trace: the demo's default workload and node)
  kvwatch plan export LEDGER -o trace.jsonl   (Mooncake JSONL: timestamp, input_length, output_length)

`kvwatch plan replay TRACE` with neither --calibration nor --candidate replays on the demo's
default node (8x H200, Qwen3-32B as 8 data-parallel replicas), uncalibrated, and says so. With no
LEDGER_OR_TRACE at all, replay and compare use the demo's default workload (its first simulated hour:
reasoning requests at 1/s with a 1.5x burst), so one command shows a plan.

Exit status 0 on success, 1 when an input cannot be used (the message names the file, line or key)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plan_command", metavar="SUBCOMMAND")
    cal = sub.add_parser(
        "calibrate",
        help="fit the simulator's step-time model on an engine",
        description="Fit step = overhead + prefill tokens x a + decode sequences x b + "
        "KV tokens x c; write a calibration YAML with the fit's quality.",
    )
    src = cal.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--step-samples",
        metavar="FILE",
        help="JSON lines of the vLLM plugin's step samples (context_tokens, generation_tokens, "
        "num_context_reqs, num_generation_reqs, elapsed_ms)",
    )
    src.add_argument("--prometheus", metavar="URL", help="read vLLM's histograms from this Prometheus")
    src.add_argument(
        "--load", metavar="ENGINE_URL", help="drive a short calibration load against this engine"
    )
    cal.add_argument(
        "--engine-url",
        metavar="URL",
        help="the engine whose shape (KV blocks, block size, max_model_len) to record "
        "(default: the --load URL)",
    )
    cal.add_argument(
        "--since", default="1h", metavar="DURATION", help="--prometheus: how far back to read (default 1h)"
    )
    cal.add_argument(
        "--until", metavar="UNIX", type=float, help="--prometheus: end of the range (default now)"
    )
    cal.add_argument(
        "--window",
        default="30s",
        metavar="DURATION",
        help="--prometheus: rate window of each observation (default 30s)",
    )
    cal.add_argument(
        "--selector",
        default="",
        metavar="LABELS",
        help='--prometheus: label matchers, e.g. instance="node1:8000"',
    )
    cal.add_argument(
        "--tp",
        type=int,
        metavar="N",
        help="the engine's --tensor-parallel-size, for data that does not say (default: unknown, taken "
        "as 1); step-sample lines with a 'tp' key and --tp-label series keep their own",
    )
    cal.add_argument(
        "--tp-label",
        metavar="LABEL",
        help="--prometheus: a label whose value is each series' TP degree (e.g. a target label set in "
        "the scrape config); one fit per degree",
    )
    cal.add_argument("--max-num-seqs", type=int, metavar="N", help="the engine's --max-num-seqs (recorded)")
    cal.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        help="the engine's --max-num-batched-tokens (recorded)",
    )
    cal.add_argument("-o", "--output", required=True, metavar="FILE", help="calibration YAML to write")
    cal.set_defaults(_plan=_calibrate)

    rep = sub.add_parser("replay", help="replay a ledger or trace on a twin, next to the recorded figures")
    rep.add_argument("inputs", nargs="*", metavar="LEDGER_OR_TRACE", help=_NO_TRACE)
    _twin_arguments(rep)
    rep.add_argument("--html", metavar="OUT", help="write the replay as HTML")
    rep.set_defaults(_plan=_replay)

    cmp_ = sub.add_parser("compare", help="sweep candidate configurations against per-band SLOs")
    cmp_.add_argument("inputs", nargs="*", metavar="LEDGER_OR_TRACE", help=_NO_TRACE)
    cmp_.add_argument(
        "--slo",
        default="alerts/slo.yaml",
        metavar="FILE",
        help="SLO file (default alerts/slo.yaml, as kvwatch rules)",
    )
    cmp_.add_argument(
        "--gpus",
        default=8,
        type=int,
        metavar="N",
        help="the most GPUs a candidate may use (default 8: the demo's node)",
    )
    cmp_.add_argument("--model", default=None, metavar="PRESET", help="model preset (default: the demo's)")
    cmp_.add_argument(
        "--grid",
        default="standard",
        choices=("standard", "small"),
        help="candidate grid (small: TP x DP x GPU type only)",
    )
    cmp_.add_argument(
        "--jobs", type=int, default=None, metavar="N", help="parallel processes (default: CPUs)"
    )
    cmp_.add_argument("--top", type=int, default=5, metavar="N", help="candidates to print")
    cmp_.add_argument("--limit", type=int, metavar="N", help=_LIMIT)
    cmp_.add_argument("--calibration", metavar="FILE", help="calibration for step_model: calibrated")
    cmp_.add_argument(
        "--calibrated-on",
        choices=("h100", "h200", "b200"),
        metavar="GPU",
        help="the GPU type the calibration was measured on: with a preset --model, those candidates "
        "are timed by the fit of their layout where the calibration observed it, else by the roofline; "
        "with --model calibrated, the one type swept (default h200)",
    )
    cmp_.add_argument(
        "--price",
        metavar="TYPE=PRICE,...",
        help="price per GPU-hour by type, e.g. h100=2.5,h200=3.5,b200=6 (default 1 each)",
    )
    cmp_.add_argument("--html", metavar="OUT", help="write the comparison as HTML (attainment vs GPUs)")
    cmp_.set_defaults(_plan=_compare)

    exp = sub.add_parser("export", help="write a ledger as a Mooncake-style JSONL trace (no text)")
    exp.add_argument("inputs", nargs="+", metavar="LEDGER")
    exp.add_argument("-o", "--output", required=True, metavar="FILE")
    exp.set_defaults(_plan=_export)


_LIMIT = "replay only the first N requests by arrival (N >= 1), at their recorded arrival rate"
_NO_TRACE = "ledger files or one trace (none: the demo's default workload, its first simulated hour)"


def _twin_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--calibration",
        metavar="FILE",
        help="calibration YAML; alone, the twin is the engine it was measured on",
    )
    p.add_argument("--candidate", metavar="FILE", help="candidate YAML (keys: docs/planning.md)")
    p.add_argument("--bands", metavar="EDGES", help="band edges (default: the ledger's, else 1k,5k,10k,20k)")
    p.add_argument("--limit", type=int, metavar="N", help=_LIMIT)
    p.add_argument(
        "--sample-every",
        type=float,
        metavar="SECONDS",
        help="KV sampling interval in simulated seconds (default: span / 2000, 0.25-60 s)",
    )


def main(args: argparse.Namespace) -> int:
    handler = getattr(args, "_plan", None)
    if handler is None:
        print(
            "kvwatch plan: name a subcommand: calibrate, replay, compare, export (see --help)",
            file=sys.stderr,
        )
        return 2
    from kvwatch.plan.errors import PLAN_ERRORS

    try:
        return handler(args)
    except PLAN_ERRORS as exc:
        print(f"kvwatch plan {args.plan_command}: {exc}", file=sys.stderr)
        return 1


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _calibrate(args: argparse.Namespace) -> int:
    from kvwatch.plan import sources
    from kvwatch.plan.calibration import Calibration, EngineShape
    from kvwatch.plan.fit import FitError, fits_by_tp

    shape = EngineShape(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    engine_url = args.engine_url or args.load
    if engine_url:
        shape = sources.engine_shape(
            engine_url.rstrip("/"),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    notes: list[str] = []
    if args.step_samples:
        source, window = "step_samples", f"file {args.step_samples}"
        if sources.is_datagram_file(args.step_samples):
            capacity = (
                shape.num_gpu_blocks * shape.block_size if shape.num_gpu_blocks and shape.block_size else None
            )
            obs = sources.read_plugin_datagrams(args.step_samples, capacity)
            if capacity is None:
                notes.append("no --engine-url: KV usage cannot become tokens, per_kv_token_s is not fitted")
        else:
            obs = sources.observations_from_step_samples(sources.read_step_samples(args.step_samples))
            notes.append("step samples carry no KV token counts: per_kv_token_s is not fitted")
    elif args.prometheus:
        from kvwatch.plan.prometheus import observations_from_prometheus

        obs, window, shape = observations_from_prometheus(
            args.prometheus.rstrip("/"),
            since=args.since,
            until=args.until,
            window=args.window,
            selector=args.selector,
            shape=shape,
            tp_label=args.tp_label,
        )
        source = "prometheus"
        notes.append(
            "each observation is one rate window's mean step (the lesser of the mean inter-token "
            "latency and the window over its steps) against its "
            "mean running requests, tokens per iteration and KV usage"
        )
    else:
        assert shape.model_name is not None
        obs = sources.calibration_load(args.load.rstrip("/"), shape.model_name)
        source, window = "load", f"calibration load against {args.load} at {_now()}"
        notes.append(
            "prefill observations are a lone request's TTFT (frontend latency included), one step each; "
            "decode observations are a phase's mean step while all its streams decoded, "
            "weighed as the steps they span"
        )
        kept = sum(1 for o in obs if o.decode_seqs)
        notes.append(
            f"decode phases kept: {kept} of {sources.DECODE_PHASES} (a phase is dropped, after three tries, "
            "where its streams did not decode together or a burst of chunks swallowed its window)"
        )
    if args.tp is not None and args.tp < 1:
        raise FitError(f"--tp must be >= 1, got {args.tp}")
    fits = fits_by_tp([o if o.tp is not None else dataclasses.replace(o, tp=args.tp) for o in obs])
    if None in fits and len(fits) > 1:
        raise FitError("some observations carry a TP degree and some do not: pass --tp for those that do not")
    main_tp = next(iter(fits))  # the lowest degree
    if len(fits) > 1:
        notes.append(f"one fit per TP degree: {', '.join(f'TP={tp}' for tp in fits)}")
    shape = dataclasses.replace(shape, tensor_parallel_size=main_tp)
    others = tuple((tp, fit) for tp, fit in fits.items() if tp is not None and tp != main_tp)
    cal = Calibration(source, fits[main_tp], shape, _now(), window, tuple(notes), others)
    cal.dump(args.output)
    from kvwatch.plan.calibration import describe

    print("\n".join(describe(cal)))
    print(f"wrote {args.output}")
    return 0


def _bands(args: argparse.Namespace) -> LengthBands | None:
    """--bands, parsed before any input is read; None: the recorded side's (a ledger's own) bands."""
    from kvwatch.report.summary import parse_band_edges

    return parse_band_edges(args.bands) if args.bands else None


def _replay(args: argparse.Namespace) -> int:
    from kvwatch.model import DEFAULT_BANDS
    from kvwatch.plan.calibration import load_calibration
    from kvwatch.plan.candidate import CALIBRATED, Candidate, load_candidate
    from kvwatch.plan.inputs import workload_of
    from kvwatch.plan.recorded import recorded_report
    from kvwatch.plan.render import render_replay_html, render_replay_text
    from kvwatch.plan.replay import check_sample_every, replay

    if args.sample_every is not None:
        check_sample_every(args.sample_every)
    bands = _bands(args)
    workload = workload_of(args.inputs, args.limit, keep_lines=True)
    calibration = load_calibration(args.calibration) if args.calibration else None
    if args.candidate:
        candidate = load_candidate(args.candidate)
    elif calibration is not None:
        # the calibrated engine once per replica the ledger recorded: one engine carrying all their
        # traffic would be set against the node that spread it
        replicas = {r.klass for r in workload.requests} if workload.kind == "ledger" else set()
        candidate = Candidate(
            name="calibrated engine",
            model=CALIBRATED,
            dp=max(1, len(replicas - {""})),
            step_model=CALIBRATED,
            tp=calibration.engine.tensor_parallel_size or 1,
        )
    else:
        candidate = Candidate(name="demo default node")
    # the node's figures for the same requests the twin replays (--limit: the first N), in the same bands
    recorded = recorded_report(workload, bands) if args.inputs else None
    bands = bands or (recorded.bands if recorded is not None else DEFAULT_BANDS)
    result = replay(workload, candidate, calibration, bands=bands, sample_every=args.sample_every)
    if not args.candidate and calibration is None:
        result = _with_note(
            result,
            "no --calibration and no --candidate: the demo's default node "
            "(8x H200, qwen3-32b DP=8), UNCALIBRATED datasheet roofline",
        )
    if args.html:
        Path(args.html).write_text(
            render_replay_html(result, workload, recorded, calibration), encoding="utf-8"
        )
    sys.stdout.write(render_replay_text(result, workload, recorded, calibration))
    return 0


def _with_note(result: ReplayResult, note: str) -> ReplayResult:
    import dataclasses

    return dataclasses.replace(result, notes=(note, *result.notes))


def _compare(args: argparse.Namespace) -> int:
    from kvwatch.plan.compare import main_compare

    return main_compare(args)


def _export(args: argparse.Namespace) -> int:
    from kvwatch.plan.export import export_mooncake
    from kvwatch.plan.inputs import read_workload

    workload = read_workload(args.inputs)
    count = export_mooncake(workload, args.output)
    print(
        f"wrote {count:,} requests to {args.output} (Mooncake JSONL: timestamp ms, input_length, "
        "output_length)"
    )
    for line in workload.caveats():
        print(line)
    return 0
