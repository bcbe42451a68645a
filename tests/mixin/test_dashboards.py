"""`kvwatch dashboards`: committed JSON is current, every query parses and reads known series,
the layout is sound, and the query list for the real-Prometheus test is complete."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from kvwatch.cli import main as cli
from kvwatch.mixin import dashboards as dash
from kvwatch.mixin import grafana as g
from kvwatch.mixin.dashboards import boards
from kvwatch.mixin.dashboards.check import name_problems, panel_queries, substitute, variable_selectors
from kvwatch.mixin.dashboards.fleet import fleet_board
from kvwatch.mixin.dashboards.scaffold import (
    DEFAULT_VALUES,
    FLEET_UID,
    LATENCY_UID,
    NODE_UID,
    Board,
    Options,
)

from .helpers import ROOT, run_tool, tool

DASHBOARDS = ROOT / "dashboards"
FILES = ("kvwatch-node.json", "kvwatch-latency-by-band.json", "kvwatch-fleet.json")


def _json(name: str) -> dict:
    return json.loads((DASHBOARDS / name).read_text())


def _panels(name: str) -> list[dict]:
    return [p for p in _json(name)["panels"] if p["type"] != "row"]


def _exprs(name: str) -> list[str]:
    return [t["expr"] for p in _panels(name) for t in p["targets"]]


# --------------------------------------------------------------------------------------------
# generated and committed
# --------------------------------------------------------------------------------------------


def test_committed_dashboards_are_up_to_date(capsys) -> None:
    assert cli(["dashboards", "--out", str(DASHBOARDS), "--check"]) == 0, capsys.readouterr().out


def test_check_fails_with_a_diff_when_a_committed_dashboard_was_edited(tmp_path, capsys) -> None:
    shutil.copytree(DASHBOARDS, tmp_path / "dashboards")
    target = tmp_path / "dashboards" / "kvwatch-node.json"
    target.write_text(target.read_text().replace('"KV occupancy per replica"', '"KV use"'))
    assert cli(["dashboards", "--out", str(tmp_path / "dashboards"), "--check"]) == 1
    out = capsys.readouterr().out
    assert '-      "title": "KV use",' in out and '+      "title": "KV occupancy per replica",' in out


def test_generator_refuses_a_panel_on_a_series_kvwatch_does_not_export(monkeypatch, tmp_path, capsys) -> None:
    real = dash.boards

    def with_bad_panel(opts=None):
        out = real(opts)
        bad = g.timeseries("Preemptions (typo)", [g.Query("rate(kvwatch_preemptions[5m])")], description="x")
        out[0] = Board(out[0].uid, out[0].title, out[0].description, out[0].variables, (*out[0].panels, bad))
        return out

    monkeypatch.setattr(dash, "boards", with_bad_panel)
    assert cli(["dashboards", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "kvwatch-node: Preemptions (typo): kvwatch_preemptions is not a kvwatch metric" in err
    assert not any(tmp_path.iterdir())


def test_every_query_reads_only_exported_recorded_or_allowed_series() -> None:
    assert name_problems(boards()) == []


# --------------------------------------------------------------------------------------------
# every query parses (real promtool)
# --------------------------------------------------------------------------------------------


def _promtool_parses(exprs: list[str], tmp_path) -> tuple[int, str]:
    rules = [{"record": f"dashboard:query_{i}:check", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "queries.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}))
    result = run_tool(tool("promtool"), "check", "rules", path)
    return result.returncode, result.stdout + result.stderr


def test_every_panel_and_variable_query_parses_with_promtool(tmp_path) -> None:
    exprs = [q.concrete for q in panel_queries()]
    exprs += [substitute(sel, DEFAULT_VALUES) for b in boards() for sel in variable_selectors(b)]
    rc, output = _promtool_parses(exprs, tmp_path)
    assert rc == 0, output
    assert f"SUCCESS: {len(exprs)} rules found" in output


def test_the_parse_check_catches_a_broken_query(tmp_path) -> None:
    rc, output = _promtool_parses(["sum(rate(kvwatch_preemptions_total[5m])"], tmp_path)
    assert rc != 0 and "parse error" in output


# --------------------------------------------------------------------------------------------
# the query list for the real-Prometheus test
# --------------------------------------------------------------------------------------------


def test_panel_queries_cover_every_target_of_every_dashboard() -> None:
    queries = panel_queries()
    for uid, name in ((NODE_UID, FILES[0]), (LATENCY_UID, FILES[1]), (FLEET_UID, FILES[2])):
        listed = [q.expr for q in queries if q.dashboard == uid]
        assert listed == _exprs(name)
    assert all(q.panel and q.ref_id for q in queries)


def test_panel_queries_have_no_variables_left_and_take_concrete_values() -> None:
    queries = panel_queries({"node": "127.0.0.1:9477", "__rate_interval": "30s"})
    for q in queries:
        assert not re.search(r"\$[A-Za-z_]|\[\[", q.concrete), q.concrete  # $1 of label_replace stays
    occupancy = next(q for q in queries if q.panel == "KV occupancy per replica")
    assert 'instance=~"127.0.0.1:9477"' in occupancy.concrete
    assert any("[30s]" in q.concrete for q in queries)


def test_panel_queries_flag_external_and_sparse_queries() -> None:
    queries = panel_queries()
    external = {q.panel for q in queries if q.external}
    assert external == {"Tensor core activity (dcgm-exporter)"}
    sparse = {q.panel for q in queries if q.sparse}
    assert "Firing SLO alerts" in sparse and "Engine scrape errors" in sparse
    # the "Inside the engine" row needs the vLLM plugin (an optional feature the demo does not run)
    plugin = {
        q.panel
        for q in queries
        if 'source="vllm_plugin"' in q.expr or "kvwatch_engine_step_seconds" in q.expr
    }
    assert len(plugin) == 10 and plugin <= sparse
    assert len(sparse - plugin) < len(queries) / 10  # the rest must return data against a live kvwatch


def test_substitute_names_an_unknown_variable() -> None:
    with pytest.raises(KeyError, match=r"\$bogus"):
        substitute('up{job="$bogus"}', DEFAULT_VALUES)


# --------------------------------------------------------------------------------------------
# structure
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FILES)
def test_layout_is_a_grid_without_overlaps_and_ids_are_unique(name) -> None:
    board = _json(name)
    cells: set[tuple[int, int]] = set()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))


def test_a_row_sizes_its_panels_and_add_overrides_only_the_panels_it_is_given() -> None:
    def panel(title: str) -> dict:
        return g.timeseries(title, [g.Query("up")], "x")

    lay = g.Layout()
    lay.row("first", 8, 6)
    lay.add(panel("a"), panel("b"))
    lay.add(panel("wide"), w=24, h=4)
    lay.add(panel("c"))
    lay.row("second", 12, 8)
    lay.add(panel("d"))
    pos = {p["title"]: p["gridPos"] for p in lay.panels}
    assert pos["a"] == {"x": 0, "y": 1, "w": 8, "h": 6}
    assert pos["b"] == {"x": 8, "y": 1, "w": 8, "h": 6}
    assert pos["wide"] == {"x": 0, "y": 7, "w": 24, "h": 4}  # no room left on the line: the next one
    assert pos["c"] == {"x": 0, "y": 11, "w": 8, "h": 6}  # back to the row's size
    assert pos["second"] == {"x": 0, "y": 17, "w": 24, "h": 1}
    assert pos["d"] == {"x": 0, "y": 18, "w": 12, "h": 8}


def test_a_timeseries_draws_its_thresholds_as_dashed_lines_only_when_it_has_some() -> None:
    def style(panel: dict) -> str:
        return panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"]

    plain = g.timeseries("plain", [g.Query("up")], "x")
    marked = g.timeseries("marked", [g.Query("up")], "x", thresholds=((None, "green"), (0.2, "red")))
    assert (style(plain), style(marked)) == ("off", "dashed")
    share = g.timeseries("share", [g.Query("up")], "x", g.Axis("percentunit", 0, 1))
    assert {k: share["fieldConfig"]["defaults"].get(k) for k in ("unit", "min", "max")} == {
        "unit": "percentunit",
        "min": 0,
        "max": 1,
    }
    assert "min" not in plain["fieldConfig"]["defaults"] and "max" not in plain["fieldConfig"]["defaults"]


def test_alerting_panels_mark_the_threshold_the_shipped_alert_uses(monkeypatch) -> None:
    from kvwatch.mixin.dashboards import node
    from kvwatch.mixin.thresholds import AlertConfig

    monkeypatch.setattr(node, "SHIPPED_ALERTS", AlertConfig(recompute_waste_ratio=0.35))
    board = node.node_board(Options()).json()
    waste = next(p for p in board["panels"] if p["title"] == "Recompute waste")
    steps = waste["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps == [{"color": "green", "value": None}, {"color": "red", "value": 0.35}]
    assert "KVWatchRecomputeWaste fires above 35%" in waste["description"]


@pytest.mark.parametrize("name", FILES)
def test_panel_titles_are_unique_within_a_dashboard(name) -> None:
    titles = [p["title"] for p in _panels(name)]
    assert len(titles) == len(set(titles))


@pytest.mark.parametrize("name", FILES)
def test_panels_use_the_datasource_variable_and_rate_interval(name) -> None:
    board = _json(name)
    assert board["templating"]["list"][0]["type"] == "datasource"
    for p in _panels(name):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["description"], p["title"]
        for t in p["targets"]:
            for window in re.findall(r"(?:rate|increase)\([^\[]*\[([^\]]+)\]", t["expr"]):
                assert window in ("$__rate_interval", "$__range"), (p["title"], t["expr"])


@pytest.mark.parametrize("name", FILES)
def test_every_variable_a_query_uses_is_defined(name) -> None:
    board = _json(name)
    defined = {v["name"] for v in board["templating"]["list"]}
    builtin = {"__rate_interval", "__range", "__interval"}
    for expr in _exprs(name):
        used = set(re.findall(r"\$([A-Za-z_]\w*)", expr))
        assert used <= defined | builtin, (expr, used - defined)


@pytest.mark.parametrize("name", FILES)
def test_merged_tables_join_queries_without_a_metric_name(name) -> None:
    # Grafana's merge joins rows only where the fields they share agree: raw selectors of four
    # families each carry their own __name__, and the PCIe table showed four rows per GPU
    bare = re.compile(r"^\s*[A-Za-z_:][\w:]*\s*(\{[^}]*\})?\s*$")
    for panel in _panels(name):
        merged = any(t.get("id") == "merge" for t in panel.get("transformations", []))
        if merged and len(panel["targets"]) > 1:
            raw = [t["expr"] for t in panel["targets"] if bare.match(t["expr"])]
            assert len(raw) < 2, (panel["title"], raw)  # one alone has no other name to disagree with


@pytest.mark.parametrize("name", FILES)
def test_a_variables_query_uses_only_variables_defined_before_it(name) -> None:
    # the fleet board's Model list filtered on $node, which it does not define: always empty
    defined = {"__rate_interval", "__range", "__interval"}
    for variable in _json(name)["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else ""
        used = set(re.findall(r"\$([A-Za-z_]\w*)", text))
        assert used <= defined, (variable["name"], text, used - defined)
        defined.add(variable["name"])


def test_variables_for_cluster_node_model_replica_and_band() -> None:
    names = {b.uid: [v["name"] for v in b.json()["templating"]["list"]] for b in boards()}
    assert names[NODE_UID] == ["datasource", "cluster", "job", "node", "model", "replica"]
    assert names[LATENCY_UID][:6] == ["datasource", "cluster", "node", "model", "replica", "band"]
    assert names[FLEET_UID] == ["datasource", "cluster", "job", "model"]
    node = next(v for v in boards()[0].json()["templating"]["list"] if v["name"] == "node")
    assert node["allValue"] == ".*" and node["includeAll"]  # "All" also matches series without the label


def test_slo_target_variables_offer_only_bucket_boundaries() -> None:
    variables = {v["name"]: v for v in boards()[1].json()["templating"]["list"]}
    from kvwatch import buckets

    assert variables["tpot_slo"]["query"].split(",") == [buckets.le_label(b) for b in buckets.TPOT_SECONDS]
    assert variables["ttft_slo"]["current"]["value"] in variables["ttft_slo"]["query"].split(",")


def test_gpu_table_links_to_the_dcgm_exporter_dashboard_by_uuid() -> None:
    table = next(p for p in _panels(FILES[0]) if p["title"].startswith("GPUs (open in the DCGM"))
    [link] = table["fieldConfig"]["defaults"]["links"]
    assert link["url"].startswith("/d/Oxed_c6Wz/")
    assert "var-UUID=${__data.fields.uuid}" in link["url"] and "var-gpu=${__data.fields.gpu}" in link["url"]
    assert any(lk.get("url") == "/d/Oxed_c6Wz" for lk in _json(FILES[0])["links"])


def test_dcgm_dashboard_uid_is_configurable(tmp_path) -> None:
    assert cli(["dashboards", "--out", str(tmp_path), "--dcgm-dashboard-uid", "my-dcgm"]) == 0
    text = (tmp_path / "kvwatch-node.json").read_text()
    assert "/d/my-dcgm/" in text and "Oxed_c6Wz" not in text


@pytest.mark.parametrize(
    ("name", "titles"),
    [
        (
            FILES[0],
            [
                "KV occupancy per replica",
                "Internal fragmentation",
                "KV headroom",
                "Preemptions",
                "Recompute waste",
                "KV tier traffic (engine)",
                "PCIe traffic (NVML) and link bandwidth",
                "GPU memory",
                "NVLink traffic",
                "Clock events (throttling)",
                "XIDs and ECC errors",
            ],
        ),
        (
            FILES[1],
            [f"{m} p{q}" for m in ("TTFT", "TPOT", "End to end") for q in (50, 90, 99)]
            + [
                "Inter-chunk gap p99",
                "Burn rate, 1h",
                "Error budget left",
                "Finished requests by outcome",
                "In flight by admission band",
                "Output length distribution",
            ],
        ),
        (
            FILES[2],
            [
                "Stranded KV tokens per model",
                "Fullest KV caches",
                "Least KV headroom",
                "Most preemptions",
                "Error budget left",
            ],
        ),
    ],
)
def test_dashboards_have_the_panels_on_call_needs(name, titles) -> None:
    present = {p["title"] for p in _panels(name)}
    assert set(titles) <= present, set(titles) - present


def test_latency_quantiles_are_per_band_from_kvwatch_histograms() -> None:
    p99 = next(p for p in _panels(FILES[1]) if p["title"] == "TPOT p99")
    assert p99["targets"][0]["expr"] == (
        "histogram_quantile(0.99, sum by (le, length_band) (rate(kvwatch_request_tpot_seconds_bucket{"
        'cluster=~"$cluster", instance=~"$node", model_name=~"$model", replica=~"$replica", '
        'length_band=~"$band"}[$__rate_interval])))'
    )


def test_gpu_panels_are_not_filtered_by_model_or_replica() -> None:
    """GPU series have no model or replica label: filtering on them would blank the panels."""
    gpu_exprs = [e for e in _exprs(FILES[0]) if "kvwatch_gpu_memory_used_bytes" in e]
    assert gpu_exprs and all("model_name" not in e and "replica" not in e for e in gpu_exprs)


def test_options_are_threaded_through() -> None:
    fleet = fleet_board(Options(job="agents")).json()
    job = next(v for v in fleet["templating"]["list"] if v["name"] == "job")
    assert job["current"]["value"] == "agents" and not job["includeAll"]
