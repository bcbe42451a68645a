"""Replica -> GPU mapping (pure): config, then NVML PID membership, then CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import pytest

from kvwatch.derive.gpu_mapping import GpuRef, ReplicaTarget, map_replicas, process_tree, visible_gpus
from kvwatch.model import ProcessInfo

GPUS = tuple(GpuRef(i, f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}") for i in range(8))
U = [g.uuid for g in GPUS]


def proc(
    pid: int,
    *,
    ns: tuple[int, ...] = (),
    children: tuple[int, ...] = (),
    cuda: str | None = None,
    nvidia: str | None = None,
) -> ProcessInfo:
    return ProcessInfo(
        pid=pid,
        ns_pids=(pid, *ns),
        children=children,
        cuda_visible_devices=cuda,
        nvidia_visible_devices=nvidia,
    )


def mapped(result, replica: str) -> tuple[tuple[str, str, str], ...] | None:
    return result.replica_gpus.get(replica)


# ------------------------------------------------------------------------------------------------
# evidence kinds and their order
# ------------------------------------------------------------------------------------------------

CASES = [
    # (case, target, processes, nvml pids by gpu index, expected ((index, mapped_by), ...))
    ("config indexes", ReplicaTarget("r", ("1", "0")), {}, {}, ((0, "config"), (1, "config"))),
    ("config uuid, any case", ReplicaTarget("r", (U[5].upper(),)), {}, {}, ((5, "config"),)),
    ("config beats pid", ReplicaTarget("r", ("7",), pid=100), {100: proc(100)}, {2: {100}}, ((7, "config"),)),
    (
        "engine pid on a gpu",
        ReplicaTarget("r", pid=100),
        {100: proc(100)},
        {3: {100}, 4: {999}},
        ((3, "pid"),),
    ),
    (
        "tp workers are children",
        ReplicaTarget("r", pid=100),
        {100: proc(100, children=(101, 102)), 101: proc(101), 102: proc(102)},
        {0: {101}, 1: {102}},
        ((0, "pid"), (1, "pid")),
    ),
    (
        "grandchildren count too",
        ReplicaTarget("r", pid=100),
        {100: proc(100, children=(101,)), 101: proc(101, children=(102,)), 102: proc(102)},
        {6: {102}},
        ((6, "pid"),),
    ),
    (
        "nvml reports namespaced pids",
        ReplicaTarget("r", pid=4100),
        {4100: proc(4100, ns=(1,), children=(4101,)), 4101: proc(4101, ns=(57,))},
        {2: {57}},
        ((2, "pid"),),
    ),
    (
        "host pid wins over a namespaced coincidence",
        ReplicaTarget("r", pid=4100),
        {4100: proc(4100, ns=(1,))},
        {0: {4100}, 5: {1}},
        ((0, "pid"),),
    ),
    (
        "pid beats cuda_visible_devices",
        ReplicaTarget("r", pid=100),
        {100: proc(100, cuda="4")},
        {1: {100}},
        ((1, "pid"),),
    ),
    (
        "cuda_visible_devices when nvml lists nothing",
        ReplicaTarget("r", pid=100),
        {100: proc(100, cuda="4,5")},
        {},
        ((4, "cuda_visible_devices"), (5, "cuda_visible_devices")),
    ),
    (
        "visible devices of all workers",
        ReplicaTarget("r", pid=100),
        {100: proc(100, children=(101, 102)), 101: proc(101, cuda="2"), 102: proc(102, cuda="3")},
        {},
        ((2, "cuda_visible_devices"), (3, "cuda_visible_devices")),
    ),
    ("unset everywhere: unmapped", ReplicaTarget("r", pid=100), {100: proc(100)}, {}, None),
    (
        "NVIDIA_VISIBLE_DEVICES=all says nothing",
        ReplicaTarget("r", pid=100),
        {100: proc(100, nvidia="all")},
        {},
        None,
    ),
    ("process gone: unmapped", ReplicaTarget("r", pid=100), {}, {0: {100}}, None),
    ("no pid, no config: unmapped", ReplicaTarget("r"), {100: proc(100)}, {0: {100}}, None),
]


@pytest.mark.parametrize(
    ("target", "processes", "nvml", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_mapping_evidence_order(target, processes, nvml, expected):
    nvml_pids = {U[i]: pids for i, pids in nvml.items()}
    result = map_replicas([target], processes, GPUS, nvml_pids)
    want = None if expected is None else tuple((str(i), U[i], by) for i, by in expected)
    assert mapped(result, "r") == want


# ------------------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES
# ------------------------------------------------------------------------------------------------

VISIBLE = [
    # (case, CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES, expected indexes or None, note fragment)
    ("unset", None, None, None, None),
    ("indexes keep CUDA's order", "3,1", None, [3, 1], None),
    ("empty hides every gpu", "", None, [], None),
    ("uuid", U[6], None, [6], None),
    ("unique uuid prefix", U[2][:14], None, [2], None),
    ("ambiguous prefix stops the list", "0,GPU-0", None, [0], "names no GPU"),
    ("invalid entry ends the list like CUDA", "1,9,2", None, [1], "'9' names no GPU"),
    ("mig ids are skipped with a note", "MIG-1234abcd-0000,2", None, [2], "MIG"),
    ("runtime picks host gpus, cuda indexes into them", "1", "4,6", [6], None),
    ("runtime uuids enumerate in host order", None, f"{U[5]},{U[2]}", [2, 5], None),
    ("runtime none", None, "none", [], None),
    ("runtime void", "0", "void", [], "'0' names no GPU"),
    ("runtime all: cuda alone decides", "7", "all", [7], None),
]


@pytest.mark.parametrize(
    ("cuda", "nvidia", "expected", "note"), [c[1:] for c in VISIBLE], ids=[c[0] for c in VISIBLE]
)
def test_visible_gpus(cuda, nvidia, expected, note):
    result = visible_gpus(cuda, nvidia, GPUS)
    if expected is None:
        assert result is None
        return
    assert [g.index for g in result.gpus] == expected
    if note is None:
        assert result.notes == ()
    else:
        assert any(note in n for n in result.notes), result.notes


# ------------------------------------------------------------------------------------------------
# pid -> replica, notes, several replicas
# ------------------------------------------------------------------------------------------------


def test_pid_replica_covers_every_process_of_every_replica():
    processes = {100: proc(100, children=(101,)), 101: proc(101), 200: proc(200)}
    result = map_replicas(
        [ReplicaTarget("a", pid=100), ReplicaTarget("b", pid=200)],
        processes,
        GPUS,
        {U[0]: {101}, U[1]: {200}},
    )
    assert result.pid_replica == {100: "a", 101: "a", 200: "b"}
    assert mapped(result, "a") == (("0", U[0], "pid"),) and mapped(result, "b") == (("1", U[1], "pid"),)


def test_namespaced_pids_join_pid_replica_only_when_nvml_reports_them():
    container = {4100: proc(4100, ns=(1,), children=(4101,)), 4101: proc(4101, ns=(57,))}
    by_ns = map_replicas([ReplicaTarget("r", pid=4100)], container, GPUS, {U[0]: {57}})
    assert by_ns.pid_replica == {4100: "r", 1: "r", 4101: "r", 57: "r"}
    by_host = map_replicas([ReplicaTarget("r", pid=4100)], container, GPUS, {U[0]: {4101}})
    assert by_host.pid_replica == {4100: "r", 4101: "r"}  # "1" could be any host process


def test_process_claimed_by_two_replicas_stays_with_the_first_and_is_noted():
    processes = {100: proc(100)}
    result = map_replicas([ReplicaTarget("a", pid=100), ReplicaTarget("b", pid=100)], processes, GPUS, {})
    assert result.pid_replica == {100: "a"}
    assert any("both a and b" in n for n in result.notes)


@pytest.mark.parametrize(
    ("entry", "note"),
    [
        ("12", "not a GPU index NVML knows"),
        ("GPU-ffffffff-0000", "matches no GPU UUID"),
        ("MIG-abc", "MIG device"),
        ("first", "neither an index nor a GPU- UUID"),
    ],
)
def test_bad_config_entries_are_noted(entry, note):
    result = map_replicas([ReplicaTarget("r", (entry,))], {}, GPUS, {})
    assert any(note in n and "replica r" in n for n in result.notes), result.notes


def test_config_works_without_nvml_inventory():
    result = map_replicas([ReplicaTarget("r", ("2", U[3]))], {}, [], {})
    assert mapped(result, "r") == (("", U[3], "config"), ("2", "", "config"))
    assert result.notes == ()


def test_missing_engine_process_is_noted():
    result = map_replicas([ReplicaTarget("r", pid=31337)], {}, GPUS, {})
    assert result.notes == ("replica r: process 31337 not found in /proc",)


def test_process_tree_survives_a_cycle():
    processes = {1: proc(1, children=(2,)), 2: proc(2, children=(1,))}
    assert [p.pid for p in process_tree(1, processes)] == [1, 2]
