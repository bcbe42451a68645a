"""The calibration file ``kvwatch plan calibrate`` writes and ``replay``/``compare`` read (YAML).

It records the fitted step cost, how good the fit was (R², residuals, sample counts), where the
data came from, and the engine it was measured on (KV blocks, block size, scheduler limits), so a
twin of that engine can be built from the file alone. Reading it names the key that is wrong.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kvwatch.config import quoted, safe_load
from kvwatch.jsonsafe import finite
from kvwatch.model import MAX_COUNT
from kvwatch.plan.fit import FitQuality, StepFit
from kvwatch.sim.steptime import StepCost

FORMAT_KEY = "kvwatch_calibration"
FORMAT_VERSION = 1
SOURCES = ("step_samples", "prometheus", "load")


T = TypeVar("T")


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file and key."""


@dataclass(frozen=True, slots=True)
class EngineShape:
    """The engine a calibration was measured on, as far as the source could tell."""

    model_name: str | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int | None = None  # TP of the main fit; None: the source did not say


@dataclass(frozen=True, slots=True)
class Calibration:
    """The main fit (``fit``, at ``engine.tensor_parallel_size``) and, when the source data had steps
    of several TP degrees, one fit per other degree (``tp_fits``): each layout timed by its own."""

    source: str  # step_samples | prometheus | load
    fit: StepFit
    engine: EngineShape = EngineShape()
    created_at: str = ""
    window: str = ""  # what was measured: a time range, a file, a load description
    notes: tuple[str, ...] = ()
    tp_fits: tuple[tuple[int, StepFit], ...] = ()  # (tp, fit) for the degrees other than the main one

    @property
    def cost(self) -> StepCost:
        return self.fit.cost

    @property
    def observed_tp(self) -> tuple[int, ...]:
        """TP degrees with a fit; a source that did not say is taken as TP=1 (one engine, no TP)."""
        return tuple(sorted({self.engine.tensor_parallel_size or 1, *(tp for tp, _ in self.tp_fits)}))

    def fit_for(self, tp: int, pp: int = 1, expert_parallel: bool = False) -> StepFit | None:
        """The fit measured at this layout, or None: the layout was never observed (the calibration
        sources see single-stage engines, so PP > 1 and expert parallelism are never observed)."""
        if pp != 1 or expert_parallel:
            return None
        if tp == (self.engine.tensor_parallel_size or 1):
            return self.fit
        return next((fit for t, fit in self.tp_fits if t == tp), None)

    def to_mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            FORMAT_KEY: FORMAT_VERSION,
            "source": self.source,
            "created_at": self.created_at,
            "window": self.window,
            "engine": {k: v for k, v in dataclasses.asdict(self.engine).items() if v is not None},
            **_fit_mapping(self.fit),
            "notes": list(self.notes),
        }
        if self.tp_fits:
            out["tp_fits"] = [{"tp": tp, **_fit_mapping(fit)} for tp, fit in self.tp_fits]
        return out

    def dump(self, path: str | Path) -> None:
        header = (
            "# kvwatch plan calibrate: fitted step-time model (docs/planning.md)\n"
            "# step = overhead_s + prefill tokens x per_prefill_token_s + decode sequences x "
            "per_decode_seq_s + KV tokens x per_kv_token_s\n"
        )
        Path(path).write_text(header + yaml.safe_dump(self.to_mapping(), sort_keys=False), encoding="utf-8")


def _fit_mapping(fit: StepFit) -> dict[str, Any]:
    q = fit.quality
    return {
        "step_cost": dataclasses.asdict(fit.cost),
        "fit": {
            "observations": q.observations,
            "steps": q.steps,
            "r2": q.r2,
            "residual_p50": q.residual_p50,
            "residual_p90": q.residual_p90,
            "rmse_s": q.rmse_s,
            "fitted_terms": list(q.fitted_terms),
            "unfitted_terms": list(q.unfitted_terms),
        },
    }


def _get(data: dict, key: str, where: str, kind: type | tuple[type, ...], required: bool = True) -> Any:
    if key not in data:
        if required:
            raise CalibrationError(f"{where}: missing key {key!r}")
        return None
    value = data[key]
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise CalibrationError(
            f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, got {quoted(value)}"
        )
    return value


def _optional_number(data: dict, key: str, where: str, required: bool = False) -> float | None:
    """A finite number (NaN, infinity and 1 followed by 400 zeros are not), or None when absent."""
    value = _get(data, key, where, (int, float), required)
    if value is None:
        return None
    number = finite(value)
    if number is None:
        raise CalibrationError(f"{where}.{key}: expected a finite number, got {quoted(value)}")
    return number


def _number(data: dict, key: str, where: str) -> float:
    return _present(_optional_number(data, key, where, required=True))


def _optional_count(data: dict, key: str, where: str, required: bool = False) -> int | None:
    """A whole number 0..MAX_COUNT, or None when absent."""
    value = _get(data, key, where, int, required)
    if value is not None and not 0 <= value <= MAX_COUNT:
        raise CalibrationError(f"{where}.{key}: {quoted(value)} is out of range (0 to 2^31)")
    return value


def _count(data: dict, key: str, where: str) -> int:
    return _present(_optional_count(data, key, where, required=True))


def _present(value: T | None) -> T:
    """A required key's value: reading it raised if it was missing or null."""
    assert value is not None
    return value


