"""Live tokens and internal fragmentation: engine counts where they exist, labelled proxy estimates else."""

import pytest

from kvwatch.derive.fragmentation import (
    ENGINE,
    PROXY_ESTIMATE,
    engine_live_tokens,
    estimated_live_tokens,
    fragmentation_ratio,
    replica_fragmentation,
    running_requests,
)

from .factories import request, sglang, vllm


@pytest.mark.parametrize(
    ("live", "allocated", "ratio"),
    [
        (7000.0, 8000.0, 0.125),
        (8000.0, 8000.0, 0.0),  # every slot used
        (0.0, 8000.0, 1.0),  # blocks held, no token live
        (0.0, 0.0, 0.0),  # nothing allocated, nothing wasted
        (8000.0 * (1 + 1e-12), 8000.0, 0.0),  # float rounding above the allocation counts as equal
    ],
)
def test_fragmentation_ratio_is_one_minus_live_over_allocated(live, allocated, ratio):
    assert fragmentation_ratio(live, allocated) == (pytest.approx(ratio), "")


@pytest.mark.parametrize(
    ("live", "allocated", "reason"),
    [
        (None, 8000.0, "no live-token count"),
        (100.0, None, "allocation unknown"),
        (100.0, 0.0, "live tokens but nothing allocated"),
        (8100.0, 8000.0, "live tokens exceed allocation"),
    ],
)
def test_fragmentation_ratio_is_none_with_a_reason_when_undefined(live, allocated, reason):
    ratio, note = fragmentation_ratio(live, allocated)
    assert ratio is None
    assert note.startswith(reason)


def test_vllm_fragmentation_uses_blocks_net_of_the_null_block():
    # 1001 blocks, usage 0.5 -> 500 blocks (not 500.5) -> 8000 slots; 7000 live tokens
    [f] = replica_fragmentation(
        [vllm(kv_usage_ratio=0.5, live_tokens=7000.0, requests_running=4.0)], [], proxied=False
    )
    assert (f.live_tokens, f.source, f.allocated_tokens) == (7000.0, ENGINE, 8000.0)
    assert f.ratio == pytest.approx(0.125)


def test_sglang_page_size_one_is_exact_and_unfragmented():
    [f] = replica_fragmentation([sglang(kv_used_tokens=30_000.0, requests_running=3.0)], [], proxied=False)
    assert (f.live_tokens, f.source, f.ratio) == (30_000.0, ENGINE, 0.0)


def test_tokens_held_with_nothing_counted_as_running_are_live_not_fragmentation():
    # SGLang counts a request in chunked prefill in no running batch, but its slots are held: the
    # live count was zeroed whenever running was 0, and the pool read 100% fragmented
    [f] = replica_fragmentation(
        [sglang(kv_used_tokens=6000.0, live_tokens=6000.0, requests_running=0.0)], [], proxied=False
    )
    assert (f.live_tokens, f.allocated_tokens, f.ratio) == (6000.0, 6000.0, 0.0)


def test_vllm_without_a_live_gauge_has_no_engine_count():
    assert engine_live_tokens(vllm(kv_usage_ratio=0.5, requests_running=2.0)) is None


def test_proxy_estimate_is_labelled_and_counts_only_the_oldest_running_requests():
    in_flight = [request(3.0, 500, 100), request(1.0, 1000, 200), request(2.0, 2000, 300)]
    # the engine runs 2: the two oldest (started 1.0 and 2.0), 1200 + 2300 tokens; 300 blocks held
    sample = vllm(kv_usage_ratio=0.3, requests_running=2.0, requests_waiting=1.0)
    [f] = replica_fragmentation([sample], in_flight, proxied=True)
    assert (f.live_tokens, f.source, f.allocated_tokens) == (3500.0, PROXY_ESTIMATE, 4800.0)
    assert f.ratio == pytest.approx(1 - 3500 / 4800)


def test_proxy_estimate_above_the_allocation_is_not_turned_into_a_ratio():
    sample = vllm(kv_usage_ratio=0.1, requests_running=1.0)  # 100 blocks = 1600 slots
    [f] = replica_fragmentation([sample], [request(1.0, 4000)], proxied=True)
    assert (f.live_tokens, f.source, f.ratio) == (4000.0, PROXY_ESTIMATE, None)
    assert "exceed" in f.note


def test_unproxied_replica_without_engine_count_has_no_live_tokens_rather_than_zero():
    [f] = replica_fragmentation([vllm(kv_usage_ratio=0.5, requests_running=2.0)], [], proxied=False)
    assert (f.live_tokens, f.source, f.ratio) == (None, None, None)


def test_dp_ranks_behind_one_proxy_get_one_replica_level_estimate():
    ranks = [
        vllm(dp_rank="0", kv_usage_ratio=0.2, requests_running=1.0),
        vllm(dp_rank="1", kv_usage_ratio=0.1, requests_running=1.0),
    ]
    [f] = replica_fragmentation(ranks, [request(1.0, 2000), request(2.0, 1000)], proxied=True)
    assert (f.dp_rank, f.source, f.live_tokens, f.allocated_tokens) == (None, PROXY_ESTIMATE, 3000.0, 4800.0)
    assert f.ratio == pytest.approx(1 - 3000 / 4800)


def test_dp_ranks_with_engine_counts_stay_per_rank():
    ranks = [
        vllm(dp_rank="0", kv_used_blocks=10, live_tokens=150.0, requests_running=1.0),
        vllm(dp_rank="1", kv_used_blocks=20, live_tokens=310.0, requests_running=1.0),
    ]
    results = replica_fragmentation(ranks, [request(1.0, 10)], proxied=True)
    assert [(f.dp_rank, f.source, f.ratio) for f in results] == [
        ("0", ENGINE, pytest.approx(1 - 150 / 160)),
        ("1", ENGINE, pytest.approx(1 - 310 / 320)),
    ]


def test_missing_rank_running_count_makes_every_in_flight_request_count():
    assert len(running_requests([request(1.0, 1), request(2.0, 1)], None)) == 2
    assert estimated_live_tokens([request(1.0, 10, 5), request(2.0, 20, 5)], None) == 40.0


def test_no_estimate_when_the_engine_runs_requests_the_proxy_does_not_relay():
    sample = vllm(kv_usage_ratio=0.3, requests_running=3.0)
    [f] = replica_fragmentation([sample], [request(1.0, 500)], proxied=True)
    assert (f.live_tokens, f.source, f.ratio) == (None, None, None)
    assert "does not relay" in f.note
