"""Which GPUs each replica runs on, and which replica each GPU process belongs to. Pure.

Order of evidence, first that yields a GPU wins (docs/nvml.md):

1. ``config``: the replica's ``gpus`` list (indexes or UUIDs). The operator knows best.
2. ``pod_resources``: the kubelet allocated the GPU to one of the replica's pod's containers (the
   PodResources API; Kubernetes discovery names a replica ``namespace/pod``). Device ids are GPU
   UUIDs, indexes, ``UUID::N`` (time-sliced replicas) or ``nvidiaN`` (GKE), as dcgm-exporter reads them.
3. ``pid``: NVML lists the engine PID, or any descendant (vLLM TP/DP workers are child processes),
   among a GPU's compute processes. NVML may report host PIDs or namespaced PIDs depending on the call
   and driver, so a process matches by its PID in kvwatch's namespace first and, only if
   nothing matched that way, by the PIDs of its ``NSpid`` chain inside its container.
4. ``cuda_visible_devices``: the GPUs the engine's processes may use, from ``CUDA_VISIBLE_DEVICES``
   (indexes or UUID prefixes, interpreted within ``NVIDIA_VISIBLE_DEVICES`` when the container runtime
   restricted it). Weakest: visible is not used. ``NVIDIA_VISIBLE_DEVICES=all`` (set by NGC images)
   says nothing and is ignored. MIG ids are ignored with a note.

Grants from the kubelet go through ``attributable_grants`` first: terminal pods, stale duplicates
and DRA devices are left out (counted), MIG devices stand for the GPU they were carved from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from kvwatch.model import GpuGrant, ProcessInfo


@dataclass(frozen=True, slots=True)
class ReplicaTarget:
    name: str
    gpus: tuple[str, ...] = ()  # from config: GPU indexes or UUIDs
    pid: int | None = None  # engine PID in kvwatch's PID namespace, when known
    granted: tuple[str, ...] = ()  # device ids the kubelet allocated to the replica's pod


@dataclass(frozen=True, slots=True)
class GpuRef:
    index: int
    uuid: str


@dataclass(frozen=True, slots=True)
class GpuMapping:
    #: replica -> ((gpu index, uuid, mapped_by), ...) in GPU index order (NodeState.replica_gpus)
    replica_gpus: dict[str, tuple[tuple[str, str, str], ...]]
    #: pid as NVML may report it -> replica (NodeState.pid_replica)
    pid_replica: dict[int, str]
    #: what could not be used, for one log line each
    notes: tuple[str, ...] = ()


def map_replicas(
    replicas: Sequence[ReplicaTarget],
    processes: Mapping[int, ProcessInfo],
    inventory: Sequence[GpuRef],
    nvml_pids: Mapping[str, Collection[int]],
) -> GpuMapping:
    """Map every replica to its GPUs.

    ``processes``: kvwatch-namespace PID -> info, covering each replica's process tree.
    ``inventory``: the GPUs NVML enumerated (empty when NVML is off: only config then applies).
    ``nvml_pids``: GPU UUID -> PIDs NVML lists as compute processes on it.
    """
    notes: list[str] = []
    replica_gpus: dict[str, tuple[tuple[str, str, str], ...]] = {}
    pid_replica: dict[int, str] = {}
    gpus = sorted(inventory, key=lambda g: g.index)
    for rep in replicas:
        tree = process_tree(rep.pid, processes) if rep.pid is not None else []
        if rep.pid is not None and not tree:
            notes.append(f"replica {rep.name}: process {rep.pid} not found in /proc")
        refs, by, inner_matched = _config_gpus(rep, gpus, notes), "config", False
        if not refs and rep.granted:
            refs, by = _granted_gpus(rep.granted, gpus), "pod_resources"
        if not refs and tree:
            refs, inner_matched = _pid_gpus(tree, gpus, nvml_pids)
            by = "pid"
        if not refs and tree:
            refs, by = _visible_gpus(rep.name, tree, gpus, notes), "cuda_visible_devices"
        if refs:
            replica_gpus[rep.name] = tuple(
                (str(r.index) if r.index >= 0 else "", r.uuid, by)
                for r in sorted(set(refs), key=lambda r: (r.index, r.uuid))
            )
        for proc in tree:
            for pid in proc.all_pids if inner_matched else (proc.pid,):
                owner = pid_replica.setdefault(pid, rep.name)
                if owner != rep.name:
                    notes.append(f"process {pid} belongs to both {owner} and {rep.name}; kept {owner}")
    return GpuMapping(replica_gpus, pid_replica, tuple(notes))


def process_tree(pid: int, processes: Mapping[int, ProcessInfo]) -> list[ProcessInfo]:
    """The process and its descendants present in ``processes``, breadth first."""
    out: list[ProcessInfo] = []
    seen: set[int] = set()
    queue = deque([pid])
    while queue:
        current = queue.popleft()
        info = processes.get(current)
        if info is None or current in seen:
            continue
        seen.add(current)
        out.append(info)
        queue.extend(info.children)
    return out


# ------------------------------------------------------------------------------------------------
# the three kinds of evidence
# ------------------------------------------------------------------------------------------------


def _config_gpus(rep: ReplicaTarget, gpus: Sequence[GpuRef], notes: list[str]) -> list[GpuRef]:
    refs = []
    by_uuid = {g.uuid.lower(): g for g in gpus}
    by_index = {g.index: g for g in gpus}
    for entry in rep.gpus:
        text = entry.strip()
        if text.upper().startswith("MIG-"):
            notes.append(f"replica {rep.name}: gpus entry {text!r} is a MIG device; MIG is not mapped")
        elif text.isdigit():
            ref = by_index.get(int(text))
            if ref is None and gpus:
                notes.append(f"replica {rep.name}: gpus entry {text} is not a GPU index NVML knows")
            refs.append(ref or GpuRef(int(text), ""))
        elif text.upper().startswith("GPU-"):
            ref = by_uuid.get(text.lower())
            if ref is None and gpus:
                notes.append(f"replica {rep.name}: gpus entry {text!r} matches no GPU UUID NVML knows")
            refs.append(ref or GpuRef(-1, text))
        else:
            notes.append(f"replica {rep.name}: gpus entry {text!r} is neither an index nor a GPU- UUID")
    return refs


def resolve_device_id(device_id: str, gpus: Sequence[GpuRef]) -> GpuRef | None:
    """The GPU a device plugin's device id names, or None (MIG instances, unknown ids)."""
    text = device_id.strip().split("::", 1)[0].split("/vgpu", 1)[0]  # time-slicing / GKE sharing suffixes
    if text.lower().startswith("nvidia") and text[6:].isdigit():  # GKE: nvidia0, nvidia1, ...
        text = text[6:]
    if text.isdigit():
        return next((g for g in gpus if g.index == int(text)), None)
    if text.upper().startswith("GPU-"):
        return next((g for g in gpus if g.uuid.lower() == text.lower()), None)
    return None


