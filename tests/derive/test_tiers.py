"""KV tier traffic next to the PCIe links of the replica's GPUs."""

from pathlib import Path

import pytest

from kvwatch.derive.pcie import link_bytes_per_second
from kvwatch.derive.tiers import (
    OFFLOAD,
    ONLOAD,
    BusThresholds,
    GpuLink,
    TierRate,
    direction,
    gpu_link,
    tier_links,
    tier_payback,
    tier_rates,
    transferred_bytes,
    unit_kv_rate,
)
from kvwatch.engines.registry import parse_exposition
from kvwatch.model import TierTraffic

from .factories import gpu, vllm

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "engines" / "captured"
GEN5_X16 = link_bytes_per_second(5, 16)  # ~63 GB/s per direction
QWEN3_06B_KV_BYTES_PER_TOKEN = 28 * 8 * 128 * 2 * 2  # layers x kv heads x head dim x (K, V) x bf16


@pytest.mark.parametrize(
    ("src", "dst", "way"),
    [
        ("gpu", "host", OFFLOAD),
        ("gpu", "disk", OFFLOAD),
        ("gpu", "remote", OFFLOAD),
        ("host", "gpu", ONLOAD),
        ("object", "gpu", ONLOAD),
        ("host", "disk", None),  # does not cross the GPU's link
        ("gpu", "gpu", None),
    ],
)
def test_direction_is_seen_from_the_gpu(src, dst, way):
    assert direction(TierTraffic("f", src, dst)) == way


@pytest.mark.parametrize(
    ("traffic", "kv_bytes_per_token", "expected"),
    [
        (TierTraffic("f", "gpu", "host", bytes_total=100.0, tokens_total=1.0), 10.0, 100.0),  # bytes win
        (TierTraffic("f", "gpu", "host", tokens_total=5.0), 10.0, 50.0),
        (TierTraffic("f", "gpu", "host", blocks_total=2.0), 10.0, 2 * 16 * 10.0),  # 16-token blocks
        (TierTraffic("f", "gpu", "host", tokens_total=5.0), None, None),  # shape unknown
        (TierTraffic("f", "gpu", "host", seconds_total=5.0), 10.0, None),
    ],
)
def test_transferred_bytes_converts_tokens_and_blocks_only_when_the_shape_is_known(
    traffic, kv_bytes_per_token, expected
):
    assert transferred_bytes(traffic, 16, kv_bytes_per_token) == expected


def test_tier_rates_per_family_between_two_samples():
    before = vllm(
        scraped_at=0.0,
        tier_traffic=(
            TierTraffic("vllm_offload", "gpu", "host", bytes_total=1e9),
            TierTraffic("vllm_offload", "host", "gpu", bytes_total=0.0),
            TierTraffic("vllm_tiering", "host", "disk", bytes_total=0.0),
        ),
    )
    now = vllm(
        scraped_at=10.0,
        tier_traffic=(
            TierTraffic("vllm_offload", "gpu", "host", bytes_total=3e9),
            TierTraffic("vllm_offload", "host", "gpu", bytes_total=5e8),
            TierTraffic("vllm_tiering", "host", "disk", bytes_total=7e9),
            TierTraffic("kvbm", "gpu", "host", blocks_total=10.0),
        ),
    )  # new family: no rate yet
    assert tier_rates(now, before) == [
        TierRate("vllm_offload", OFFLOAD, 2e8),
        TierRate("vllm_offload", ONLOAD, 5e7),
        TierRate("kvbm", OFFLOAD, None),
    ]


@pytest.mark.parametrize(
    ("rates", "expected"),
    [
        ([], 0.0),  # no tier counter: nothing offloaded
        # vLLM 0.24+ counts CPU offload twice, in the new and the legacy family: the same bytes
        ([TierRate("vllm_offload", OFFLOAD, 2e8), TierRate("vllm_offload_legacy", OFFLOAD, 2e8)], 2e8),
        ([TierRate("lmcache", OFFLOAD, None), TierRate("vllm_offload", OFFLOAD, 1e8)], 1e8),
        ([TierRate("lmcache", OFFLOAD, None)], None),
        ([TierRate("vllm_offload", ONLOAD, 9e9)], 0.0),  # other direction
    ],
)
def test_unit_rate_is_the_largest_family_not_the_sum(rates, expected):
    assert unit_kv_rate(rates, OFFLOAD) == expected


def test_gpu_link_rates_and_capacity():
    link = gpu_link(gpu(at=10.0, tx=7e10, rx=1e10), gpu(at=0.0, tx=1e10, rx=0.0), link_bytes_per_second)
    assert (link.tx_bytes_per_second, link.rx_bytes_per_second) == (6e9, 1e9)
    assert link.link_bytes_per_second == pytest.approx(63.0e9, rel=0.001)
    assert link.down_trained is False


