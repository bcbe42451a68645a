"""A candidate deployment to replay on: model, GPU type, TP x DP, KV dtype, scheduler knobs, CPU
tier, admission policy, and which step-time model times it.

``model: calibrated`` is the engine a calibration was measured on (its KV blocks, block size and
limits, from the calibration file); any other model is a simulator preset (``sim/models.py``) on a
GPU preset, timed by the datasheet roofline unless ``step_model: calibrated`` says the calibration
was measured on that same model and GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvwatch.config import quoted, safe_load
from kvwatch.jsonsafe import finite
from kvwatch.model import MAX_COUNT
from kvwatch.plan.calibration import Calibration
from kvwatch.plan.fit import StepFit
from kvwatch.sim.engine import EngineConfig
from kvwatch.sim.models import ModelSpec, gpu_preset, model_preset
from kvwatch.sim.presets import DEMO_MODEL
from kvwatch.sim.routing import POLICIES
from kvwatch.sim.steptime import StepCost

STEP_MODELS = ("roofline", "calibrated")
ADMISSIONS = ("none", "reserve_max_tokens", "quantile_budget", "long_pool")
#: the simulator's routers a candidate can use: ``weighted`` needs one weight per replica, which no
#: candidate key gives (it raised a traceback from the router)
ROUTERS = tuple(policy for policy in POLICIES if policy != "weighted")
CALIBRATED = "calibrated"
DEFAULT_GPU = "h200"  # the reference node's


#: the most GPUs one candidate may use: a 1,000-node fleet of 8-GPU nodes is 8,000
MAX_GPUS = 65_536


class CandidateError(ValueError):
    """A candidate that cannot be built or cannot run; the message names the key."""


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str = "default"
    model: str = DEMO_MODEL
    gpu: str = DEFAULT_GPU
    tp: int = 1
    dp: int = 8
    pp: int = 1  # pipeline stages per replica (each of tp GPUs)
    expert_parallel: bool = False  # MoE: experts whole over the tp GPUs (--enable-expert-parallel)
    expert_imbalance: float = 1.25  # EP: busiest GPU's expert load / the mean (an assumption)
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = False
    cpu_offload_gb: float = 0.0  # GiB per replica (vLLM --kv-offloading-size, in GiB)
    gpus_per_pcie_switch: int | None = None  # GPUs sharing one host uplink (None: the GPU preset's, 1)
    admission: str = "none"
    admission_quantile: float = 0.9  # quantile_budget: output budget = this quantile of outputs
    admission_headroom: float = 0.1  # quantile_budget: share of the pool kept for overruns
    long_pool_share: float = 0.5  # long_pool: share of replicas serving long requests
    long_threshold: int = 5000  # long_pool: max_tokens above this is a long request
    router: str = "least_loaded"
    step_model: str = "roofline"
    num_gpu_blocks: int | None = None  # override the memory plan (vLLM --num-gpu-blocks-override)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def layout(self) -> str:
        """``TP=2 x PP=4 x DP=1`` style; ``EP`` when the experts are spread whole."""
        if self.tp == 1 and self.pp == 1:
            return f"{self.dp}x{self.gpu}"
        parts = [f"TP={self.tp}"] if self.tp > 1 or self.pp == 1 else []
        if self.expert_parallel:
            parts.append(f"EP={self.tp}")
        if self.pp > 1:
            parts.append(f"PP={self.pp}")
        return f"{self.gpu} {' x '.join(parts)} x DP={self.dp}"

    def label(self) -> str:
        parts = [
            f"{self.model}",
            self.layout(),
            f"kv {self.kv_cache_dtype}",
            f"seqs {self.max_num_seqs}",
            f"block {self.block_size}",
        ]
        if self.cpu_offload_gb:
            parts.append(f"CPU tier {self.cpu_offload_gb:g} GiB")
        if self.gpus_per_pcie_switch and self.gpus_per_pcie_switch > 1:
            parts.append(f"{self.gpus_per_pcie_switch} GPUs per PCIe switch")
        if self.admission != "none":
            parts.append(f"admission {self.admission}")
        return ", ".join(parts)

    def validate(self) -> None:
        checks = [
            ("tp", self.tp >= 1),
            ("dp", self.dp >= 1),
            ("pp", self.pp >= 1),
            ("expert_imbalance", self.expert_imbalance >= 1),
            ("max_num_seqs", self.max_num_seqs >= 1),
            ("block_size", self.block_size >= 1),
            ("cpu_offload_gb", self.cpu_offload_gb >= 0),
            ("gpus_per_pcie_switch", self.gpus_per_pcie_switch is None or self.gpus_per_pcie_switch >= 1),
            ("admission_quantile", 0 < self.admission_quantile <= 1),
            ("admission_headroom", 0 <= self.admission_headroom < 1),
            ("long_pool_share", 0 < self.long_pool_share < 1),
        ]
        checks += [  # no count is larger (model.MAX_COUNT): 1 and 400 zeros would overflow the float maths
            (f.name, getattr(self, f.name) is None or getattr(self, f.name) <= MAX_COUNT)
            for f in dataclasses.fields(self)
            if f.type in ("int", "int | None")
        ]
        for key, ok in checks:
            if not ok:
                raise CandidateError(
                    f"candidate {self.name!r}: {key} = {quoted(getattr(self, key))} is out of range"
                )
        if self.tp * self.pp * self.dp > MAX_GPUS:
            raise CandidateError(
                f"candidate {self.name!r}: tp x pp x dp = {self.tp * self.pp * self.dp} GPUs, more than the "
                f"{MAX_GPUS:,} a plan simulates"
            )
        for key, value, allowed in (
            ("admission", self.admission, ADMISSIONS),
            ("router", self.router, ROUTERS),
            ("step_model", self.step_model, STEP_MODELS),
        ):
            if value not in allowed:
                raise CandidateError(
                    f"candidate {self.name!r}: {key} {value!r} is not one of {', '.join(allowed)}"
                )
        if self.admission == "long_pool" and self.dp < 2:
            raise CandidateError(
                f"candidate {self.name!r}: admission long_pool needs dp >= 2 "
                f"(a separate pool of replicas), got dp={self.dp}"
            )


def _calibrated_model(cal: Calibration | None) -> ModelSpec:
    """The engine a calibration was measured on; its KV pool (blocks x block size) is what a twin
    of it cannot do without, and only the engine's own endpoint tells it."""
    if cal is None:
        raise CandidateError(
            "model 'calibrated' is the engine a calibration was measured on: pass --calibration FILE"
        )
    if cal.engine.num_gpu_blocks is None or cal.engine.block_size is None:
        raise CandidateError(
            f"model 'calibrated' needs the engine's KV shape (num_gpu_blocks and block_size), and this "
            f"calibration ({cal.source}, {cal.window or 'no window'}) did not record it: re-run "
            "`kvwatch plan calibrate` with --engine-url pointing at the engine it measured"
        )
    # KV geometry is unknown: only block counts matter (num_gpu_blocks overrides the memory plan)
    return ModelSpec(
        key=CALIBRATED,
        served_name=cal.engine.model_name or CALIBRATED,
        layers=1,
        kv_heads=1,
        head_dim=1,
        params=1.0,
        active_params=1.0,
        weight_bytes=1.0,
        max_model_len=cal.engine.max_model_len or 2048,
    )


