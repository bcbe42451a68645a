"""Glue the agent schedules: NVML poll -> NodeState, /proc + NVML -> replica GPU mapping.

Wiring (the agent layer, like ``kvwatch/agent/derived.py``): the one writer of ``NodeState.gpus``,
``driver_version``, ``xid_counts``, ``replica_gpus`` and ``pid_replica``. Each function does one
refresh and stores whole new values (never a partial update), except ``xid_counts``: the XID
thread adds one count at a time. They block on NVML and /proc, so the
agent runs them in a thread executor every ``intervals.gpu`` and ``intervals.process_map``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvwatch.config import Config, NvmlConfig
from kvwatch.derive.gpu_mapping import (
    MIG_PREFIX,
    GpuMapping,
    GpuRef,
    ReplicaTarget,
    attributable_grants,
    gpu_owners,
    map_replicas,
)
from kvwatch.gpu.nvml import NvmlCollector, NvmlLibrary, PollReport
from kvwatch.gpu.processes import ProcessTree, ProcReader, read_pid_file
from kvwatch.model import ProcessInfo
from kvwatch.state import NodeState

log = logging.getLogger(__name__)

COLLECTOR = "nvml"
NVML_ERRORS = "kvwatch_gpu_nvml_errors"


def nvml_backend(config: NvmlConfig) -> NvmlLibrary | None:
    """The NVML module to use: None when disabled, a FakeNvml for ``fake_gpus``, else pynvml."""
    if not config.enabled:
        return None
    if config.fake_gpus:
        from kvwatch.gpu.fake import FakeNvml

        return FakeNvml(config.fake_gpus)
    import pynvml

    return pynvml


def refresh_gpu_state(collector: NvmlCollector, state: NodeState, now: float | None = None) -> PollReport:
    """Poll every GPU once; replace ``state.gpus``; report collector success and count errors.

    While NVML is unavailable ``state.gpus`` becomes empty, so no GPU value is served as fresh.
    """
    started = time.perf_counter()
    samples = collector.poll()
    report = collector.report
    state.gpus = tuple(samples)
    state.driver_version = collector.driver_version()
    for call, error in report.call_errors:
        state.count(NVML_ERRORS, call, error)
    state.report(COLLECTOR, report.success, time.perf_counter() - started, report.error, now=now)
    return report


def xid_recorder(state: NodeState) -> Callable[[int, str, int], None]:
    """The ``on_xid`` callback for ``XidWatcher``: one counter per (GPU, XID code)."""

    def on_xid(index: int, uuid: str, xid: int) -> None:
        state.xid_counts[(str(index), uuid, int(xid))] += 1
        log.warning("GPU %d (%s): XID %d", index, uuid, xid)

    return on_xid


def replica_targets(
    config: Config, notes: list[str], granted: dict[str, tuple[str, ...]] | None = None
) -> list[ReplicaTarget]:
    """Configured replicas with their engine PID (``pid``, else read from ``pid_file`` now) and the
    devices the kubelet granted to the pod a discovered replica (``namespace/pod``) is."""
    granted = granted or {}
    targets = []
    for i, rep in enumerate(config.replicas):
        pid = rep.pid
        if pid is None and rep.pid_file:
            try:
                pid = read_pid_file(rep.pid_file)
            except ValueError as exc:
                notes.append(f"replicas[{i}].pid_file ({rep.name}): {exc}")
        targets.append(ReplicaTarget(rep.name, rep.gpus, pid, granted.get(rep.name, ())))
    return targets


def refresh_mapping(
    config: Config,
    state: NodeState,
    proc: ProcessTree | None = None,
    seen_notes: set[str] | None = None,
    mig_parent: Callable[[str], str | None] | None = None,
) -> GpuMapping:
    """Recompute replica -> GPUs and pid -> replica from config, /proc and the last NVML poll.

    Notes (a missing PID, an unknown GPU in config, ...) are logged once each while they persist
    when the caller keeps ``seen_notes`` between calls. ``mig_parent`` names the GPU a ``MIG-``
    device belongs to (``NvmlCollector.mig_parent``).
    """
    proc = proc or ProcReader()
    notes: list[str] = []
    gpus = [g for g in state.gpus if g.uuid != "unknown"]
    inventory = [GpuRef(g.index, g.uuid) for g in gpus]
    parents = {}
    if mig_parent is not None:
        for grant in state.gpu_grants:
            if grant.device_id.upper().startswith(MIG_PREFIX) and grant.device_id not in parents:
                parent = mig_parent(grant.device_id)
                if parent is not None:
                    parents[grant.device_id] = parent
    attribution = attributable_grants(state.gpu_grants, inventory, state.terminal_pods, parents)
    if config.discovery.pod_resources.enabled:
        state.gpu_grants_unattributed = attribution.unattributed
    by_pod: dict[str, list[str]] = {}
    for grant in attribution.grants:
        by_pod.setdefault(f"{grant.namespace}/{grant.pod}", []).append(grant.device_id)
    targets = replica_targets(config, notes, {k: tuple(v) for k, v in by_pod.items()})
    processes: dict[int, ProcessInfo] = {}
    for target in targets:
        if target.pid is not None:
            processes.update(proc.tree(target.pid))
    nvml_pids = {g.uuid: {p.pid for p in g.processes} for g in gpus if not g.lost}
    result = map_replicas(targets, processes, inventory, nvml_pids)
    state.gpu_owners = gpu_owners(attribution.grants, inventory)
    state.replica_gpus = result.replica_gpus
    state.pid_replica = result.pid_replica
    _log_notes([*notes, *result.notes], seen_notes)
    return result


def _log_notes(notes: list[str], seen: set[str] | None) -> None:
    current = set(notes)
    for note in notes:
        if seen is None or note not in seen:
            log.warning("GPU mapping: %s", note)
    if seen is not None:
        seen.clear()
        seen.update(current)
