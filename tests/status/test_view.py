"""build_view: what the status page shows comes from the state and the derived view, unchanged."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kvwatch.buckets import Histogram
from kvwatch.derive.quantiles import histogram_quantile
from kvwatch.status.cells import replica_table
from kvwatch.status.view import ALL, build_view, view_from_dict, view_to_dict

from .node import T0, populated_state


@pytest.fixture
def view():
    state, cfg = populated_state()
    return build_view(state, cfg, T0 + 11)


def test_every_configured_replica_appears_in_config_order(view) -> None:
    assert [r.name for r in view.replicas] == ["r0", "r1", "s0"]
    assert view.node == "gpu-node-7"


def test_down_replica_shows_its_error_and_no_stale_units(view) -> None:
    s0 = view.replicas[2]
    assert not s0.up
    assert s0.units == ()
    assert "connection refused" in s0.last_error


def test_kv_values_are_the_derived_views(view) -> None:
    state, cfg = populated_state()
    derived = state.derived
    r0 = build_view(state, cfg, T0 + 11).replicas[0].units[0]
    frag = next(f for f in derived.fragmentation if f.replica == "r0")
    unit = next(u for u in derived.units if u.sample.replica == "r0")
    assert r0.live_tokens == frag.live_tokens == 800 * 26 + sum(3000 + 100 * i for i in range(26))
    assert r0.live_source == "proxy_estimate"
    assert r0.fragmentation_ratio == frag.ratio
    assert r0.headroom_seconds == unit.headroom.seconds
    assert r0.headroom_note == unit.headroom.note
    assert r0.preemptions_per_second == pytest.approx(0.2)  # 10 -> 12 in 10 s
    assert r0.kv_capacity_tokens == 20000 * 16  # vLLM keeps one null block
    assert r0.kv_usage_ratio == pytest.approx(0.70)


def test_stranded_capacity_is_the_idle_replicas_free_tokens(view) -> None:
    (stranded,) = view.stranded
    assert stranded.model_name == "qwen3-32b"
    assert stranded.stranded_tokens == pytest.approx(view.replicas[1].units[0].kv_free_tokens)
    assert (stranded.idle_units, stranded.pressured_units) == (1, 1)


def test_band_quantiles_use_prometheus_rule_on_merged_histograms(view) -> None:
    state, _cfg = populated_state()
    hists, _outcomes, _ = state.requests.snapshot()
    ttft = Histogram(next(iter(hists.values()))["kvwatch_request_ttft_seconds"].bounds)
    for (_replica, _m, band, _source), fams in hists.items():
        if band == "0-1k":  # r0 via proxy, r1 via otlp (no proxy in front of it)
            h = fams["kvwatch_request_ttft_seconds"]
            ttft.merge_bins(h.bounds, h.bins, h.sum)
    row = next(b for b in view.band_rows if b.replica == ALL and b.band == "0-1k")
    assert row.requests == 11
    assert row.ttft_p99_seconds == pytest.approx(histogram_quantile(0.99, ttft.bounds, ttft.bins))
    r1 = next(b for b in view.band_rows if b.replica == "r1")
    assert r1.requests == 1 and r1.band == "0-1k"


def test_outcomes_per_band(view) -> None:
    long = next(b for b in view.band_rows if b.replica == "r0" and b.band == "10k-20k")
    assert long.outcomes["completed"] == 8 and long.outcomes["truncated"] == 2
    assert long.truncated_ratio == pytest.approx(0.2)
    unknown = next(b for b in view.band_rows if b.replica == ALL and b.band == "unknown")
    assert unknown.outcomes["error"] == 1
    assert unknown.ttft_p50_seconds is None


def test_gpu_memory_and_pcie_rates(view) -> None:
    g0, g1 = view.gpus
    assert g0.memory_used_bytes == 120 * 2**30
    assert g0.pcie_tx_bytes_per_second == pytest.approx(5e10 / 10)
    assert g0.pcie_rx_bytes_per_second == pytest.approx(1e10 / 10)
    assert g0.pcie_link_bytes_per_second == pytest.approx(16 * 32e9 * 128 / 130 / 8)
    assert g0.replicas == ("r0",)
    assert g1.pcie_tx_bytes_per_second == pytest.approx(5e8 / 10)


def test_json_round_trip_is_strict_and_lossless(view) -> None:
    text = json.dumps(view_to_dict(view), allow_nan=False)
    back = view_from_dict(json.loads(text))
    assert back == view
    r1 = back.replicas[1].units[0]
    assert math.isinf(r1.headroom_seconds)  # "+Inf" in JSON


def test_view_carries_only_known_fields(view) -> None:
    """No free text from requests: the only strings are names, notes and errors."""
    data = view_to_dict(view)
    assert set(data) == {
        "node",
        "generated_at",
        "agent_started_at",
        "bands",
        "replicas",
        "stranded",
        "band_rows",
        "gpus",
        "requests_observed",
        "derived_at",
        "notes",
    }


def test_view_before_any_scrape_says_so() -> None:
    from kvwatch.state import NodeState

    from .node import config

    cfg = config()
    view = build_view(NodeState("n", cfg.length_bands), cfg, T0)
    assert [r.up for r in view.replicas] == [False, False, False]
    assert view.replicas[0].last_error == "not scraped yet"
    assert view.notes and "not computed yet" in view.notes[0]


def test_rejects_a_document_that_is_not_a_view() -> None:
    with pytest.raises(ValueError, match="not a kvwatch status view"):
        view_from_dict({"hello": 1})


def test_fragmentation_from_the_proxys_estimate_is_marked_as_an_estimate(view) -> None:
    table = replica_table(view)
    live, frag = table.headers.index("live tokens"), table.headers.index("fragment.")
    r0 = next(row for row in table.rows if row.key.startswith("replica:r0:"))
    assert view.replicas[0].units[0].fragmentation_ratio is not None  # r0's live tokens are the estimate
    assert r0.cells[live].endswith(" est") and r0.cells[frag].endswith(" est")


def test_rows_of_one_replica_serving_several_models_have_their_own_ids(view) -> None:
    # a Dynamo frontend reports a unit per model, no rank: the page's updates crossed the rows
    from kvwatch.status.cells import display

    r0 = view.replicas[0]
    (unit,) = r0.units
    models = (
        dataclasses.replace(unit, model_name="llama-8b"),
        dataclasses.replace(unit, model_name="qwen-32b"),
    )
    two = dataclasses.replace(view, replicas=(dataclasses.replace(r0, units=models), *view.replicas[1:]))
    keys = [row.key for row in replica_table(two).rows]
    assert len(keys) == len(set(keys))
    cells = display(two).cells
    model = replica_table(two).headers.index("model")
    assert {cells[f"{k}/{model}"] for k in keys if k.startswith("replica:r0:")} == {"llama-8b", "qwen-32b"}
    assert replica_table(view).rows[0].key == "replica:r0:-"  # one unit a rank: the id stays short


def test_ranks_behind_one_proxy_show_the_replicas_live_estimate(view) -> None:
    r0 = view.replicas[0]
    (unit,) = r0.units
    ranks = tuple(
        dataclasses.replace(unit, dp_rank=r, live_tokens=None, fragmentation_ratio=None) for r in "01"
    )
    dp = dataclasses.replace(r0, units=ranks, live_tokens_estimate=5_000.0, fragmentation_estimate=0.1)
    table = replica_table(dataclasses.replace(view, replicas=(dp, *view.replicas[1:])))
    live, frag = table.headers.index("live tokens"), table.headers.index("fragment.")
    rows = [row for row in table.rows if row.key.startswith("replica:r0:")]
    assert [(row.cells[live], row.cells[frag]) for row in rows] == [("5k est", "10.0% est")] * 2


def test_a_note_that_comes_or_goes_changes_the_layout(view) -> None:
    # notes are not cells: a page opened before the first derive kept "not computed yet" for good
    from kvwatch.status.cells import display

    noted = dataclasses.replace(view, notes=("derived KV signals not computed yet",))
    assert display(noted).layout != display(view).layout
