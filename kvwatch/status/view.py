"""What the status page and ``kvwatch top`` show, as plain data built from the node state.

``build_view(state, config, now)`` reads ``NodeState`` (and the derived KV view the agent keeps in
``state.derived``) and returns a ``StatusView``: frozen dataclasses of numbers and strings, no
formatting. The page renders it as HTML and ``/status.json``; ``kvwatch top`` and ``kvwatch demo``
render it as text. ``view_to_dict`` / ``view_from_dict`` carry it over JSON.

KV values are never recomputed here: pool sizes, live tokens and fragmentation, headroom,
preemption rates, stranded capacity, each GPU's PCIe rates and link state are read from the
derived view (``NodeState.derived``, which the agent computes once after each scrape and /metrics
renders too). Each band's finished requests by outcome, their ratios
(``derive.band_health.band_outcomes``) and latency quantiles (Prometheus' rule,
``derive.quantiles``) come from one snapshot of the request stats, so a row's counts and quantiles
describe the same requests.
Latency and outcomes are cumulative since the agent started. Per replica they come from the proxy
where one fronts it (client-side latency), else from the engine-side sources (OTLP spans, SGLang
request files: ``derive.band_health.chosen_sources``); the ``(all)`` rows add the replicas up.

No prompt or completion text exists in the state, so none can reach a view.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from kvwatch.buckets import Histogram
from kvwatch.config import Config
from kvwatch.derive.band_health import BandOutcomes, band_outcomes, chosen_sources
from kvwatch.derive.fragmentation import Fragmentation
from kvwatch.derive.node import DerivedView, UnitSignals
from kvwatch.derive.quantiles import histogram_quantile
from kvwatch.jsonsafe import NON_FINITE, finite, jsonable
from kvwatch.model import OUTCOMES, ReplicaSample
from kvwatch.state import NodeState

ALL = "(all)"
TTFT = "kvwatch_request_ttft_seconds"
TPOT = "kvwatch_request_tpot_seconds"
E2E = "kvwatch_request_duration_seconds"


@dataclass(frozen=True, slots=True)
class UnitView:
    """One engine unit: a replica, or one data-parallel rank of it."""

    dp_rank: str | None
    model_name: str | None
    kv_usage_ratio: float | None  # as the engine reports it
    kv_capacity_tokens: float | None  # token slots requests can hold
    kv_allocated_tokens: float | None  # slots held by requests (whole blocks)
    kv_free_tokens: float | None
    live_tokens: float | None  # tokens running requests hold
    live_source: str | None  # engine | proxy_estimate
    fragmentation_ratio: float | None
    fragmentation_note: str
    headroom_seconds: float | None  # +inf when idle or not growing
    headroom_note: str
    requests_running: float | None
    requests_waiting: float | None
    preemptions_total: float | None
    preemptions_per_second: float | None
    scraped_at: float


@dataclass(frozen=True, slots=True)
class ReplicaView:
    name: str
    backend: str
    up: bool
    last_error: str | None
    last_success_at: float | None
    units: tuple[UnitView, ...]  # empty while down: nothing stale is shown as current
    #: replica-level proxy estimate when the replica has several DP ranks (the proxy sees one endpoint)
    live_tokens_estimate: float | None = None
    fragmentation_estimate: float | None = None
    requests_in_flight: int = 0  # relayed by the proxy now
    gpus: tuple[str, ...] = ()  # GPU indexes it runs on


@dataclass(frozen=True, slots=True)
class StrandedView:
    model_name: str
    stranded_tokens: float
    idle_units: int
    pressured_units: int


@dataclass(frozen=True, slots=True)
class BandView:
    """Latency quantiles and outcomes of one length band, one replica or ``(all)``."""

    replica: str
    band: str
    requests: int
    outcomes: dict[str, int]
    completed_ratio: float | None
    truncated_ratio: float | None
    aborted_ratio: float | None
    ttft_p50_seconds: float | None
    ttft_p99_seconds: float | None
    tpot_p50_seconds: float | None
    tpot_p99_seconds: float | None
    e2e_p50_seconds: float | None
    e2e_p99_seconds: float | None


@dataclass(frozen=True, slots=True)
class GpuView:
    index: int
    uuid: str
    name: str | None
    lost: bool
    sampled_at: float
    memory_used_bytes: float | None
    memory_total_bytes: float | None
    utilization_ratio: float | None
    pcie_tx_bytes_per_second: float | None
    pcie_rx_bytes_per_second: float | None
    pcie_link_bytes_per_second: float | None  # one direction, as trained
    pcie_link_generation: int | None
    pcie_link_generation_max: int | None
    pcie_link_width: int | None
    pcie_link_width_max: int | None
    pcie_down_trained: bool | None
    replicas: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StatusView:
    node: str
    generated_at: float
    agent_started_at: float
    bands: tuple[str, ...]  # band names in order, unknown last
    replicas: tuple[ReplicaView, ...] = ()
    stranded: tuple[StrandedView, ...] = ()
    band_rows: tuple[BandView, ...] = ()  # (all) first, then per replica, bands in order
    gpus: tuple[GpuView, ...] = ()
    requests_observed: int = 0
    derived_at: float | None = None
    notes: tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------------------------
# building
# --------------------------------------------------------------------------------------------


def derived_of(state: NodeState) -> DerivedView | None:
    """The one accessor for derived KV signals (kept by ``kvwatch.agent.derived.update_derived``)."""
    return state.derived


def build_view(state: NodeState, config: Config, now: float) -> StatusView:
    """The node as the status page shows it at ``now``."""
    derived = derived_of(state)
    replicas = _replicas(state, config, derived)
    notes = []
    if derived is None:
        notes.append("derived KV signals not computed yet (needs a first engine scrape)")
    return StatusView(
        node=state.node,
        generated_at=now,
        agent_started_at=state.started_at,
        bands=state.bands.all_names,
        replicas=replicas,
        stranded=_stranded(derived, replicas),
        band_rows=_band_rows(state),
        gpus=_gpus(state, derived),
        requests_observed=state.requests.observed,
        derived_at=derived.computed_at if derived is not None else None,
        notes=tuple(notes),
    )


def _replica_names(state: NodeState, config: Config) -> list[str]:
    names = [r.name for r in config.replicas]
    return names + sorted(n for n in list(state.targets) if n not in names)


def _replicas(state: NodeState, config: Config, derived: DerivedView | None) -> tuple[ReplicaView, ...]:
    frag = {(f.replica, f.model_name, f.dp_rank): f for f in (derived.fragmentation if derived else ())}
    signals = {u.sample.key: u for u in (derived.units if derived else ())}
    in_flight: dict[str, int] = {}
    for request in state.in_flight.current():
        in_flight[request.replica] = in_flight.get(request.replica, 0) + 1
    out = []
    for name in _replica_names(state, config):
        target = state.targets.get(name)
        if target is None:  # configured, never scraped yet
            cfg = config.replica(name)
            out.append(
                ReplicaView(
                    name,
                    cfg.backend if cfg else "unknown",
                    False,
                    "not scraped yet",
                    None,
                    (),
                    requests_in_flight=in_flight.get(name, 0),
                )
            )
            continue
        samples = target.samples if target.up else ()
        units = tuple(_unit(s, frag.get(s.key), signals.get(s.key)) for s in samples)
        estimate = frag.get((name, samples[0].model_name, None)) if len(samples) > 1 else None
        gpus = tuple(index for index, _uuid, _by in state.replica_gpus.get(name, ()))
        out.append(
            ReplicaView(
                name,
                target.backend,
                target.up,
                target.last_error,
                target.last_success_ts,
                units,
                live_tokens_estimate=estimate.live_tokens if estimate else None,
                fragmentation_estimate=estimate.ratio if estimate else None,
                requests_in_flight=in_flight.get(name, 0),
                gpus=gpus,
            )
        )
    return tuple(out)


def _unit(sample: ReplicaSample, frag: Fragmentation | None, signals: UnitSignals | None) -> UnitView:
    headroom = signals.headroom if signals is not None else None
    return UnitView(
        dp_rank=sample.dp_rank,
        model_name=sample.model_name,
        kv_usage_ratio=sample.kv_usage_ratio,
        kv_capacity_tokens=signals.usable_tokens if signals else None,
        kv_allocated_tokens=signals.allocated_tokens if signals else None,
        kv_free_tokens=signals.free_tokens if signals else None,
        live_tokens=frag.live_tokens if frag else None,
        live_source=frag.source if frag else None,
        fragmentation_ratio=frag.ratio if frag else None,
        fragmentation_note=frag.note if frag else "",
        headroom_seconds=headroom.seconds if headroom else None,
        headroom_note=headroom.note if headroom else "",
        requests_running=sample.requests_running,
        requests_waiting=sample.requests_waiting,
        preemptions_total=sample.preemptions_total,
        preemptions_per_second=signals.preemptions_per_second if signals else None,
        scraped_at=sample.scraped_at,
    )


def _stranded(derived: DerivedView | None, replicas: tuple[ReplicaView, ...]) -> tuple[StrandedView, ...]:
    """Stranded capacity per model, only for models a replica that is up still serves."""
    if derived is None:
        return ()
    served = {u.model_name for r in replicas if r.up for u in r.units}
    return tuple(
        StrandedView(s.model_name, s.stranded_tokens, s.idle_units, s.pressured_units)
        for s in sorted(derived.stranded, key=lambda s: s.model_name)
        if s.model_name in served
    )


def _band_rows(state: NodeState) -> tuple[BandView, ...]:
    """Outcomes, their ratios and latency quantiles, all from one snapshot of the request stats: a
    row's counts and its quantiles describe the same requests, also just after a burst ended."""
    hists, outcomes, _estimated = state.requests.snapshot()
    chosen = chosen_sources((*hists, *outcomes))
    merged: dict[tuple[str, str], dict[str, Histogram]] = {}
    for (replica, _model, band, source), families in hists.items():
        if source not in chosen.get(replica, ()):
            continue
        for group in ((replica, band), (ALL, band)):
            target = merged.setdefault(group, {})
            for name in (TTFT, TPOT, E2E):
                _add(target, name, families[name])
    bands = band_outcomes(outcomes)
    replicas = sorted(
        {replica for replica, _band in merged if replica != ALL}
        | {replica for replica, _band in bands if replica is not None}
    )
    rows = []
    for replica in (ALL, *replicas):
        for band in state.bands.all_names:
            finished = bands.get((None if replica == ALL else replica, band))
            latency = merged.get((replica, band))
            if finished is None and latency is None:
                continue
            rows.append(_band_view(replica, band, latency or {}, finished))
    return tuple(rows)


