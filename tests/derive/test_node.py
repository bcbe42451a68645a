"""derive_node: the node's derived view, its rate window, and the memory it carries between calls."""

import math

import pytest

from kvwatch.derive.node import DerivedSettings, NodeInputs, derive_node, keep_window
from kvwatch.derive.pcie import link_bytes_per_second
from kvwatch.derive.recompute import PreemptionWindow
from kvwatch.model import TierTraffic

from .factories import decoding, gpu, request


def at(t: float) -> float:
    return t


@pytest.mark.parametrize(
    ("history", "newest", "expected"),
    [
        ((), 0.0, (0.0,)),
        ((0.0, 5.0), 10.0, (0.0, 5.0, 10.0)),
        ((0.0, 5.0), 5.0, (0.0, 5.0)),  # the same scrape again replaces, never duplicates
        ((0.0, 5.0), 3.0, (3.0,)),  # time went backwards: start over
        ((0.0, 10.0, 20.0, 30.0, 40.0), 45.0, (10.0, 20.0, 30.0, 40.0, 45.0)),  # keeps one at/behind the edge
        ((0.0, 10.0, 14.0, 20.0), 45.0, (14.0, 20.0, 45.0)),
    ],
)
def test_keep_window_keeps_what_the_30_s_window_needs(history, newest, expected):
    assert keep_window(history, newest, at, 30.0, 64) == expected


def test_keep_window_is_bounded_in_items():
    assert keep_window(tuple(float(t) for t in range(10)), 10.0, at, 1000.0, 4) == (7.0, 8.0, 9.0, 10.0)


def scrape(t: float, **fields):
    """A vLLM rank with 8000 free token slots and 10 sequences decoding 10 tokens/s each."""
    return decoding(t, running=10.0, tokens_per_s=100.0, **fields)


def run(samples_per_call, **inputs):
    view = None
    for samples in samples_per_call:
        now = samples[0].scraped_at if samples else 0.0
        view = derive_node(view, NodeInputs(samples=tuple(samples), **inputs), now)
    return view


def test_rates_are_measured_over_the_window_not_one_interval():
    view = run([[scrape(t)] for t in range(0, 65, 5)])
    [unit] = view.units
    assert view.baseline(unit.sample.key).scraped_at == 30.0
    assert unit.headroom.seconds == pytest.approx(8000 / 100.0)


def test_unit_that_disappears_loses_its_rate_history_but_not_its_recompute_estimate():
    calls = [
        [scrape(0.0, preemptions_total=0.0, kv_usage_ratio=0.4)],
        [scrape(5.0, preemptions_total=2.0, kv_usage_ratio=0.4)],  # 2 x 6400/10 tokens recomputed
        [],  # target down
        [scrape(60.0, preemptions_total=1.0, kv_usage_ratio=0.4)],
    ]  # restarted engine, 1 more
    view = None
    estimates = []
    for samples in calls:
        view = derive_node(view, NodeInputs(samples=tuple(samples)), 0.0)
        estimates.append([u.recomputed_tokens for u in view.units])
    assert estimates == [[0.0], [1280.0], [], [1920.0]]
    assert view.baseline(view.units[0].sample.key) is None  # history restarted with the outage


def test_engine_recompute_counter_is_passed_through_as_the_engines():
    view = run([[scrape(0.0, recomputed_tokens_total=50.0)], [scrape(5.0, recomputed_tokens_total=70.0)]])
    assert (view.units[0].recomputed_tokens, view.units[0].recomputed_source) == (70.0, "engine")


def test_proxy_estimates_and_overcommitment_only_for_proxied_replicas():
    samples = [scrape(0.0, requests_running=1.0, kv_usage_ratio=0.1)]
    flights = (request(1.0, 1000, 200, max_tokens=20_000),)
    proxied = run([samples], in_flight=flights, proxied={"r0"})
    direct = run([samples], in_flight=flights)
    estimate = proxied.fragmentation[0]
    assert (estimate.source, estimate.live_tokens) == ("proxy_estimate", 1200.0)
    assert proxied.overcommit[0].overcommit.requests == 1  # 21000 tokens > 16000 usable
    assert (direct.fragmentation[0].source, direct.overcommit) == (None, ())


def test_stranded_capacity_uses_the_window_baseline():
    def pair(t, waiting_0):
        return [
            scrape(t, dp_rank="0", requests_waiting=waiting_0, kv_usage_ratio=1.0),
            scrape(t, dp_rank="1", requests_waiting=0.0, kv_usage_ratio=0.25),
        ]

    view = run([pair(0.0, 2.0), pair(5.0, 3.0)])
    assert view.stranded[0].stranded_tokens == 750 * 16


def tiered(t: float, offloaded: float):
    return scrape(t, tier_traffic=(TierTraffic("vllm_offload", "gpu", "host", bytes_total=offloaded),))


def test_tier_links_join_the_replicas_gpus():
    view = None
    for t, offloaded, tx in [(0.0, 0.0, 0.0), (10.0, 5.5e11, 5.6e11)]:
        inputs = NodeInputs(
            samples=(tiered(t, offloaded),),
            gpus=(gpu(at=t, tx=tx, rx=0.0),),
            replica_gpus={"r0": (("0", "GPU-0", "config"),)},
            link_bandwidth=link_bytes_per_second,
        )
        view = derive_node(view, inputs, t)
    offload = next(link for link in view.tier_links if link.direction == "offload")
    assert offload.kv_bytes_per_second == 5.5e10
    assert offload.offload_pcie_bound is True
    assert offload.link_utilization == pytest.approx(5.5e10 / link_bytes_per_second(5, 16))