def engine_config(
    c: Candidate, cal: Calibration | None = None, *, output_budget: int | None = None
) -> EngineConfig:
    """The simulator config of one replica; CandidateError when it cannot run (weights do not fit,
    a request could never fit the cache, an unknown preset)."""
    c.validate()
    if c.step_model == CALIBRATED and cal is None:
        raise CandidateError(f"candidate {c.name!r}: step_model calibrated needs --calibration")
    try:
        if c.model == CALIBRATED:
            model = _calibrated_model(cal)
            assert cal is not None
            shape = cal.engine
            fields: dict[str, Any] = {
                "block_size": shape.block_size,
                "num_gpu_blocks_override": shape.num_gpu_blocks,
                "max_num_seqs": shape.max_num_seqs or c.max_num_seqs,
                "max_num_batched_tokens": shape.max_num_batched_tokens
                or max(c.max_num_batched_tokens, model.max_model_len),
                "max_model_len": shape.max_model_len,
            }
        else:
            model = model_preset(c.model)
            fields = {
                "block_size": c.block_size,
                "max_num_seqs": c.max_num_seqs,
                "max_num_batched_tokens": max(c.max_num_batched_tokens, c.max_num_seqs),
                "max_model_len": c.max_model_len,
                "num_gpu_blocks_override": c.num_gpu_blocks,
            }
        config = EngineConfig(
            model=model,
            gpu=gpu_preset(c.gpu),
            tp=c.tp,
            pp=c.pp,
            expert_parallel=c.expert_parallel,
            expert_imbalance=c.expert_imbalance,
            gpu_memory_utilization=c.gpu_memory_utilization,
            kv_cache_dtype=c.kv_cache_dtype,
            enable_prefix_caching=c.enable_prefix_caching,
            kv_offload_bytes=c.cpu_offload_gb * 2**30,  # GiB, as vLLM's --kv-offloading-size
            gpus_per_pcie_switch=c.gpus_per_pcie_switch,
            step_cost=_calibrated_cost(c, cal),
            admission=_engine_admission(c.admission),
            admission_output_budget=output_budget or 0,
            admission_headroom=c.admission_headroom if c.admission == "quantile_budget" else 0.0,
            step_histograms=False,  # the twin reads requests and counters, not /metrics
            **fields,
        )
        config.validate()
    except ValueError as exc:
        if isinstance(exc, CandidateError):
            raise
        raise CandidateError(f"candidate {c.name!r} ({c.label()}) cannot run: {exc}") from None
    return config