def _add(target: dict[str, Histogram], name: str, hist: Histogram) -> None:
    total = target.get(name)
    if total is None:
        total = target[name] = Histogram(hist.bounds)
    total.merge_bins(hist.bounds, hist.bins, hist.sum)


def _quantile(families: Mapping[str, Histogram], name: str, q: float) -> float | None:
    hist = families.get(name)
    if hist is None or hist.count == 0:
        return None
    value = histogram_quantile(q, hist.bounds, hist.bins)
    return None if math.isnan(value) else value


def _band_view(
    replica: str, band: str, families: Mapping[str, Histogram], finished: BandOutcomes | None
) -> BandView:
    by_outcome = dict.fromkeys(OUTCOMES, 0)
    for outcome, n in finished.counts.items() if finished else ():
        by_outcome[outcome] = int(n)
    health = finished.health if finished else None
    return BandView(
        replica=replica,
        band=band,
        requests=sum(by_outcome.values()),
        outcomes=by_outcome,
        completed_ratio=health.completed_ratio if health else None,
        truncated_ratio=health.truncated_ratio if health else None,
        aborted_ratio=health.aborted_ratio if health else None,
        ttft_p50_seconds=_quantile(families, TTFT, 0.5),
        ttft_p99_seconds=_quantile(families, TTFT, 0.99),
        tpot_p50_seconds=_quantile(families, TPOT, 0.5),
        tpot_p99_seconds=_quantile(families, TPOT, 0.99),
        e2e_p50_seconds=_quantile(families, E2E, 0.5),
        e2e_p99_seconds=_quantile(families, E2E, 0.99),
    )


