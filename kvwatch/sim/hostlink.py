"""The PCIe path between a replica's GPUs and host memory that KV offload crosses.

Pure: no I/O. One ``HostLink`` is one PCIe uplink in one direction (PCIe is full duplex: stores to
the host and loads back to the GPU do not compete). GPUs behind one PCIe switch share its uplink
(``gpus_per_switch``); a replica's KV is split evenly over its GPUs (each TP/PP rank moves its
shard), so a replica's transfer is done when its slowest uplink is.

A link moves one transfer at a time: a transfer that starts at ``t`` fills the link's idle time
from ``t`` on. Transfers that overlap in simulated time queue, and one booked later in wall order
but earlier in simulated time is not queued behind a later one: it takes the idle time before it
(the replay advances the replicas one after another to each arrival). Saturation shows as a transfer
that ends later than its bytes alone would take: the step waiting for it lasts that much longer.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

_KEEP_S = 60.0  # busy intervals kept behind the newest booking (the replicas run within one step)


class HostLink:
    """One uplink, one direction, moving one transfer at a time at ``bytes_per_second``.

    ``_busy`` holds the booked intervals, disjoint and sorted; a transfer from ``start`` fills the
    gaps after ``start`` in time order until its bytes are through.
    """

    __slots__ = ("_busy", "_newest", "bytes_per_second")

    def __init__(self, bytes_per_second: float) -> None:
        if not bytes_per_second > 0:
            raise ValueError(f"a host link needs bytes_per_second > 0, got {bytes_per_second!r}")
        self.bytes_per_second = bytes_per_second
        self._busy: list[list[float]] = []  # [start, end) booked, disjoint, sorted
        self._newest = 0.0

    def transfer(self, start: float, nbytes: float) -> float:
        """Book ``nbytes`` from simulated time ``start``; return when the last byte has crossed."""
        if nbytes <= 0:
            return start
        busy = self._busy
        need = nbytes / self.bytes_per_second
        i = bisect.bisect_right(busy, start, key=_end)  # first interval ending after start
        cursor = start
        while True:
            if i < len(busy) and busy[i][0] <= cursor:
                cursor = busy[i][1]  # inside a booked interval: wait for its end
                i += 1
                continue
            gap_end = busy[i][0] if i < len(busy) else math.inf
            take = min(need, gap_end - cursor)
            self._book(i, cursor, cursor + take)
            need -= take
            cursor += take
            if need <= 0:
                break
            i = bisect.bisect_right(busy, cursor, key=_end)
        self._newest = max(self._newest, cursor)
        if busy and busy[0][1] < self._newest - _KEEP_S:
            del busy[: bisect.bisect_right(busy, self._newest - _KEEP_S, key=_end)]
        return cursor

    def _book(self, i: int, start: float, end: float) -> None:
        """Insert [start, end) before interval ``i``, merging with neighbours it touches."""
        busy = self._busy
        if i > 0 and busy[i - 1][1] >= start:
            busy[i - 1][1] = end
            if i < len(busy) and busy[i][0] <= end:
                busy[i - 1][1] = busy[i][1]
                del busy[i]
        elif i < len(busy) and busy[i][0] <= end:
            busy[i][0] = start
        else:
            busy.insert(i, [start, end])


def _end(interval: list[float]) -> float:
    return interval[1]


class ReplicaHostPath:
    """A replica's share of the node's uplinks: (store link, load link, share of its bytes) each."""

    __slots__ = ("alone_s_per_byte", "links")

    def __init__(self, links: Sequence[tuple[HostLink, HostLink, float]]) -> None:
        if not links:
            raise ValueError("a replica needs at least one host link")
        self.links = tuple(links)
        # the seconds per byte the replica's transfer takes with the links to itself
        self.alone_s_per_byte = max(share / store.bytes_per_second for store, _load, share in self.links)

    def move(self, start: float, store_bytes: float, load_bytes: float) -> float:
        """Store and load KV from ``start``; return when both are done on every uplink."""
        end = start
        for store, load, share in self.links:
            if store_bytes:
                end = max(end, store.transfer(start, store_bytes * share))
            if load_bytes:
                end = max(end, load.transfer(start, load_bytes * share))
        return end


def node_host_paths(
    replicas: int, gpus_per_replica: int, gpus_per_switch: int, bytes_per_second: float
) -> list[ReplicaHostPath]:
    """Each replica's path when replica ``i`` runs on GPUs ``i x g .. (i + 1) x g - 1`` and switch
    ``k`` serves GPUs ``k x s .. (k + 1) x s - 1`` (the node's GPUs in order, as NVML numbers them)."""
    if gpus_per_switch < 1 or gpus_per_replica < 1:
        raise ValueError("gpus_per_switch and GPUs per replica must be >= 1")
    switches = -(-(replicas * gpus_per_replica) // gpus_per_switch)
    uplinks = [(HostLink(bytes_per_second), HostLink(bytes_per_second)) for _ in range(switches)]
    paths = []
    for i in range(replicas):
        per_switch: dict[int, int] = {}
        for gpu in range(i * gpus_per_replica, (i + 1) * gpus_per_replica):
            per_switch[gpu // gpus_per_switch] = per_switch.get(gpu // gpus_per_switch, 0) + 1
        paths.append(
            ReplicaHostPath([(*uplinks[k], n / gpus_per_replica) for k, n in sorted(per_switch.items())])
        )
    return paths