def _granted_gpus(granted: Sequence[str], gpus: Sequence[GpuRef]) -> list[GpuRef]:
    return [ref for ref in (resolve_device_id(d, gpus) for d in granted) if ref is not None]


#: why a kubelet grant names no GPU (``kvwatch_gpu_grants_unattributed{reason}``)
UNATTRIBUTED = ("terminal_pod", "stale_duplicate", "mig_unresolved", "dra", "unknown_device")
#: pod phases whose containers have all stopped; the kubelet may still list their devices
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
MIG_PREFIX = "MIG-"


@dataclass(frozen=True, slots=True)
class Attribution:
    """The grants that may name a GPU holder (MIG device ids replaced by their GPU's UUID), and how
    many were left out, by reason."""

    grants: tuple[GpuGrant, ...]
    unattributed: dict[str, int]


def mig_parent_in_id(device_id: str) -> str | None:
    """The GPU UUID inside a pre-R470 MIG id, ``MIG-GPU-<uuid>/<gi>/<ci>`` (dcgm-exporter's
    ``getMIGDeviceInfoForOldDriver``); None for any other id."""
    rest = device_id[len(MIG_PREFIX) :] if device_id.upper().startswith(MIG_PREFIX) else ""
    parts = rest.split("/")
    if len(parts) == 3 and parts[0].upper().startswith("GPU-") and parts[1].isdigit() and parts[2].isdigit():
        return parts[0]
    return None


def attributable_grants(
    grants: Sequence[GpuGrant],
    gpus: Sequence[GpuRef],
    terminal_pods: Collection[tuple[str, str]] = (),
    mig_parents: Mapping[str, str] | None = None,
) -> Attribution:
    """Grants that may attribute a GPU to a container, and the rest counted by reason.

    - a pod in a terminal phase (``terminal_pods``: Succeeded or Failed, from the API server) holds
      nothing, although the kubelet may still list its devices (kubernetes issue 119423: List reports
      pods in terminal phase, whose devices the device manager may already have handed on);
    - the same device id granted to two pods is exclusive by construction (time-slicing and GKE
      sharing give each replica its own id), so one grant is stale: without the pods' phases there is
      no telling which, and neither is used;
    - a MIG device (``MIG-<uuid>``) counts for the GPU it was carved from, when ``mig_parents``
      (from NVML, as dcgm-exporter resolves it) or the id itself (pre-R470 form) names it;
    - a DRA claim's device names a ResourceSlice entry, which needs the resource.k8s.io API to turn
      into a GPU UUID (dcgm-exporter's DRAResourceSliceManager): counted, not resolved.
    """
    counts = dict.fromkeys(UNATTRIBUTED, 0)
    terminal = set(terminal_pods)
    live = []
    for grant in grants:
        if (grant.namespace, grant.pod) in terminal:
            counts["terminal_pod"] += 1
        elif grant.dra:
            counts["dra"] += 1
        else:
            live.append(grant)
    holders: dict[str, set[tuple[str, str]]] = {}
    for grant in live:
        holders.setdefault(grant.device_id, set()).add((grant.namespace, grant.pod))
    kept = []
    parents = mig_parents or {}
    for grant in live:
        if len(holders[grant.device_id]) > 1:
            counts["stale_duplicate"] += 1
            continue
        if grant.device_id.upper().startswith(MIG_PREFIX):
            parent = parents.get(grant.device_id) or mig_parent_in_id(grant.device_id)
            if parent is None:
                counts["mig_unresolved"] += 1
                continue
            named = GpuGrant(grant.namespace, grant.pod, grant.container, grant.resource_name, parent)
        else:
            named = grant
        if resolve_device_id(named.device_id, gpus) is None:
            counts["unknown_device"] += 1
            continue
        kept.append(named)
    return Attribution(tuple(kept), counts)