def _gpus(state: NodeState, derived: DerivedView | None) -> tuple[GpuView, ...]:
    owners: dict[str, list[str]] = {}
    for replica, mapped in state.replica_gpus.items():
        for _index, uuid, _by in mapped:
            owners.setdefault(uuid, []).append(replica)
    links = {link.uuid: link for link in (derived.gpu_links if derived is not None else ())}
    out = []
    for gpu in sorted(state.gpus, key=lambda g: g.index):
        link = None if gpu.lost else links.get(gpu.uuid)
        out.append(
            GpuView(
                index=gpu.index,
                uuid=gpu.uuid,
                name=gpu.name,
                lost=gpu.lost,
                sampled_at=gpu.sampled_at,
                memory_used_bytes=gpu.memory_used_bytes,
                memory_total_bytes=gpu.memory_total_bytes,
                utilization_ratio=gpu.utilization_gpu_ratio,
                pcie_tx_bytes_per_second=link.tx_bytes_per_second if link else None,
                pcie_rx_bytes_per_second=link.rx_bytes_per_second if link else None,
                pcie_link_bytes_per_second=link.link_bytes_per_second if link else None,
                pcie_link_generation=gpu.pcie_link_gen_current,
                pcie_link_generation_max=gpu.pcie_link_gen_max,
                pcie_link_width=gpu.pcie_link_width_current,
                pcie_link_width_max=gpu.pcie_link_width_max,
                pcie_down_trained=link.down_trained if link else None,
                replicas=tuple(sorted(owners.get(gpu.uuid, ()))),
            )
        )
    return tuple(out)


