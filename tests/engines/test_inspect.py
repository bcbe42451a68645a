"""``kvwatch inspect``: text and JSON for files, stdin and URLs; clear errors with exit status 1."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from kvwatch import cli

from .helpers import FIXTURES, LLAMACPP_TINY, page


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["inspect", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_report_of_a_saved_page(capsys):
    code, out, _ = run(capsys, str(FIXTURES / "vllm_0_32_cpu_preempting.prom"))
    assert code == 0
    assert "backend  vllm" in out
    assert "[1] model tiny  dp_rank 0  (vllm>=0.32 (prompt_tokens_cached_by_source))" in out
    assert "KV capacity   2560 tokens (20 blocks x 128), dtype auto" in out
    assert "occupancy     94.7%; used blocks 18" in out
    assert "requests      running 3, waiting 2" in out
    assert "preemptions   8 " in out
    assert "missing       kv_used_tokens, kv_evictable_tokens, live_tokens" in out


def test_json_document_of_two_dp_ranks(capsys):
    code, out, _ = run(capsys, "--json", str(FIXTURES / "vllm_0_33_two_dp_ranks_offload.prom"))
    assert code == 0
    doc = json.loads(out)
    assert doc["backend"] == "vllm"
    assert [r["dp_rank"] for r in doc["replicas"]] == ["0", "1"]
    first = doc["replicas"][0]
    assert (first["kv_capacity_tokens"], first["block_size"]) == (950272.0, 64)
    assert first["preemptions_total"] == 120.0
    assert {
        "family": "vllm_tiering",
        "src_tier": "host",
        "dst_tier": "disk",
        "bytes_total": 1.6e10,
        "tokens_total": None,
        "blocks_total": None,
        "seconds_total": 8.0,
    } in first["tier_traffic"]
    assert first["histograms"]["num_preemptions"]["buckets"][-1] == ["+Inf", 1003.0]
    assert first["finished_requests_total"]["stop"] == 900.0
    assert "live_tokens" in first["missing"]
    assert any("data-parallel" in n for n in doc["notes"])


def test_forced_backend_and_stdin(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(page("sglang_0_5_8_retraction_counters.prom")))
    code, out, _ = run(capsys, "--backend", "sglang", "--json", "-")
    assert code == 0
    assert json.loads(out)["replicas"][0]["preemptions_total"] == 57.0


def test_wrong_forced_backend_fails_clearly(capsys):
    code, out, err = run(capsys, "--backend", "tgi", str(LLAMACPP_TINY))
    assert (code, out) == (1, "")
    assert err.startswith("kvwatch inspect: no engine metrics in ")
    assert "expected tgi families" in err


def test_malformed_file_fails_with_the_line(capsys, tmp_path):
    bad = tmp_path / "bad.prom"
    bad.write_text("vllm:num_requests_running 1\nvllm:kv_cache_usage_perc{ 0.5\n")
    code, _, err = run(capsys, str(bad))
    assert code == 1
    assert "is not valid Prometheus text: line 2: malformed label set" in err


def test_missing_file(capsys, tmp_path):
    code, _, err = run(capsys, str(tmp_path / "nope.prom"))
    assert code == 1 and "cannot read" in err and "nope.prom" in err


def test_help_describes_the_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["inspect", "--help"])
    out = capsys.readouterr().out
    assert "SOURCE" in out and "--backend" in out and "kvwatch inspect http://127.0.0.1:8000/metrics" in out


async def test_url_of_a_llamacpp_server_includes_slots(server, capsys):
    server.body = page(LLAMACPP_TINY)
    server.slots_body = page("llamacpp_slots_2026_two_slots.json")
    code = await asyncio.to_thread(cli.main, ["inspect", "--json", server.url])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [s["tokens_in_use"] for s in doc["slots"]] == [42, 217]
    assert doc["replicas"][0]["kv_capacity_tokens"] == 512.0
    assert "SECRET" not in json.dumps(doc)


async def test_url_of_an_html_error_page(server, capsys):
    server.body = "<html>login required</html>"
    server.content_type = "text/html"
    code = await asyncio.to_thread(cli.main, ["inspect", server.url])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"kvwatch inspect: fetch failed (not_metrics): {server.url} returned an HTML page")


def test_unreachable_url(capsys, refused_url):
    code, _, err = run(capsys, "--timeout", "5", refused_url)
    assert code == 1 and "fetch failed (connect)" in err


async def test_a_saved_llamacpp_page_reads_slots_from_slots_url(server, capsys, tmp_path):
    saved = tmp_path / "llamacpp.prom"
    saved.write_text(page(LLAMACPP_TINY))
    server.slots_body = page("llamacpp_slots_2026_two_slots.json")
    slots_url = server.url.replace("/metrics", "/slots")
    code = await asyncio.to_thread(cli.main, ["inspect", "--json", "--slots-url", slots_url, str(saved)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [s["tokens_in_use"] for s in doc["slots"]] == [42, 217]


def test_an_unreachable_slots_url_is_said_and_the_page_still_shown(capsys, refused_url):
    code, out, _ = run(capsys, "--slots-url", refused_url, str(LLAMACPP_TINY))
    assert code == 0
    assert f"slots    unavailable: {refused_url}:" in out and "backend  llamacpp" in out


@pytest.mark.parametrize("timeout", ["nan", "0", "-3", "inf"])
def test_a_timeout_that_is_no_positive_number_of_seconds_is_refused_naming_the_flag(timeout, capsys):
    # NaN raised "deadline must not be NaN" from the HTTP client; 0 and -3 blamed scrape.timeout
    from kvwatch.cli import main

    assert main(["inspect", "http://127.0.0.1:9/metrics", "--timeout", timeout]) == 2
    assert "--timeout must be a number of seconds > 0" in capsys.readouterr().err
