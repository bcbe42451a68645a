"""GPU metrics on /metrics (catalog area "gpu"), rendered from ``NodeState.gpus`` at scrape time.

Only the last poll's GPUs appear, so a GPU that vanished (or all of them, while NVML is down)
drops out instead of going stale. A lost GPU exports its identity, ``kvwatch_gpu_lost 1`` and its
XID counts (XID 79 is usually why it was lost), nothing else. Also here: which GPUs each replica
runs on (``kvwatch_replica_gpu_info``) and the derived link bandwidth, which needs only the sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric

from kvwatch.catalog import CATALOG, MetricSpec, spec_rows
from kvwatch.config import Config
from kvwatch.derive.pcie import link_bytes_per_second
from kvwatch.export.families import (
    GPU_CLOCK_EVENT_ACTIVE,
    GPU_INFO,
    GPU_LOST,
    GPU_NVLINK_ACTIVE,
    GPU_NVLINK_RX_BYTES,
    GPU_NVLINK_TX_BYTES,
    GPU_NVML_ERRORS,
    GPU_PCIE_LINK_MAX_BYTES_PER_SECOND,
    GPU_PROCESS_MEMORY_BYTES,
    GPU_XID_ERRORS,
    REPLICA_GPU,
)
from kvwatch.export.profile import FOLDED, is_lean
from kvwatch.model import GpuSample
from kvwatch.state import NodeState

_FAMILY_ORDER = {s.name: i for i, s in enumerate(CATALOG)}

#: plain per-GPU families: (family, GpuSample attribute)
_SCALARS: tuple[tuple[MetricSpec, str], ...] = spec_rows(
    ("kvwatch_gpu_memory_total_bytes", "memory_total_bytes"),
    ("kvwatch_gpu_memory_used_bytes", "memory_used_bytes"),
    ("kvwatch_gpu_memory_reserved_bytes", "memory_reserved_bytes"),
    ("kvwatch_gpu_memory_free_bytes", "memory_free_bytes"),
    ("kvwatch_gpu_utilization_ratio", "utilization_gpu_ratio"),
    ("kvwatch_gpu_memory_utilization_ratio", "utilization_memory_ratio"),
    ("kvwatch_gpu_pcie_tx_bytes", "pcie_tx_bytes_total"),
    ("kvwatch_gpu_pcie_rx_bytes", "pcie_rx_bytes_total"),
    ("kvwatch_gpu_pcie_replays", "pcie_replay_total"),
    ("kvwatch_gpu_pcie_link_generation", "pcie_link_gen_current"),
    ("kvwatch_gpu_pcie_link_generation_max", "pcie_link_gen_max"),
    ("kvwatch_gpu_pcie_link_width", "pcie_link_width_current"),
    ("kvwatch_gpu_pcie_link_width_max", "pcie_link_width_max"),
    ("kvwatch_gpu_power_watts", "power_watts"),
    ("kvwatch_gpu_power_limit_watts", "power_limit_watts"),
    ("kvwatch_gpu_energy_joules", "energy_joules_total"),
    ("kvwatch_gpu_row_remap_pending", "remap_pending"),
    ("kvwatch_gpu_row_remap_failure", "remap_failure"),
)
#: per-GPU families with one extra label: (family, (label value, GpuSample attribute))
_LABELLED: tuple[tuple[MetricSpec, tuple[str, str]], ...] = spec_rows(
    ("kvwatch_gpu_temperature_celsius", ("gpu", "temperature_gpu_celsius")),
    ("kvwatch_gpu_temperature_celsius", ("memory", "temperature_memory_celsius")),
    ("kvwatch_gpu_clock_hertz", ("sm", "sm_clock_hz")),
    ("kvwatch_gpu_clock_hertz", ("memory", "memory_clock_hz")),
    ("kvwatch_gpu_ecc_errors", ("corrected", "ecc_corrected_volatile_total")),
    ("kvwatch_gpu_ecc_errors", ("uncorrected", "ecc_uncorrected_volatile_total")),
    ("kvwatch_gpu_remapped_rows", ("correctable", "remapped_rows_correctable")),
    ("kvwatch_gpu_remapped_rows", ("uncorrectable", "remapped_rows_uncorrectable")),
)


class _Families:
    """Families created on first sample, yielded in catalog order; empty ones are left out."""

    def __init__(self) -> None:
        self._families: dict[str, Any] = {}

    def add(self, family: MetricSpec, labels: list[str], value: float | bool | None) -> None:
        if value is None:
            return
        metric = self._families.get(family.name)
        if metric is None:
            metric = self._families[family.name] = getattr(family, family.kind)()
        metric.add_metric(labels, float(value))

    def info(self, family: MetricSpec, labels: list[str]) -> None:
        metric = self._families.get(family.name)
        if metric is None:
            metric = self._families[family.name] = family.info()
        metric.add_metric(labels, {})

    def __iter__(self) -> Iterator[Metric]:
        return iter(sorted(self._families.values(), key=lambda f: _FAMILY_ORDER[f.name]))


class GpuCollector:
    """Every "gpu" family of the catalog, plus kvwatch_replica_gpu and the link bandwidth."""

    def __init__(self, state: NodeState, config: Config | None = None) -> None:
        self.state = state
        self.config = config

    def collect(self) -> Iterator[Metric]:
        state = self.state
        out = _Families()
        gpus = state.gpus
        pid_replica = dict(state.pid_replica)
        driver = state.driver_version or ""
        owners = dict(state.gpu_owners)
        idents = {}
        for gpu in gpus:
            ident = idents[(str(gpu.index), gpu.uuid)] = [
                str(gpu.index),
                gpu.uuid,
                *owners.get(gpu.uuid, ("", "", "")),
            ]
            out.info(GPU_INFO, [*ident, gpu.name or "", gpu.pci_bus_id or "", driver])
            out.add(GPU_LOST, ident, gpu.lost)
            if not gpu.lost:
                _gpu_readings(out, gpu, ident, pid_replica, per_link=not is_lean(self.config))
        for (index, uuid, xid), count in sorted(dict(state.xid_counts).items()):
            if (index, uuid) in idents:
                out.add(GPU_XID_ERRORS, [*idents[(index, uuid)], str(xid)], count)
        for labels, value in sorted(state.counters_for(GPU_NVML_ERRORS.name)):
            out.add(GPU_NVML_ERRORS, list(labels), value)
        for replica, mapped in sorted(state.replica_gpus.items()):
            for index, uuid, mapped_by in mapped:
                out.info(REPLICA_GPU, [replica, "", index, uuid, mapped_by])
        yield from out


def _gpu_readings(
    out: _Families, gpu: GpuSample, ident: list[str], pid_replica: dict[int, str], per_link: bool
) -> None:
    for family, attr in _SCALARS:
        out.add(family, ident, getattr(gpu, attr))
    for family, (label, attr) in _LABELLED:
        out.add(family, [*ident, label], getattr(gpu, attr))
    out.add(
        GPU_PCIE_LINK_MAX_BYTES_PER_SECOND,
        ident,
        link_bytes_per_second(gpu.pcie_link_gen_current, gpu.pcie_link_width_current),
    )
    if per_link:
        for link in gpu.nvlinks:
            labels = [*ident, str(link.link)]
            out.add(GPU_NVLINK_ACTIVE, labels, link.active)
            out.add(GPU_NVLINK_TX_BYTES, labels, link.tx_bytes_total)
            out.add(GPU_NVLINK_RX_BYTES, labels, link.rx_bytes_total)
    elif gpu.nvlinks:  # metrics.profile lean: one series per GPU, summed over all its links
        labels = [*ident, FOLDED]
        out.add(GPU_NVLINK_ACTIVE, labels, _link_sum(gpu, "active"))
        out.add(GPU_NVLINK_TX_BYTES, labels, _link_sum(gpu, "tx_bytes_total"))
        out.add(GPU_NVLINK_RX_BYTES, labels, _link_sum(gpu, "rx_bytes_total"))
    for reason, active in gpu.clock_event_reasons:
        out.add(GPU_CLOCK_EVENT_ACTIVE, [*ident, reason], active)
    for proc in gpu.processes:
        out.add(
            GPU_PROCESS_MEMORY_BYTES,
            [*ident, str(proc.pid), pid_replica.get(proc.pid, "")],
            proc.used_memory_bytes,
        )


def _link_sum(gpu: GpuSample, attr: str) -> float | None:
    """A reading summed over all the GPU's links; None (left out this poll) unless every link gave it.

    A sum over only the links that answered would drop when one link's read fails once, which
    Prometheus takes for a counter reset (``increase()`` then counts the whole total again); a poll
    without the series is a gap instead. ``gpu.nvlinks`` holds every link NVML counts, answered or
    not, so a link whose counter never answers leaves the folded series out: ``full`` has the rest.
    """
    values = [getattr(link, attr) for link in gpu.nvlinks]
    if not values or any(v is None for v in values):
        return None
    return float(sum(values))