def _strings(data: dict, key: str, where: str, required: bool = True) -> tuple[str, ...]:
    value = _get(data, key, where, list, required) or []
    if not all(isinstance(v, str) for v in value):
        raise CalibrationError(f"{where}.{key}: expected a list of strings")
    return tuple(value)


def calibration_from_mapping(data: Any, source: str = "calibration") -> Calibration:
    if not isinstance(data, dict) or data.get(FORMAT_KEY) != FORMAT_VERSION:
        raise CalibrationError(
            f"{source}: not a kvwatch calibration file (expected '{FORMAT_KEY}: "
            f"{FORMAT_VERSION}' at the top; write one with kvwatch plan calibrate)"
        )
    origin = _get(data, "source", source, str)
    if origin not in SOURCES:
        raise CalibrationError(f"{source}.source: {origin!r} is not one of {', '.join(SOURCES)}")
    main = _fit_from_mapping(data, source)
    engine_data = _get(data, "engine", source, dict, required=False) or {}
    known = {f.name for f in dataclasses.fields(EngineShape)}
    unknown = sorted(set(engine_data) - known)
    if unknown:
        raise CalibrationError(
            f"{source}.engine: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    shape: dict[str, Any] = {}
    for key in known & set(engine_data):
        where = f"{source}.engine"
        shape[key] = (
            _get(engine_data, key, where, str, required=False)
            if key == "model_name"
            else _optional_count(engine_data, key, where)
        )
    engine = EngineShape(**shape)
    tp_fits = []
    seen = {engine.tensor_parallel_size or 1}
    for i, entry in enumerate(_get(data, "tp_fits", source, list, required=False) or []):
        where = f"{source}.tp_fits[{i}]"
        if not isinstance(entry, dict):
            raise CalibrationError(f"{where}: expected a mapping with tp, step_cost and fit")
        tp = _count(entry, "tp", where)
        if tp < 1 or tp in seen:
            raise CalibrationError(
                f"{where}.tp: {tp!r} must be >= 1 and appear once (main fit: TP={min(seen)})"
            )
        seen.add(tp)
        tp_fits.append((tp, _fit_from_mapping(entry, where)))
    return Calibration(
        origin,
        main,
        engine,
        _get(data, "created_at", source, str, required=False) or "",
        _get(data, "window", source, str, required=False) or "",
        _strings(data, "notes", source, required=False),
        tuple(tp_fits),
    )


def _fit_from_mapping(data: dict, source: str) -> StepFit:
    costs = _get(data, "step_cost", source, dict)
    try:
        cost = StepCost(
            **{f.name: _number(costs, f.name, f"{source}.step_cost") for f in dataclasses.fields(StepCost)}
        )
    except ValueError as exc:
        if isinstance(exc, CalibrationError):
            raise
        raise CalibrationError(f"{source}.step_cost: {exc}") from None
    fit = _get(data, "fit", source, dict)
    where = f"{source}.fit"
    quality = FitQuality(
        observations=_count(fit, "observations", where),
        steps=_number(fit, "steps", where),
        r2=_optional_number(fit, "r2", where),
        residual_p50=_number(fit, "residual_p50", where),
        residual_p90=_number(fit, "residual_p90", where),
        rmse_s=_number(fit, "rmse_s", where),
        fitted_terms=_strings(fit, "fitted_terms", where),
        unfitted_terms=_strings(fit, "unfitted_terms", where, required=False),
    )
    return StepFit(cost, quality)


def load_calibration(path: str | Path) -> Calibration:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CalibrationError(f"cannot read calibration {path}: {exc.strerror or exc}") from None
    try:
        data = safe_load(text)
    except yaml.YAMLError as exc:
        raise CalibrationError(f"{path}: not YAML: {exc}") from None
    return calibration_from_mapping(data, str(path))


def describe(cal: Calibration) -> list[str]:
    """How far the calibration can be trusted, in lines for the text output."""
    main_tp = cal.engine.tensor_parallel_size
    lines = [f"calibration: {cal.source} ({cal.window or 'window not recorded'})"]
    for tp, fit in ((main_tp, cal.fit), *cal.tp_fits):
        lines += _describe_fit(fit, "TP unknown (taken as 1)" if tp is None else f"TP={tp}")
    return lines + [f"  note: {n}" for n in cal.notes]


def _describe_fit(fit: StepFit, layout: str) -> list[str]:
    q = fit.quality
    r2 = "n/a" if q.r2 is None or math.isnan(q.r2) else f"{q.r2:.3f}"
    c = fit.cost
    lines = [
        f"  {layout}: {q.observations:,} observations standing for {q.steps:,.0f} engine steps",
        f"    step = {c.overhead_s * 1e3:.3f} ms + {c.per_prefill_token_s * 1e6:.3f} us/prefill token + "
        f"{c.per_decode_seq_s * 1e3:.4f} ms/decode seq + {c.per_kv_token_s * 1e9:.3f} ns/KV token",
        f"    fit: R2 {r2}, |residual| p50 {q.residual_p50:.1%} p90 {q.residual_p90:.1%}, "
        f"rmse {q.rmse_s * 1e3:.3f} ms",
    ]
    if q.unfitted_terms:
        lines.append(f"    not determined by the data (set to 0): {', '.join(q.unfitted_terms)}")
    return lines