# --------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------


def view_to_dict(view: StatusView) -> dict[str, Any]:
    """The view as strict JSON data (``json.dumps(..., allow_nan=False)`` accepts it)."""
    return jsonable(asdict(view))


if TYPE_CHECKING:  # the type dataclasses.fields() takes
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def _build(cls: type[T], data: Mapping[str, Any]) -> T:
    if not isinstance(data, Mapping):
        raise ValueError(f"a {cls.__name__} must be an object, got {type(data).__name__}")
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        kwargs[f.name] = _field_value(f.name, str(f.type), data[f.name])
    return cls(**kwargs)


_NESTED = {
    "UnitView": UnitView,
    "ReplicaView": ReplicaView,
    "StrandedView": StrandedView,
    "BandView": BandView,
    "GpuView": GpuView,
}
#: the JSON type each other scalar annotation of the view takes (a bool is no int)
_SCALARS: dict[str, type] = {"int": int, "str": str, "bool": bool}


def _field_value(name: str, annotation: str, value: Any) -> Any:
    """A field's JSON value as the view holds it; ValueError naming the field when it is of another
    type (an agent of another version, or not an agent), so that nothing fails later, mid-render."""
    for nested, cls in _NESTED.items():
        if annotation == f"tuple[{nested}, ...]":
            if not isinstance(value, list):
                raise ValueError(f"{name} must be a list")
            return tuple(_build(cls, item) for item in value)
    base, _, optional = annotation.partition(" | ")
    if value is None and optional == "None":
        return None
    if base == "float" and isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    if base == "float" and (number := finite(value)) is not None:  # not bool, not 1 and 400 zeros
        return number
    if base in _SCALARS:
        if isinstance(value, bool) != (base == "bool") or not isinstance(value, _SCALARS[base]):
            raise ValueError(f"{name} must be a {base}, got {type(value).__name__}")
        return value
    if annotation == "tuple[str, ...]" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    if (
        annotation == "dict[str, int]"
        and isinstance(value, dict)
        and all(type(v) is int for v in value.values())
    ):
        return value
    raise ValueError(f"{name} must be a {annotation}, got {type(value).__name__}")


def view_from_dict(data: Mapping[str, Any]) -> StatusView:
    """Rebuild a view from ``view_to_dict`` output (what ``/status.json`` serves as ``view``)."""
    if not isinstance(data, Mapping) or "node" not in data:
        raise ValueError("not a kvwatch status view (expected an object with node, replicas, ...)")
    return _build(StatusView, data)
