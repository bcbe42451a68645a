"""KV tier traffic beside the PCIe bus of the replica's GPUs.

Engines count KV moved between tiers (``TierTraffic``: bytes, tokens or blocks); NVML counts bytes
each GPU sent (tx) and received (rx) over PCIe. Joined per replica and direction:

- ``offload`` = KV leaving the GPU for another tier (host, disk, remote, object): the GPU transmits;
  ``onload`` = KV coming back: the GPU receives. Traffic that does not touch the GPU (host -> disk)
  does not cross the GPU's link and is left out.
- Bytes: the family's byte counter; else tokens x KV bytes per token; else blocks x block size x KV
  bytes per token; else unknown. KV bytes per token is only known when the model shape is.
- Families can count the same bytes (vLLM 0.24+ emits the CPU offload both as ``vllm_offload`` and
  as the legacy ``vllm_offload_legacy``), so a unit's rate in a direction is its *largest* family
  rate, not the sum; the replica's rate is the sum over its DP ranks.
- PCIe rate = sum over the replica's GPUs; link capacity = sum of each GPU's theoretical
  one-direction bandwidth at the link generation and width it is trained at now.

What the traffic buys (``TierPayback``, per replica, no GPU mapping needed): every token loaded back
to the GPU (onload) is a token the engine did not recompute, so recompute avoided per byte moved =
onload tokens per second / (offload + onload bytes per second). Tokens: the family's token counter
(SGLang HiCache, LMCache hits, vLLM 0.32+'s host-tier prompt hits); else bytes / KV bytes per token.
0 when KV moves and nothing comes back (stores never reused); unknown when nothing moved.

Flags (thresholds in ``BusThresholds``):

- ``offload_pcie_bound``: the KV rate is at least ``pcie_bound_fraction`` of link capacity.
- ``link_down_trained``: a GPU's link runs narrower than its maximum width, or at a lower
  generation than its maximum *while busy* (GPUs drop the link generation when idle to save power;
  that is not a fault).
- ``foreign_bus_traffic``: the GPUs move much more over PCIe than the replica's KV tiering explains:
  ``pcie > foreign_factor x kv_rate + foreign_baseline_bytes_per_second``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvwatch.derive import counters
from kvwatch.model import GpuSample, ReplicaSample, TierTraffic

OFFLOAD = "offload"
ONLOAD = "onload"
DIRECTIONS = (OFFLOAD, ONLOAD)

LinkBandwidth = Callable[[int, int], "float | None"]


@dataclass(frozen=True, slots=True)
class BusThresholds:
    """Flag thresholds, with the defaults documented in docs/kv-signals.md."""

    pcie_bound_fraction: float = 0.8
    foreign_factor: float = 2.0
    foreign_baseline_bytes_per_second: float = 1e9
    busy_bytes_per_second: float = 1e8  # below this (tx + rx) a lower link generation is power saving


@dataclass(frozen=True, slots=True)
class TierRate:
    family: str
    direction: str
    bytes_per_second: float | None
    tokens_per_second: float | None = None


@dataclass(frozen=True, slots=True)
class TierPayback:
    """What a replica's KV tier traffic bought over the rate window (module doc)."""

    replica: str
    avoided_tokens_per_second: float | None  # tokens loaded back to the GPU instead of recomputed
    moved_bytes_per_second: float | None  # offload + onload across the GPUs' links

    @property
    def tokens_per_byte(self) -> float | None:
        """Recompute avoided per byte moved; None when nothing moved or either side is unknown."""
        if self.avoided_tokens_per_second is None or not self.moved_bytes_per_second:
            return None
        return self.avoided_tokens_per_second / self.moved_bytes_per_second


@dataclass(frozen=True, slots=True)
class GpuLink:
    """One GPU's PCIe traffic rates and link state over the rate window."""

    index: int
    uuid: str
    tx_bytes_per_second: float | None
    rx_bytes_per_second: float | None
    link_bytes_per_second: float | None
    down_trained: bool | None


@dataclass(frozen=True, slots=True)
class TierLink:
    """A replica's KV tier traffic in one direction next to its GPUs' PCIe links."""

    replica: str
    direction: str
    kv_bytes_per_second: float | None
    pcie_bytes_per_second: float | None
    link_bytes_per_second: float | None
    offload_pcie_bound: bool | None
    link_down_trained: bool | None
    foreign_bus_traffic: bool | None

    @property
    def link_utilization(self) -> float | None:
        """KV tier traffic as a fraction of link capacity."""
        if self.kv_bytes_per_second is None or not self.link_bytes_per_second:
            return None
        return self.kv_bytes_per_second / self.link_bytes_per_second


def direction(traffic: TierTraffic) -> str | None:
    """``offload``/``onload`` for traffic that crosses the GPU's link, else ``None``."""
    if traffic.src_tier == "gpu" and traffic.dst_tier != "gpu":
        return OFFLOAD
    if traffic.dst_tier == "gpu" and traffic.src_tier != "gpu":
        return ONLOAD
    return None


def transferred_bytes(
    traffic: TierTraffic, block_size: int | None, kv_bytes_per_token: float | None
) -> float | None:
    """Cumulative bytes of a tier counter, converted from tokens or blocks when the shape is known."""
    if traffic.bytes_total is not None:
        return traffic.bytes_total
    if kv_bytes_per_token is None:
        return None
    if traffic.tokens_total is not None:
        return traffic.tokens_total * kv_bytes_per_token
    if traffic.blocks_total is not None and block_size:
        return traffic.blocks_total * block_size * kv_bytes_per_token
    return None


