"""update_derived + DerivedCollector: what /metrics shows of the derived signals, and what it never shows."""

import math

from kvwatch.agent.derived import update_derived
from kvwatch.catalog import CATALOG
from kvwatch.model import DEFAULT_BANDS, TierTraffic
from kvwatch.state import NodeState

from .exported import PROXIED, exposition, scraped
from .factories import gpu, request


def test_every_derived_catalog_family_is_rendered_and_nothing_else():
    state = NodeState("n", DEFAULT_BANDS)
    scraped(state, 0.0)
    names = set(exposition(state))
    assert names == {
        spec.name
        for spec in CATALOG
        if spec.area == "derived" and spec.name != "kvwatch_gpu_pcie_link_max_bytes_per_second"
    }


def test_derived_values_with_their_labels():
    state = NodeState("n", DEFAULT_BANDS)
    state.in_flight.progress(state.in_flight.start(request(1.0, 3000, max_tokens=20_000)), 500)
    state.in_flight.progress(state.in_flight.start(request(2.0, 3000)), 400)
    for t in (0.0, 5.0):
        scraped(state, t)
    families = exposition(state)
    labels = {"replica": "r0", "model_name": "m", "backend": "vllm", "dp_rank": "0"}
    [live] = families["kvwatch_kv_live_tokens"]
    assert (live.labels, live.value) == ({**labels, "source": "proxy_estimate"}, 6900.0)
    [frag] = families["kvwatch_kv_fragmentation_ratio"]
    assert frag.value == 1 - 6900 / 8000
    [headroom] = families["kvwatch_kv_headroom_seconds"]
    assert (headroom.labels, headroom.value) == (labels, 8000 / 20.0)  # 2 sequences x 10 tokens/s
    [over] = families["kvwatch_kv_overcommitted_requests"]
    assert over.value == 1.0  # 23000 tokens > 16000 usable
    [stranded] = families["kvwatch_kv_stranded_tokens"]
    assert (stranded.labels, stranded.value) == ({"model_name": "m"}, 0.0)
    [recomputed] = [s for s in families["kvwatch_recomputed_tokens"] if s.name.endswith("_total")]
    assert (recomputed.labels["source"], recomputed.value) == ("estimate", 0.0)


def test_idle_headroom_is_rendered_as_plus_inf():
    state = NodeState("n", DEFAULT_BANDS)
    for t in (0.0, 5.0):
        scraped(state, t, requests_running=0.0)
    [headroom] = exposition(state)["kvwatch_kv_headroom_seconds"]
    assert math.isinf(headroom.value)


def test_nothing_derived_from_a_target_that_went_down_is_exported():
    state = NodeState("n", DEFAULT_BANDS)
    for t in (0.0, 5.0):
        scraped(state, t)
    state.target("r0").up = False  # the scraper marked it down; update_derived has not run yet
    assert all(samples == [] for samples in exposition(state).values())
    update_derived(state, PROXIED, now=10.0)
    assert all(samples == [] for samples in exposition(state).values())


def test_scraping_metrics_does_not_advance_the_recompute_estimate():
    state = NodeState("n", DEFAULT_BANDS)
    scraped(state, 0.0, preemptions_total=0.0)
    scraped(state, 5.0, preemptions_total=3.0)
    views = [state.derived]
    for _ in range(3):
        exposition(state)
    assert state.derived is views[0]
    [recomputed] = [s for s in exposition(state)["kvwatch_recomputed_tokens"] if s.name.endswith("_total")]
    assert recomputed.value == 3 * 8000 / 2  # 3 preemptions x 4000 allocated tokens per running request


def test_before_any_update_the_families_are_empty():
    families = exposition(NodeState("n", DEFAULT_BANDS))
    assert families and all(samples == [] for samples in families.values())


def test_tier_link_families_when_the_replica_is_mapped_to_a_gpu():
    state = NodeState("n", DEFAULT_BANDS)
    state.replica_gpus = {"r0": (("0", "GPU-0", "config"),)}
    for t, moved in ((0.0, 0.0), (10.0, 5.5e11)):
        state.gpus = (gpu(at=t, tx=moved * 1.01, rx=0.0),)
        scraped(state, t, tier_traffic=(TierTraffic("vllm_offload", "gpu", "host", bytes_total=moved),))
    families = exposition(state)
    utilization = {s.labels["direction"]: s.value for s in families["kvwatch_kv_tier_link_utilization_ratio"]}
    assert utilization["offload"] > 0.8 and utilization["onload"] == 0.0
    conditions = {
        (s.labels["direction"], s.labels["condition"]): s.value
        for s in families["kvwatch_kv_tier_link_condition"]
    }
    assert conditions[("offload", "offload_pcie_bound")] == 1.0
    assert conditions[("offload", "foreign_bus_traffic")] == 0.0
    assert conditions[("offload", "link_down_trained")] == 0.0


def test_recompute_avoided_per_byte_is_exported_per_replica_without_a_gpu_mapping():
    state = NodeState("n", DEFAULT_BANDS)
    for t, back, up in ((0.0, 0.0, 0.0), (10.0, 4000.0, 12000.0)):
        scraped(
            state,
            t,
            tier_traffic=(
                TierTraffic("sglang_hicache", "host", "gpu", tokens_total=back, bytes_total=back * 1e5),
                TierTraffic("sglang_hicache", "gpu", "host", tokens_total=up, bytes_total=up * 1e5),
            ),
        )
    [ratio] = exposition(state)["kvwatch_kv_tier_recompute_avoided_tokens_per_byte"]
    assert ratio.labels == {"replica": "r0"}
    assert math.isclose(ratio.value, 400.0 / (1600.0 * 1e5))  # 400 tokens/s back, 1,600 x 100 kB moved
