"""The status view as formatted tables: the one place its numbers become text.

The HTML page, its ``/status.json`` live updates and the terminal renderer all show these cells,
so a value reads the same everywhere. Every row has a stable key (``replica:r0:rank0``) and every
cell an id (``<row key>/<column>``) the page's script uses to update it in place.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch import humanize as h
from kvwatch.status.view import ALL, BandView, GpuView, ReplicaView, StatusView, UnitView

_ERROR_CHARS = 60  # a down replica's error, cut to keep its row readable


@dataclass(frozen=True, slots=True)
class Row:
    key: str
    cells: tuple[str, ...]
    #: KV bar of a replica row: (allocated share of capacity, live share of capacity), 0..1
    bar: tuple[float, float] | None = None
    alert: bool = False  # down, lost, full: shown emphasised


@dataclass(frozen=True, slots=True)
class Table:
    key: str
    title: str
    headers: tuple[str, ...]
    rows: tuple[Row, ...]
    bar_column: int | None = None  # column whose cell gets the KV bar
    left: int = 1  # leading columns that are names (left-aligned in text)


def _share(part: float | None, whole: float | None) -> float:
    if part is None or not whole or whole <= 0:
        return 0.0
    return max(0.0, min(part / whole, 1.0))


def _headroom(unit: UnitView) -> str:
    text = h.seconds(unit.headroom_seconds)
    return f"{text} ({unit.headroom_note})" if unit.headroom_note else text


def _unit_key(replica: ReplicaView, unit: UnitView) -> str:
    """A row's id on the page: replica and rank, and the model where the replica has several units of
    one rank (a Dynamo frontend serves one per model), or the page's updates would cross rows."""
    key = f"replica:{replica.name}:{unit.dp_rank or '-'}"
    if sum(1 for other in replica.units if other.dp_rank == unit.dp_rank) > 1:
        key += f":{unit.model_name or '-'}"
    return key


def _unit_row(replica: ReplicaView, unit: UnitView) -> Row:
    name = replica.name if unit.dp_rank is None else f"{replica.name}/{unit.dp_rank}"
    used = (
        unit.kv_usage_ratio
        if unit.kv_usage_ratio is not None
        else (_share(unit.kv_allocated_tokens, unit.kv_capacity_tokens) if unit.kv_capacity_tokens else None)
    )
    estimated = " est" if unit.live_source == "proxy_estimate" else ""
    live = h.si(unit.live_tokens) + estimated
    frag = h.ratio(unit.fragmentation_ratio) + estimated  # computed from the live tokens
    # several DP ranks behind one proxy: its estimate is the replica's, shown on each rank's row
    if unit.live_tokens is None and replica.live_tokens_estimate is not None:
        live = h.si(replica.live_tokens_estimate) + " est"
    if unit.fragmentation_ratio is None and replica.fragmentation_estimate is not None:
        frag = h.ratio(replica.fragmentation_estimate) + " est"
    preempt = h.si(unit.preemptions_per_second, 2)
    if unit.preemptions_per_second is not None:
        preempt += "/s"
    cells = (
        name,
        replica.backend,
        unit.model_name or h.MISSING,
        "up",
        h.ratio(used),
        h.si(unit.kv_capacity_tokens),
        live,
        frag,
        _headroom(unit),
        h.si(unit.requests_running),
        h.si(unit.requests_waiting),
        preempt,
        h.count(unit.preemptions_total),
        str(replica.requests_in_flight),
    )
    bar = (
        _share(unit.kv_allocated_tokens, unit.kv_capacity_tokens)
        if unit.kv_allocated_tokens is not None
        else (used or 0.0),
        _share(unit.live_tokens, unit.kv_capacity_tokens),
    )
    full = unit.headroom_seconds == 0 or (used is not None and used >= 0.99)
    return Row(_unit_key(replica, unit), cells, bar, alert=full)


def replica_table(view: StatusView) -> Table:
    rows = []
    for replica in view.replicas:
        if not replica.up or not replica.units:
            why = replica.last_error or "no samples"
            if len(why) > _ERROR_CHARS:
                why = why[: _ERROR_CHARS - 3] + "..."
            cells = (
                replica.name,
                replica.backend,
                h.MISSING,
                f"DOWN: {why}",
                *([h.MISSING] * 9),
                str(replica.requests_in_flight),
            )
            rows.append(Row(f"replica:{replica.name}:-", cells, (0.0, 0.0), alert=True))
            continue
        rows += [_unit_row(replica, unit) for unit in replica.units]
    headers = (
        "replica",
        "backend",
        "model",
        "state",
        "KV used",
        "KV capacity",
        "live tokens",
        "fragment.",
        "headroom",
        "running",
        "waiting",
        "preempt",
        "preempt total",
        "in flight",
    )
    return Table("replicas", "Replicas: KV cache", headers, tuple(rows), bar_column=4, left=4)