def transferred_tokens(
    traffic: TierTraffic, block_size: int | None, kv_bytes_per_token: float | None
) -> float | None:
    """Cumulative tokens of a tier counter: counted, else blocks x block size, else bytes / KV bytes
    per token."""
    if traffic.tokens_total is not None:
        return traffic.tokens_total
    if traffic.blocks_total is not None and block_size:
        return traffic.blocks_total * block_size
    if traffic.bytes_total is not None and kv_bytes_per_token:
        return traffic.bytes_total / kv_bytes_per_token
    return None


def tier_rates(
    current: ReplicaSample, previous: ReplicaSample, kv_bytes_per_token: float | None = None
) -> list[TierRate]:
    """Bytes (and tokens) per second of each GPU-crossing tier counter of one unit between two samples."""
    dt = current.scraped_at - previous.scraped_at
    before = {(t.family, t.src_tier, t.dst_tier): t for t in previous.tier_traffic}
    out = []
    for traffic in current.tier_traffic:
        way = direction(traffic)
        if way is None:
            continue
        old = before.get((traffic.family, traffic.src_tier, traffic.dst_tier))
        rate = tokens = None
        if old is not None:
            rate = counters.per_second(
                transferred_bytes(old, previous.block_size, kv_bytes_per_token),
                transferred_bytes(traffic, current.block_size, kv_bytes_per_token),
                dt,
            )
            tokens = counters.per_second(
                transferred_tokens(old, previous.block_size, kv_bytes_per_token),
                transferred_tokens(traffic, current.block_size, kv_bytes_per_token),
                dt,
            )
        out.append(TierRate(traffic.family, way, rate, tokens))
    return out


def unit_kv_rate(rates: Iterable[TierRate], way: str, *, tokens: bool = False) -> float | None:
    """One unit's KV rate in a direction (bytes/s, or tokens/s with ``tokens``): the largest family
    rate (families may double count).

    0 when the unit has no tier counter in that direction; ``None`` when it has some but none can be
    turned into that unit per second.
    """
    values = [r.tokens_per_second if tokens else r.bytes_per_second for r in rates if r.direction == way]
    if not values:
        return 0.0
    known = [v for v in values if v is not None]
    return max(known) if known else None


def tier_payback(replica: str, unit_rates: Sequence[Sequence[TierRate]]) -> TierPayback | None:
    """Recompute avoided and bytes moved by a replica's tiers (one rate list per DP rank); None when
    the replica has no GPU-crossing tier counter at all."""
    if not any(unit_rates):
        return None
    avoided = counters.total(unit_kv_rate(rates, ONLOAD, tokens=True) for rates in unit_rates)
    moved = counters.total(unit_kv_rate(rates, way) for rates in unit_rates for way in DIRECTIONS)
    return TierPayback(replica, avoided, moved)


def gpu_link(
    current: GpuSample,
    previous: GpuSample | None,
    link_bandwidth: LinkBandwidth,
    thresholds: BusThresholds = BusThresholds(),
) -> GpuLink:
    """PCIe rates of one GPU between two polls, its link capacity now, and whether it is down-trained."""
    tx = rx = None
    if previous is not None:
        dt = current.sampled_at - previous.sampled_at
        tx = counters.per_second(previous.pcie_tx_bytes_total, current.pcie_tx_bytes_total, dt)
        rx = counters.per_second(previous.pcie_rx_bytes_total, current.pcie_rx_bytes_total, dt)
    gen, width = current.pcie_link_gen_current, current.pcie_link_width_current
    capacity = link_bandwidth(gen, width) if gen and width else None
    return GpuLink(current.index, current.uuid, tx, rx, capacity, _down_trained(current, tx, rx, thresholds))


def _down_trained(
    gpu: GpuSample, tx: float | None, rx: float | None, thresholds: BusThresholds
) -> bool | None:
    narrower = _below(gpu.pcie_link_width_current, gpu.pcie_link_width_max)
    slower = _below(gpu.pcie_link_gen_current, gpu.pcie_link_gen_max)
    if narrower:
        return True
    if slower:
        if tx is None or rx is None:
            return None  # cannot tell power saving from a fault without traffic
        return tx + rx >= thresholds.busy_bytes_per_second
    if narrower is None and slower is None:
        return None
    return False


def _below(current: int | None, maximum: int | None) -> bool | None:
    if current is None or maximum is None:
        return None
    return current < maximum


def tier_links(
    replica: str,
    unit_rates: Sequence[Sequence[TierRate]],
    gpus: Sequence[GpuLink],
    thresholds: BusThresholds = BusThresholds(),
) -> list[TierLink]:
    """Join a replica's tier rates (one list per DP rank) with its GPUs' links, per direction."""
    if not gpus:
        return []
    capacity = counters.total(g.link_bytes_per_second for g in gpus)
    trained = [g.down_trained for g in gpus]
    down = True if any(trained) else (None if any(t is None for t in trained) else False)
    out = []
    for way in DIRECTIONS:
        kv = counters.total(unit_kv_rate(rates, way) for rates in unit_rates)
        pcie = counters.total(
            g.tx_bytes_per_second if way == OFFLOAD else g.rx_bytes_per_second for g in gpus
        )
        bound = None if kv is None or capacity is None else kv >= thresholds.pcie_bound_fraction * capacity
        foreign = (
            None
            if kv is None or pcie is None
            else (pcie > thresholds.foreign_factor * kv + thresholds.foreign_baseline_bytes_per_second)
        )
        out.append(TierLink(replica, way, kv, pcie, capacity, bound, down, foreign))
    return out
