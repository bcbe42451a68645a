"""``kvwatch plan compare``: sweep candidate deployments, keep the cheapest that meet every band's SLO.

The sweep, in two stages so it stays a few dozen replays rather than the full product:

1. hardware: every GPU type preset (H100 80 GB, H200 141 GB, B200 192 GB) x every TP x DP split of
   1, 2, 4 ... up to ``--gpus`` GPUs, and the PP and TP x PP replicas that span those GPUs whole
   (PP=2 on 2, PP=4 and TP=2 x PP=2 on 4, ...), and for a MoE model every TP > 1 also with expert
   parallelism, x KV dtype (bf16, fp8), vLLM's default scheduler knobs;
2. knobs, one at a time, on the three cheapest stage-1 candidates that meet the SLOs (or, if none
   does, the three with the best worst-band attainment): ``max_num_seqs`` 256, block size 32, the
   CPU offload tier (200 GiB per replica), and the admission policies ``reserve_max_tokens``,
   ``quantile_budget`` (output p90 budget, 10 % shared headroom) and ``long_pool`` (half the
   replicas for requests whose max_tokens exceeds 5,000).

A candidate whose weights do not fit, or whose cache cannot hold one request, is listed as unable
to run, with the reason. Candidates run in parallel processes (``--jobs``).

SLO attainment, per objective and band: the share of the band's replayed requests whose SLI is
within the threshold (latency SLIs: a request without the value, e.g. abandoned before its first
token, counts as bad), or whose outcome is good (completion SLI). Margin = attainment - objective.
A candidate meets the SLOs when every objective meets its target in every band that has requests.
Cost is GPUs x the GPU type's price per hour (``--price``; default 1 for every type, so cost is
the GPU count).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvwatch.model import LengthBands, Outcome
from kvwatch.plan.calibration import Calibration, load_calibration
from kvwatch.plan.candidate import (
    CALIBRATED,
    DEFAULT_GPU,
    Candidate,
    CandidateError,
    observed_fit,
    unobserved_layout,
)
from kvwatch.plan.inputs import Workload, workload_of
from kvwatch.plan.replay import ReplayResult, replay
from kvwatch.sim.models import GPUS, model_preset
from kvwatch.sim.presets import DEMO_MODEL

GPU_TYPES = ("h100", "h200", "b200")
KV_DTYPES = ("auto", "fp8")
_SLI_COLUMN = {"ttft": "ttft_seconds", "tpot": "tpot_seconds", "e2e": "e2e_seconds"}
FINISHED = (Outcome.COMPLETED.value, Outcome.TRUNCATED.value)  # ended as the engine meant them to


@dataclass(frozen=True, slots=True)
class BandAttainment:
    objective: str
    band: str
    requests: int
    attainment: float
    target: float

    @property
    def margin(self) -> float:
        return self.attainment - self.target


@dataclass(frozen=True, slots=True)
class Evaluated:
    candidate: Candidate
    error: str | None  # cannot run
    attainments: tuple[BandAttainment, ...] = ()
    completed_per_gpu_hour: float | None = None
    preemptions: int = 0
    e2e_p99: float | None = None
    wall_seconds: float = 0.0
    timed_by: str = "roofline"  # "fit TP=n" (the calibration's fit for this layout), "roofline", or
    # "roofline (never observed)": asked for the calibration, whose data never had this layout
    offload_bytes: float = 0.0  # CPU tier: stored + loaded over PCIe
    recompute_avoided_per_byte: float | None = None  # tokens loaded back instead of recomputed, per byte
    offload_queue_seconds: float = 0.0  # steps' wait for busy (shared) uplinks beyond their own transfer

    @property
    def meets(self) -> bool:
        return self.error is None and all(a.margin >= 0 for a in self.attainments)

    @property
    def worst_margin(self) -> float:
        return min((a.margin for a in self.attainments), default=-math.inf)

    @property
    def worst_attainment(self) -> float | None:
        if self.error is not None:
            return None
        return min((a.attainment for a in self.attainments), default=None)


def splits(max_gpus: int) -> list[tuple[int, int]]:
    """(tp, dp) for 1, 2, 4 ... GPUs up to ``max_gpus`` (and ``max_gpus`` itself)."""
    counts = sorted({*(2**k for k in range(8) if 2**k <= max_gpus), max_gpus})
    return [(tp, g // tp) for g in counts for tp in (1, 2, 4, 8) if tp <= g and g % tp == 0]


def layouts(max_gpus: int) -> list[tuple[int, int, int]]:
    """(tp, pp, dp): every TP x DP split, then the PP and TP x PP replicas spanning 2, 4 ... GPUs."""
    out = [(tp, 1, dp) for tp, dp in splits(max_gpus)]
    counts = sorted({*(2**k for k in range(8) if 2**k <= max_gpus), max_gpus})
    for g in counts:
        for pp in (2, 4, 8):
            if pp <= g and g % pp == 0 and g // pp in (1, 2, 4, 8):
                out.append((g // pp, pp, 1))
    return out


def hardware_grid(
    max_gpus: int, model: str, dtypes: Sequence[str] = KV_DTYPES, calibrated_on: str | None = None
) -> list[Candidate]:
    """Stage 1 (module doc). ``calibrated_on``: the GPU type the calibration was measured on; its
    candidates ask for the calibration (``step_model: calibrated``) and get the fit of their layout
    where the calibration observed it, the roofline where not (and the output says which)."""
    moe = is_moe(model)
    out = []
    # the calibrated engine's blocks and step times are the calibration's whatever the GPU type: one
    # type (the one it was measured on), or the sweep prices identical figures three ways
    for gpu in (calibrated_on or DEFAULT_GPU,) if model == CALIBRATED else GPU_TYPES:
        for tp, pp, dp in layouts(max_gpus):
            for ep in (False, True) if moe and tp > 1 else (False,):
                for dtype in dtypes:
                    shape = f"tp{tp}" + ("-ep" if ep else "") + (f"-pp{pp}" if pp > 1 else "")
                    name = f"{gpu}-{shape}-dp{dp}-{'fp8kv' if dtype == 'fp8' else 'bf16kv'}"
                    out.append(
                        Candidate(
                            name=name,
                            model=model,
                            gpu=gpu,
                            tp=tp,
                            pp=pp,
                            dp=dp,
                            expert_parallel=ep,
                            kv_cache_dtype=dtype,
                            step_model=CALIBRATED if gpu == calibrated_on else "roofline",
                        )
                    )
    return out


def is_moe(model: str) -> bool:
    """Whether the sweep tries expert parallelism; an unknown model is a CandidateError that lists the
    presets, not a ValueError traceback."""
    if model == CALIBRATED:
        return False
    try:
        return model_preset(model).is_moe
    except ValueError as exc:
        raise CandidateError(f"--model: {exc}, or {CALIBRATED} (the engine of --calibration)") from None


def knob_variants(base: Candidate) -> list[Candidate]:
    replace = dataclasses.replace
    variants = [
        ("seqs256", replace(base, max_num_seqs=256)),
        ("block32", replace(base, block_size=32)),
        ("offload200", replace(base, cpu_offload_gb=200.0)),
        ("reserve", replace(base, admission="reserve_max_tokens")),
        ("quantile", replace(base, admission="quantile_budget")),
    ]
    if base.dp >= 2:
        variants.append(("longpool", replace(base, admission="long_pool")))
    return [replace(variant, name=f"{base.name}-{suffix}") for suffix, variant in variants]


def attainment(result: ReplayResult, objectives: Sequence, bands: LengthBands) -> tuple[BandAttainment, ...]:
    frame = result.requests
    out_tokens = frame["output_tokens"].to_numpy(dtype=float)
    band_of = np.array([bands.band_for(x) for x in out_tokens])
    outcome = frame["outcome"].astype(str).to_numpy()
    rows = []
    for obj in objectives:
        for band in obj.bands:
            mask = band_of == band
            n = int(mask.sum())
            if not n:
                continue
            if obj.is_latency:
                values = frame[_SLI_COLUMN[obj.sli]].to_numpy(dtype=float)[mask]
                # a request that finished has no value only where it cannot have one (TPOT of a
                # one-token answer): not counted, as the rules do not; one abandoned first is bad
                undefined = np.isnan(values) & np.isin(outcome[mask], FINISHED)
                good = int(np.sum(values <= obj.threshold))  # NaN compares False: bad
                total = n - int(undefined.sum())
                if not total:
                    continue
            else:
                total = int(np.isin(outcome[mask], [*obj.good_outcomes, *obj.bad_outcomes]).sum())
                good = int(np.isin(outcome[mask], obj.good_outcomes).sum())
                if not total:
                    continue
            rows.append(BandAttainment(obj.name, band, total, good / total, obj.objective))
    return tuple(rows)


_STATE: dict = {}


def _init(workload: Workload, objectives: tuple, bands: LengthBands, calibration: Calibration | None) -> None:
    _STATE.update(workload=workload, objectives=objectives, bands=bands, calibration=calibration)


def _evaluate(candidate: Candidate) -> Evaluated:
    s = _STATE
    cal = s["calibration"]
    fit = observed_fit(candidate, cal)
    timed_by = (
        f"fit TP={candidate.tp}"
        if fit is not None
        else "roofline (never observed)"
        if unobserved_layout(candidate, cal)
        else "roofline"
    )
    try:
        result = replay(s["workload"], candidate, cal, bands=s["bands"])
    except CandidateError as exc:
        return Evaluated(candidate, str(exc), timed_by=timed_by)
    from kvwatch.report.summary import ALL

    total = next(r for r in result.report.rows_for(ALL) if r.length_band == ALL)
    return Evaluated(
        candidate,
        None,
        attainment(result, s["objectives"], s["bands"]),
        result.node.completed_per_gpu_hour,
        result.node.preemptions,
        total.e2e_p99_seconds,
        result.wall_seconds,
        timed_by,
        result.node.offload_bytes,
        result.node.recompute_avoided_per_byte,
        result.node.offload_queue_seconds,
    )


def evaluate_all(
    candidates: Sequence[Candidate],
    workload: Workload,
    objectives: tuple,
    bands: LengthBands,
    calibration: Calibration | None,
    jobs: int | None,
) -> list[Evaluated]:
    jobs = max(1, jobs or os.cpu_count() or 1)
    if jobs == 1:
        _init(workload, objectives, bands, calibration)
        return [_evaluate(c) for c in candidates]
    with ProcessPoolExecutor(
        max_workers=jobs, initializer=_init, initargs=(workload, objectives, bands, calibration)
    ) as pool:
        return list(pool.map(_evaluate, candidates, chunksize=1))


def band_margins(e: Evaluated) -> dict[str, BandAttainment]:
    """Per band, its tightest objective (the smallest margin)."""
    worst: dict[str, BandAttainment] = {}
    for a in e.attainments:
        if a.band not in worst or a.margin < worst[a.band].margin:
            worst[a.band] = a
    return worst


def cost(e: Evaluated, prices: dict[str, float]) -> float:
    return e.candidate.gpus * prices.get(e.candidate.gpu, 1.0)


def ranked(evaluated: Sequence[Evaluated], prices: dict[str, float]) -> list[Evaluated]:
    """Meeting candidates first, cheapest first, larger worst-band margin first."""
    return sorted(
        evaluated, key=lambda e: (not e.meets, e.error is not None, cost(e, prices), -e.worst_margin)
    )


def closest(evaluated: Sequence[Evaluated], prices: dict[str, float]) -> list[Evaluated]:
    """When nothing meets: the runnable candidates by worst margin (largest first), then cost."""
    runnable = [e for e in evaluated if e.error is None]
    return sorted(runnable, key=lambda e: (-e.worst_margin, cost(e, prices)))


def knob_bases(evaluated: Sequence[Evaluated], prices: dict[str, float]) -> list[Candidate]:
    """Where stage 2 tries its knobs: the three cheapest candidates meeting every SLO, or, when none
    does, the three closest (by cost, the knobs would have gone to whatever failed cheapest)."""
    meeting = [e for e in evaluated if e.meets]
    chosen = ranked(meeting, prices) if meeting else closest(evaluated, prices)
    return [e.candidate for e in chosen[:3]]


def gap_advice(evaluated: Sequence[Evaluated], max_gpus: int, prices: dict[str, float]) -> list[str]:
    """What would close the gap when no candidate meets every SLO, from what the sweep saw."""
    near = closest(evaluated, prices)
    if not near:
        return []
    best = near[0]
    worst = min(best.attainments, key=lambda a: a.margin)
    lines = [
        f"closest: {best.candidate.name} misses {worst.objective} in band {worst.band} by "
        f"{-worst.margin * 100:.1f} pp ({worst.attainment:.1%} against {worst.target:.1%})"
    ]
    if best.candidate.gpus >= max_gpus:
        lines.append(f"- more GPUs: the closest already uses all {max_gpus} of --gpus; try a larger --gpus")
    else:
        lines.append(f"- the closest uses {best.candidate.gpus} of {max_gpus} GPUs: more did not help there")
    admitted = [e for e in near if e.candidate.admission != "none"]
    if admitted:
        a = admitted[0]
        lines.append(
            f"- an admission policy: the best tried ({a.candidate.admission} on {a.candidate.name}) "
            f"reached {a.worst_margin * 100:+.1f} pp"
        )
    if best.preemptions:
        lines.append(
            f"- a lower rate: the closest preempted {best.preemptions:,} times, so the cache is "
            "oversubscribed at this arrival rate (replay a trace recorded at a lower rate; --limit keeps "
            "the first N requests at the recorded rate, it does not thin them)"
        )
    else:
        lines.append("- a lower rate or shorter outputs: the closest did not preempt; its steps are too slow")
    return lines


def sweep(
    workload: Workload,
    objectives: tuple,
    bands: LengthBands,
    max_gpus: int,
    model: str,
    *,
    grid: str = "standard",
    calibration: Calibration | None = None,
    jobs: int | None = None,
    prices: dict[str, float] | None = None,
    calibrated_on: str | None = None,
) -> list[Evaluated]:
    prices = prices or {}
    stage1 = hardware_grid(max_gpus, model, KV_DTYPES if grid == "standard" else ("auto",), calibrated_on)
    results = evaluate_all(stage1, workload, objectives, bands, calibration, jobs)
    if grid == "standard":
        stage2 = [v for b in knob_bases(results, prices) for v in knob_variants(b)]
        results += evaluate_all(stage2, workload, objectives, bands, calibration, jobs)
    return ranked(results, prices)


def tier_report(evaluated: Sequence[Evaluated]) -> list[str]:
    """One line per runnable candidate with a CPU tier: PCIe bytes, tokens loaded back per MB moved,
    the steps' wait for busy uplinks, and completed requests per GPU-hour and preemptions against the
    same candidate without the tier (when the sweep ran it)."""

    def key(c: Candidate) -> Candidate:
        return dataclasses.replace(c, name="", cpu_offload_gb=0.0)

    bases = {key(e.candidate): e for e in evaluated if e.error is None and not e.candidate.cpu_offload_gb}
    lines = []
    for e in evaluated:
        if e.error is not None or not e.candidate.cpu_offload_gb:
            continue
        if not e.offload_bytes:
            lines.append(f"- {e.candidate.name}: never used (nothing was preempted, so nothing was kept)")
            continue
        ratio = e.recompute_avoided_per_byte
        line = (
            f"- {e.candidate.name}: {e.offload_bytes / 1e9:,.1f} GB over PCIe, "
            f"{'n/a' if ratio is None else f'{ratio * 1e6:,.2f}'} tokens loaded back per MB moved, "
            f"steps waited {e.offload_queue_seconds:,.1f} s for busy uplinks"
        )
        base = bases.get(key(e.candidate))
        done, before = e.completed_per_gpu_hour, base.completed_per_gpu_hour if base else None
        if base is not None and done is not None and before is not None:
            line += (
                f"; extra work admitted: {done - before:+,.1f} "
                f"completed/GPU-h, preemptions {base.preemptions:,} -> {e.preemptions:,} "
                f"(without the tier: {base.candidate.name})"
            )
        lines.append(line)
    return lines


def parse_prices(text: str | None) -> dict[str, float]:
    prices: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, _, value = part.partition("=")
        key = key.strip().lower()
        if key not in GPUS:
            raise CandidateError(f"--price {part!r}: unknown GPU type {key!r} (known: {', '.join(GPUS)})")
        try:
            price = float(value)
        except ValueError:
            price = math.nan
        if not 0 <= price < math.inf:  # NaN fails too
            raise CandidateError(f"--price {part!r}: {value!r} is not a price (a number >= 0)")
        prices[key] = price
    return prices


def render_compare_text(
    evaluated: Sequence[Evaluated],
    workload: Workload,
    top: int,
    prices: dict[str, float],
    calibration: Calibration | None,
    max_gpus: int | None = None,
) -> str:
    from kvwatch import texttable

    meeting = [e for e in evaluated if e.meets]
    fitted = sum(1 for e in evaluated if e.timed_by.startswith("fit"))
    by_roofline = sum(1 for e in evaluated if e.error is None and not e.timed_by.startswith("fit"))
    unobserved = [e for e in evaluated if e.timed_by == "roofline (never observed)" and e.error is None]
    lines = [
        f"kvwatch plan compare: {len(workload.requests):,} requests from {workload.kind} "
        f"{', '.join(workload.paths)}; {len(evaluated)} candidates, {len(meeting)} meet every band's SLO",
        "step time: "
        + (
            f"the calibration's fit for {fitted} candidate(s) (observed layouts: "
            f"{', '.join(f'TP={tp}' for tp in calibration.observed_tp)})"
            + (f"; the UNCALIBRATED datasheet roofline for the other {by_roofline}" if by_roofline else "")
            if calibration
            else "UNCALIBRATED datasheet roofline for every candidate: a ranking to check on "
            "hardware, not a measurement"
        ),
        f"cost: GPUs x price per GPU-hour ({', '.join(f'{k}={v:g}' for k, v in prices.items()) or 'all 1'})",
    ]
    shown = meeting[:top] if meeting else closest(evaluated, prices)[:top]
    if unobserved:
        lines.append(
            f"{len(unobserved)} candidate(s) asked for the calibration but their layout was never observed "
            "in it: their time is the roofline's (timed by: roofline (never observed))"
        )
    if not meeting:
        lines.append("no candidate meets every SLO; the closest, by worst margin:")
    body = []
    for rank, e in enumerate(shown, start=1):
        worst = min(e.attainments, key=lambda a: a.margin, default=None)
        body.append(
            [
                str(rank),
                e.candidate.name,
                str(e.candidate.gpus),
                f"{cost(e, prices):g}",
                "yes" if e.meets else "no",
                "n/a" if worst is None else f"{worst.margin * 100:+.1f} pp ({worst.objective} {worst.band})",
                "n/a" if e.completed_per_gpu_hour is None else f"{e.completed_per_gpu_hour:,.0f}",
                f"{e.preemptions:,}",
                e.timed_by,
            ]
        )
    table = texttable.render(
        ["#", "candidate", "GPUs", "cost", "meets", "worst margin", "done/GPU-h", "preempt", "timed by"], body
    )
    margins = []
    for rank, e in enumerate(shown, start=1):
        margins.append(
            f"{rank}. {e.candidate.label()}: "
            + ", ".join(
                f"{band} {a.margin * 100:+.1f} pp ({a.objective} {a.attainment:.1%})"
                for band, a in band_margins(e).items()
            )
        )
    if not meeting and max_gpus is not None:
        margins += ["", "what would close the gap:", *gap_advice(evaluated, max_gpus, prices)]
    tiers = tier_report(evaluated)
    if tiers:
        margins += [
            "",
            "CPU tier: recompute avoided per byte moved, and the extra work it admitted "
            "(against the same candidate without the tier):",
            *tiers,
        ]
    cannot = [e for e in evaluated if e.error is not None]
    tail = (
        [f"{len(cannot)} candidate(s) cannot run:"] + [f"  {e.error}" for e in cannot[:10]] if cannot else []
    )
    return (
        "\n".join(lines)
        + "\n\n"
        + table
        + "\n\nmargin per band (its tightest objective):\n"
        + "\n".join(margins)
        + ("\n\n" + "\n".join(tail) if tail else "")
        + "\n"
    )


def render_compare_html(evaluated: Sequence[Evaluated], text: str) -> str:
    from html import escape

    from kvwatch import humanize as h
    from kvwatch.report import svg

    counts = sorted({e.candidate.gpus for e in evaluated})
    series = []
    for gpu in GPU_TYPES:
        best = []
        for g in counts:
            vals = [
                e.worst_attainment
                for e in evaluated
                if e.candidate.gpu == gpu and e.candidate.gpus == g and e.worst_attainment is not None
            ]
            best.append(max(vals) if vals else None)
        series.append((gpu, best))
    chart = svg.grouped_bars(
        "Worst-band SLO attainment of the best candidate, by GPUs",
        [str(g) for g in counts],
        series,
        h.ratio,
        width=560,
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>kvwatch plan compare</title>'
        "<style>body{font-family:system-ui,sans-serif;margin:2em}.s0{fill:#4e79a7}.s1{fill:#f28e2b}"
        ".s2{fill:#59a14f}.chart text{font-size:11px}</style></head><body><h1>kvwatch plan compare</h1>"
        f"{chart}<pre>{escape(text)}</pre></body></html>\n"
    )


def main_compare(args: argparse.Namespace) -> int:
    from kvwatch.mixin.slo import load_slo_file

    slo = load_slo_file(args.slo)
    if args.gpus < 1:
        raise CandidateError(f"--gpus must be >= 1, got {args.gpus}")
    is_moe(args.model or DEMO_MODEL)  # an unknown --model is refused before the ledger is read
    workload = workload_of(args.inputs, args.limit)
    calibration = load_calibration(args.calibration) if args.calibration else None
    calibrated_on = getattr(args, "calibrated_on", None)
    if calibrated_on is not None and calibration is None:
        raise CandidateError("--calibrated-on needs --calibration (the file of that GPU's fits)")
    prices = parse_prices(getattr(args, "price", None))
    evaluated = sweep(
        workload,
        slo.objectives,
        slo.bands,
        args.gpus,
        args.model or DEMO_MODEL,
        grid=args.grid,
        calibration=calibration,
        jobs=args.jobs,
        prices=prices,
        calibrated_on=calibrated_on,
    )
    text = render_compare_text(evaluated, workload, args.top, prices, calibration, args.gpus)
    if args.html:
        Path(args.html).write_text(render_compare_html(evaluated, text), encoding="utf-8")
    sys.stdout.write(text)
    return 0