def stranded_table(view: StatusView) -> Table:
    rows = tuple(
        Row(
            f"stranded:{s.model_name}",
            (s.model_name, h.si(s.stranded_tokens), str(s.idle_units), str(s.pressured_units)),
            alert=s.stranded_tokens > 0,
        )
        for s in view.stranded
    )
    return Table(
        "stranded",
        "Stranded KV capacity (free on idle replicas while another queues or preempts)",
        ("model", "stranded tokens", "idle units", "pressured units"),
        rows,
    )


def _band_row(b: BandView) -> Row:
    o = b.outcomes
    cells = (
        "all" if b.replica == ALL else b.replica,
        b.band,
        h.count(b.requests),
        h.seconds(b.ttft_p50_seconds),
        h.seconds(b.ttft_p99_seconds),
        h.seconds(b.tpot_p50_seconds),
        h.seconds(b.tpot_p99_seconds),
        h.seconds(b.e2e_p50_seconds),
        h.seconds(b.e2e_p99_seconds),
        h.ratio(b.completed_ratio),
        h.ratio(b.truncated_ratio),
        h.ratio(b.aborted_ratio),
        h.count(o.get("error", 0)),
        h.count(o.get("rejected", 0)),
    )
    return Row(f"band:{b.replica}:{b.band}", cells)


def band_table(view: StatusView) -> Table:
    headers = (
        "replica",
        "band",
        "requests",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "e2e p50",
        "e2e p99",
        "completed",
        "truncated",
        "aborted",
        "errors",
        "rejected",
    )
    return Table(
        "bands",
        "Latency and outcomes by output-length band (since agent start)",
        headers,
        tuple(_band_row(b) for b in view.band_rows),
        left=2,
    )


def _link(g: GpuView) -> str:
    if g.pcie_link_generation is None or g.pcie_link_width is None:
        return h.MISSING
    text = f"gen{g.pcie_link_generation} x{g.pcie_link_width}"
    if g.pcie_link_generation_max is not None and g.pcie_link_width_max is not None:
        text += f" (max gen{g.pcie_link_generation_max} x{g.pcie_link_width_max})"
    return text


def _gpu_row(g: GpuView) -> Row:
    if g.lost:
        cells = (str(g.index), g.name or h.MISSING, "LOST", *([h.MISSING] * 6), ", ".join(g.replicas))
        return Row(f"gpu:{g.uuid}", cells, alert=True)
    memory = f"{h.nbytes(g.memory_used_bytes)} / {h.nbytes(g.memory_total_bytes)}"
    state = "down-trained" if g.pcie_down_trained else "ok"
    cells = (
        str(g.index),
        g.name or h.MISSING,
        state,
        memory,
        h.ratio(_share(g.memory_used_bytes, g.memory_total_bytes) if g.memory_total_bytes else None),
        h.ratio(g.utilization_ratio, 0),
        h.rate_bytes(g.pcie_tx_bytes_per_second),
        h.rate_bytes(g.pcie_rx_bytes_per_second),
        _link(g),
        ", ".join(g.replicas) or h.MISSING,
    )
    return Row(f"gpu:{g.uuid}", cells, alert=bool(g.pcie_down_trained))


def gpu_table(view: StatusView) -> Table:
    headers = ("gpu", "name", "state", "memory", "mem used", "util", "PCIe tx", "PCIe rx", "link", "replicas")
    return Table("gpus", "GPUs: memory and PCIe", headers, tuple(_gpu_row(g) for g in view.gpus), left=3)


def tables(view: StatusView) -> list[Table]:
    """Every section, in page order; empty sections are kept (their title says there is nothing)."""
    return [replica_table(view), stranded_table(view), band_table(view), gpu_table(view)]


def summary_line(view: StatusView) -> str:
    stamp = h.utc(view.generated_at)
    up = sum(1 for r in view.replicas if r.up)
    uptime = h.seconds(view.generated_at - view.agent_started_at)
    return (
        f"kvwatch {view.node}  {stamp}  replicas up {up}/{len(view.replicas)}  "
        f"requests seen {view.requests_observed:,}  agent up {uptime}"
    )


@dataclass(frozen=True, slots=True)
class Display:
    """What the page's script updates in place; ``layout`` changes when rows or columns come or go
    (the page then reloads instead of patching)."""

    cells: dict[str, str]  # cell id -> text
    bars: dict[str, tuple[float, float]]  # row key -> KV bar (allocated, live)
    alerts: tuple[str, ...]  # row keys shown emphasised
    layout: str


def display(view: StatusView) -> Display:
    cells: dict[str, str] = {"summary": summary_line(view)}
    bars: dict[str, tuple[float, float]] = {}
    alerts = []
    built = tables(view)
    layout = [table.key + ":" + ",".join(r.key for r in table.rows) for table in built]
    layout.append("notes:" + "\n".join(view.notes))  # not cells: a note that comes or goes reloads
    for table in built:
        for row in table.rows:
            for i, text in enumerate(row.cells):
                cells[f"{row.key}/{i}"] = text
            if row.bar is not None:
                bars[row.key] = row.bar
            if row.alert:
                alerts.append(row.key)
    return Display(cells, bars, tuple(alerts), "|".join(layout))