def observed_fit(c: Candidate, cal: Calibration | None) -> StepFit | None:
    """The calibration's fit for this candidate's layout, when it asks for one and it was observed."""
    if cal is None or CALIBRATED not in (c.step_model, c.model):
        return None
    return cal.fit_for(c.tp, c.pp, c.expert_parallel)


def unobserved_layout(c: Candidate, cal: Calibration | None) -> bool:
    """The candidate asks for the calibration but its layout was never observed in it."""
    return cal is not None and CALIBRATED in (c.step_model, c.model) and observed_fit(c, cal) is None


def _calibrated_cost(c: Candidate, cal: Calibration | None) -> StepCost | None:
    fit = observed_fit(c, cal)
    if fit is None and c.model == CALIBRATED and unobserved_layout(c, cal):
        assert cal is not None
        observed = ", ".join(f"TP={tp}" for tp in cal.observed_tp)
        raise CandidateError(
            f"candidate {c.name!r} ({c.layout()}): this layout was never observed in the calibration "
            f"(observed: {observed}, one stage, no expert parallelism) and a calibrated engine has no "
            "roofline to time it by"
        )
    return None if fit is None else fit.cost


def _engine_admission(admission: str) -> str:
    return admission if admission in ("reserve_max_tokens", "quantile_budget") else "none"


_FIELDS = {f.name: f for f in dataclasses.fields(Candidate)}


def candidate_from_mapping(data: object, source: str = "candidate") -> Candidate:
    if not isinstance(data, dict):
        raise CandidateError(f"{source}: expected a mapping of candidate keys ({', '.join(_FIELDS)})")
    unknown = sorted(str(key) for key in data if key not in _FIELDS)  # YAML keys may be numbers
    if unknown:
        raise CandidateError(f"{source}: unknown key(s) {', '.join(unknown)} (known: {', '.join(_FIELDS)})")
    values: dict[str, Any] = {}  # each value checked against its field's type below
    for key, raw in data.items():
        default = _FIELDS[key].default
        if raw is None and default is None:  # an optional key (its default is null) left unset
            values[key] = None
            continue
        kind = type(default) if default is not None else int
        value = finite(raw) if kind is float else raw  # an int is a float; NaN, inf and 1e400 are not
        if value is None or not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
            raise CandidateError(f"{source}.{key}: expected {kind.__name__}, got {quoted(raw)}")
        values[key] = value
    candidate = Candidate(**values)
    candidate.validate()
    return candidate


def load_candidate(path: str | Path) -> Candidate:
    try:
        data = safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise CandidateError(f"cannot read candidate {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise CandidateError(f"{path}: not YAML: {exc}") from None
    return candidate_from_mapping(data, str(path))