@pytest.mark.parametrize(
    ("fields", "traffic", "down"),
    [
        ({"width": 8}, 0.0, True),  # x8 in an x16 slot: a fault whatever the load
        ({"gen": 1}, 0.0, False),  # Gen1 while idle: power saving
        ({"gen": 3}, 5e9, True),  # Gen3 while moving 0.5 GB/s: down-trained
        ({"gen": None}, 0.0, False),  # width fine, generation unknown
        ({"gen": None, "width": None}, 0.0, None),
    ],
)
def test_down_training_ignores_idle_power_saving(fields, traffic, down):
    link = gpu_link(gpu(at=10.0, tx=traffic, **fields), gpu(at=0.0, tx=0.0, **fields), link_bytes_per_second)
    assert link.down_trained is down


def test_lower_generation_without_traffic_rates_is_unknown():
    assert gpu_link(gpu(gen=3), None, link_bytes_per_second).down_trained is None


def links(kv_offload, pcie_tx, capacity=GEN5_X16, gpus=1, down=False):
    gpu_links = [GpuLink(i, f"GPU-{i}", pcie_tx / gpus, 0.0, capacity, down) for i in range(gpus)]
    rates = [[TierRate("vllm_offload", OFFLOAD, kv_offload)]]
    return {link.direction: link for link in tier_links("r0", rates, gpu_links)}


def test_offload_near_link_capacity_is_pcie_bound():
    offload = links(0.85 * GEN5_X16, 0.86 * GEN5_X16)[OFFLOAD]
    assert offload.offload_pcie_bound is True
    assert offload.foreign_bus_traffic is False
    assert offload.link_utilization == pytest.approx(0.85)


def test_link_capacity_is_the_sum_over_the_replicas_gpus():
    offload = links(0.85 * GEN5_X16, 0.9 * GEN5_X16, gpus=4)[OFFLOAD]
    assert offload.link_bytes_per_second == pytest.approx(4 * GEN5_X16)
    assert offload.offload_pcie_bound is False


def test_bus_traffic_the_replica_does_not_explain_is_foreign():
    quiet_replica = links(0.0, 20e9)[OFFLOAD]
    explained = links(10e9, 20e9)[OFFLOAD]
    assert (quiet_replica.foreign_bus_traffic, explained.foreign_bus_traffic) == (True, False)
    assert links(0.0, 0.5e9)[OFFLOAD].foreign_bus_traffic is False  # below the 1 GB/s baseline


def test_unknown_kv_rate_leaves_flags_unknown():
    offload = links(None, 20e9)[OFFLOAD]
    flags = (offload.offload_pcie_bound, offload.foreign_bus_traffic, offload.link_utilization)
    assert flags == (None, None, None)


def test_thresholds_are_parameters():
    gpu_links = [GpuLink(0, "GPU-0", 30e9, 0.0, GEN5_X16, False)]
    strict = BusThresholds(pcie_bound_fraction=0.4)
    [offload, _] = tier_links("r0", [[TierRate("f", OFFLOAD, 30e9)]], gpu_links, strict)
    assert offload.offload_pcie_bound is True


def test_no_gpus_mapped_means_no_join():
    assert tier_links("r0", [[]], []) == []


# --------------------------------------------------------------------------------------------
# the real capture: vLLM 0.13-0.14 with LMCache behind Dynamo (tokens, not bytes, for GPU<->host)
# --------------------------------------------------------------------------------------------


def with_counter(text: str, name: str, value: float) -> str:
    """The page with the single sample of counter ``name`` set to ``value``."""
    lines = [
        f"{line.rsplit(' ', 1)[0]} {value}" if line.startswith(name + "{") else line
        for line in text.splitlines()
    ]
    assert lines != text.splitlines(), name
    return "\n".join(lines) + "\n"


def lmcache_pages(stored_tokens: float, hit_tokens: float):
    """The capture as the baseline, and the same page 10 s later with LMCache having moved tokens."""
    text = (FIXTURES / "vllm-0.13-0.14-v1-lmcache-dynamo-2026-01-2.prom").read_text()
    later = with_counter(text, "lmcache:num_stored_tokens_total", stored_tokens)
    later = with_counter(later, "lmcache:num_hit_tokens_total", hit_tokens)
    [before] = parse_exposition(text, "r0", scraped_at=100.0).samples
    [now] = parse_exposition(later, "r0", scraped_at=110.0).samples
    return now, before


def test_real_lmcache_capture_counts_tokens_so_bytes_need_the_model_shape():
    now, before = lmcache_pages(stored_tokens=100_000.0, hit_tokens=20_000.0)
    unknown = {(r.direction, r.bytes_per_second) for r in tier_rates(now, before)}
    assert unknown == {(OFFLOAD, None), (ONLOAD, None)}
    per_token = QWEN3_06B_KV_BYTES_PER_TOKEN
    rates = {r.direction: r.bytes_per_second for r in tier_rates(now, before, per_token)}
    assert rates == {OFFLOAD: 10_000 * per_token, ONLOAD: 2_000 * per_token}