@pytest.mark.parametrize(
    "change",
    [
        {"gpus": (gpu(at=10.0, lost=True),)},  # a mapped GPU fell off the bus
        {"gpus": ()},  # not polled
        {"link_bandwidth": None},
        {"replica_gpus": {}},  # not mapped
    ],
)
def test_no_tier_join_without_every_mapped_gpu(change):
    first = NodeInputs(
        samples=(tiered(0.0, 0.0),),
        gpus=(gpu(at=0.0),),
        replica_gpus={"r0": (("0", "GPU-0", "config"),)},
        link_bandwidth=link_bytes_per_second,
    )
    second = NodeInputs(
        **{
            **{
                "samples": (tiered(10.0, 1e9),),
                "gpus": (gpu(at=10.0),),
                "replica_gpus": {"r0": (("0", "GPU-0", "config"),)},
                "link_bandwidth": link_bytes_per_second,
            },
            **change,
        }
    )
    view = derive_node(derive_node(None, first, 0.0), second, 10.0)
    assert view.tier_links == ()


def test_idle_unit_has_infinite_headroom_and_settings_switch_admissions():
    view = run([[scrape(0.0, requests_running=0.0)], [scrape(5.0, requests_running=0.0)]])
    assert math.isinf(view.units[0].headroom.seconds)
    grow = [[scrape(0.0)], [scrape(10.0, prompt_tokens_total=1000.0)]]
    with_admissions = run(grow).units[0].headroom.seconds
    view = None
    decode_only = DerivedSettings(include_admissions=False)
    for samples in grow:
        view = derive_node(view, NodeInputs(samples=tuple(samples)), 0.0, decode_only)
    assert with_admissions == pytest.approx(8000 / 200.0)
    assert view.units[0].headroom.seconds == pytest.approx(8000 / 100.0)


def test_preemption_windows_outlive_the_rate_window_and_an_outage():
    """A request's longest gap can be minutes old when it finishes: windows are kept for
    ``preemption_memory_s``, across target outages, per replica over all its ranks."""
    readings = [(0.0, 0.0), (5.0, 2.0), (10.0, 3.0), (15.0, 3.0), (100.0, 3.0), (105.0, 4.0)]
    calls = [
        [scrape(t, preemptions_total=p), scrape(t, dp_rank="1", preemptions_total=0.0)] for t, p in readings
    ]
    calls.insert(4, [])  # target down between 15 and 100
    view = None
    for samples in calls:
        now = samples[0].scraped_at if samples else 50.0
        view = derive_node(view, NodeInputs(samples=tuple(samples)), now)
    assert view.preemption_windows("r0") == [PreemptionWindow(0.0, 10.0), PreemptionWindow(100.0, 105.0)]
    assert view.preemption_windows("r1") == []
    short = DerivedSettings(preemption_memory_s=50.0)
    later = derive_node(view, NodeInputs(samples=(scrape(110.0, preemptions_total=4.0),)), 110.0, short)
    assert later.preemption_windows("r0") == [PreemptionWindow(100.0, 105.0)]


def test_gpu_baseline_is_the_oldest_kept_poll_once_two_are_kept():
    first = derive_node(None, NodeInputs(samples=(), gpus=(gpu(at=0.0),)), 0.0)
    assert first.gpu_baseline("GPU-0") is None
    second = derive_node(first, NodeInputs(samples=(), gpus=(gpu(at=5.0),)), 5.0)
    assert second.gpu_baseline("GPU-0").sampled_at == 0.0
    assert second.gpu_baseline("GPU-9") is None


def test_token_counted_tier_traffic_gets_bytes_for_every_gpu_of_the_rank():
    """KV bytes per token are per GPU; a TP=2 rank moves each token's KV over both GPUs' links."""
    mapped = {"r0": (("0", "GPU-0", "config"), ("1", "GPU-1", "config"))}
    view = None
    for t, tokens in [(0.0, 0.0), (10.0, 1e6)]:
        sample = scrape(t, tier_traffic=(TierTraffic("lmcache", "gpu", "host", tokens_total=tokens),))
        inputs = NodeInputs(
            samples=(sample,),
            gpus=(gpu(0, at=t), gpu(1, at=t)),
            replica_gpus=mapped,
            kv_bytes_per_token={"r0": 65536.0},
            link_bandwidth=link_bytes_per_second,
        )
        view = derive_node(view, inputs, t)
    offload = next(link for link in view.tier_links if link.direction == "offload")
    assert offload.kv_bytes_per_second == 1e6 / 10 * 65536 * 2


def test_token_counted_tier_traffic_without_bytes_per_token_has_no_byte_rate():
    view = None
    for t, tokens in [(0.0, 0.0), (10.0, 1e6)]:
        sample = scrape(t, tier_traffic=(TierTraffic("lmcache", "gpu", "host", tokens_total=tokens),))
        inputs = NodeInputs(
            samples=(sample,),
            gpus=(gpu(at=t),),
            link_bandwidth=link_bytes_per_second,
            replica_gpus={"r0": (("0", "GPU-0", "config"),)},
        )
        view = derive_node(view, inputs, t)
    offload = next(link for link in view.tier_links if link.direction == "offload")
    assert offload.kv_bytes_per_second is None