def gpu_owners(grants: Sequence[GpuGrant], gpus: Sequence[GpuRef]) -> dict[str, tuple[str, str, str]]:
    """GPU uuid -> (namespace, pod, container) holding it; the first grant wins for a shared GPU."""
    owners: dict[str, tuple[str, str, str]] = {}
    for grant in grants:
        ref = resolve_device_id(grant.device_id, gpus)
        if ref is not None:
            owners.setdefault(ref.uuid, (grant.namespace, grant.pod, grant.container))
    return owners


def _pid_gpus(
    tree: Sequence[ProcessInfo], gpus: Sequence[GpuRef], nvml_pids: Mapping[str, Collection[int]]
) -> tuple[list[GpuRef], bool]:
    """GPUs whose NVML process list holds one of the tree's PIDs; True when only the namespaced
    (in-container) PIDs matched."""
    own = {p.pid for p in tree}
    found = [g for g in gpus if own & set(nvml_pids.get(g.uuid, ()))]
    if found:
        return found, False
    inner = {n for p in tree for n in p.ns_pids[1:]}
    found = [g for g in gpus if inner & set(nvml_pids.get(g.uuid, ()))]
    return found, bool(found)


def _visible_gpus(
    name: str, tree: Sequence[ProcessInfo], gpus: Sequence[GpuRef], notes: list[str]
) -> list[GpuRef]:
    refs: list[GpuRef] = []
    for proc in tree:
        visible = visible_gpus(proc.cuda_visible_devices, proc.nvidia_visible_devices, gpus)
        if visible is not None:
            refs += visible.gpus
            notes += [f"replica {name}: process {proc.pid}: {n}" for n in visible.notes]
    return refs


@dataclass(frozen=True, slots=True)
class Visible:
    gpus: tuple[GpuRef, ...]
    notes: tuple[str, ...] = ()


def visible_gpus(cuda: str | None, nvidia: str | None, gpus: Sequence[GpuRef]) -> Visible | None:
    """GPUs a process may use per its environment; None when the environment does not restrict.

    ``NVIDIA_VISIBLE_DEVICES`` (container runtime, host view) picks the devices in the container,
    which then enumerate in host index order; ``CUDA_VISIBLE_DEVICES`` indexes into that list or
    names UUID prefixes. Like CUDA, parsing stops at the first entry that names no device.
    """
    notes: list[str] = []
    base = sorted(gpus, key=lambda g: g.index)
    restricted = False
    if nvidia is not None and nvidia.strip().lower() not in ("", "all"):
        restricted = True
        if nvidia.strip().lower() in ("none", "void"):
            base = []
        else:
            base = _pick(base, nvidia.split(","), notes, "NVIDIA_VISIBLE_DEVICES", stop=False)
    if cuda is not None:
        restricted = True
        base = _pick(base, cuda.split(",") if cuda.strip() else [], notes, "CUDA_VISIBLE_DEVICES", stop=True)
    if not restricted:
        return None
    return Visible(tuple(base), tuple(notes))


def _pick(pool: list[GpuRef], entries: list[str], notes: list[str], var: str, stop: bool) -> list[GpuRef]:
    """Entries of one variable resolved against ``pool`` (the devices visible so far, in order).

    ``stop``: CUDA semantics (indexes are positions in ``pool``; the first bad entry ends the list);
    otherwise the container runtime's (indexes are host indexes; bad entries are skipped).
    """
    chosen: list[GpuRef] = []
    for raw in entries:
        token = raw.strip()
        ref = None
        if token.upper().startswith("MIG-"):
            notes.append(f"{var} entry {token[:12]}... is a MIG device; MIG is not mapped")
            continue
        if token.isdigit():
            position = int(token)
            if stop:
                ref = pool[position] if position < len(pool) else None
            else:
                ref = next((g for g in pool if g.index == position), None)
        elif token.upper().startswith("GPU-"):
            matches = [g for g in pool if g.uuid.lower().startswith(token.lower())]
            ref = matches[0] if len(matches) == 1 else None
        if ref is None:
            notes.append(f"{var} entry {token!r} names no GPU")
            if stop:
                break
            continue
        if ref not in chosen:
            chosen.append(ref)
    if not stop:  # the runtime exposes devices in host order whatever the variable's order
        chosen.sort(key=lambda g: g.index)
    return chosen