def test_real_lmcache_capture_joined_with_a_gen5_link():
    now, before = lmcache_pages(stored_tokens=100_000.0, hit_tokens=20_000.0)
    rates = [tier_rates(now, before, QWEN3_06B_KV_BYTES_PER_TOKEN)]
    link = gpu_link(gpu(at=110.0, tx=2e10, rx=5e9), gpu(at=100.0, tx=0.0, rx=0.0), link_bytes_per_second)
    joined = {j.direction: j for j in tier_links("r0", rates, [link])}
    offload_rate = 10_000 * QWEN3_06B_KV_BYTES_PER_TOKEN  # ~1.15 GB/s
    assert joined[OFFLOAD].kv_bytes_per_second == offload_rate
    assert joined[OFFLOAD].pcie_bytes_per_second == 2e9
    assert joined[OFFLOAD].offload_pcie_bound is False
    assert joined[OFFLOAD].foreign_bus_traffic is False  # 2 GB/s < 2 x 1.15 GB/s + 1 GB/s
    assert joined[ONLOAD].pcie_bytes_per_second == 5e8


# --------------------------------------------------------------------------------------------
# what the traffic buys: recompute avoided per byte moved
# --------------------------------------------------------------------------------------------


def test_real_lmcache_capture_recompute_avoided_per_byte_moved():
    # LMCache counts tokens: 2,000 tokens/s came back (not recomputed) while 12,000 tokens/s moved
    now, before = lmcache_pages(stored_tokens=100_000.0, hit_tokens=20_000.0)
    per_token = QWEN3_06B_KV_BYTES_PER_TOKEN
    payback = tier_payback("r0", [tier_rates(now, before, per_token)])
    assert payback is not None
    assert payback.avoided_tokens_per_second == 2_000
    assert payback.moved_bytes_per_second == 12_000 * per_token
    assert payback.tokens_per_byte == pytest.approx(2_000 / (12_000 * per_token))
    # without the model's shape the tokens are known but the bytes moved are not: no ratio
    unknown = tier_payback("r0", [tier_rates(now, before)])
    assert unknown is not None and unknown.avoided_tokens_per_second == 2_000
    assert unknown.tokens_per_byte is None


def test_a_family_counting_tokens_and_bytes_needs_no_shape_and_ranks_add_up():
    def hicache(t, back_tokens, back_bytes, up_tokens, up_bytes):
        return vllm(
            scraped_at=t,
            tier_traffic=(
                TierTraffic(
                    "sglang_hicache", "host", "gpu", tokens_total=back_tokens, bytes_total=back_bytes
                ),
                TierTraffic("sglang_hicache", "gpu", "host", tokens_total=up_tokens, bytes_total=up_bytes),
            ),
        )

    rank0 = tier_rates(hicache(10.0, 500.0, 5e7, 1000.0, 1e8), hicache(0.0, 0.0, 0.0, 0.0, 0.0))
    rank1 = tier_rates(hicache(10.0, 0.0, 0.0, 1000.0, 1e8), hicache(0.0, 0.0, 0.0, 0.0, 0.0))
    payback = tier_payback("r0", [rank0, rank1])
    assert payback is not None
    # 50 tokens/s came back to rank 0; 5 MB/s + 10 MB/s + 10 MB/s moved over both ranks' links
    assert payback.avoided_tokens_per_second == 50.0 and payback.moved_bytes_per_second == 2.5e7
    assert payback.tokens_per_byte == pytest.approx(50.0 / 2.5e7)


def test_stores_never_reused_avoid_nothing_and_no_traffic_is_no_ratio():
    before = vllm(
        scraped_at=0.0,
        tier_traffic=(
            TierTraffic("vllm_offload", "gpu", "host", bytes_total=0.0),
            TierTraffic("vllm_offload", "host", "gpu", bytes_total=0.0),
        ),
    )
    stored = vllm(
        scraped_at=10.0,
        tier_traffic=(
            TierTraffic("vllm_offload", "gpu", "host", bytes_total=1e9),
            TierTraffic("vllm_offload", "host", "gpu", bytes_total=0.0),
        ),
    )
    payback = tier_payback("r0", [tier_rates(stored, before, 1e5)])  # vLLM counts bytes: 1e5 B/token
    assert payback is not None and payback.tokens_per_byte == 0.0
    idle = tier_payback("r0", [tier_rates(before, before, 1e5)])
    assert idle is not None and idle.tokens_per_byte is None
    assert tier_payback("r0", [[]]) is None  # no tier counter at all
