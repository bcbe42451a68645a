"""Data-parallel vLLM (``--data-parallel-size 2``) as the CPU build really sent it, against the
engine's own per-engine counters.

``fixtures/vllm-0.32-dp2-datagrams.jsonl`` holds every datagram the plugin sent from vLLM 0.32.0
(CPU build) started by ``scripts/engines/vllm-cpu/vllm-cpu.sh`` with
``EXTRA_ARGS="--data-parallel-size 2"`` while 8 completions (``max_tokens`` 11..18, ``ignore_eos``)
ran; ``fixtures/vllm-0.32-dp2-metrics.prom`` is that engine's /metrics afterwards (vLLM labels each
series with ``engine``, the DP rank). vLLM started two API servers (``api_server_count`` defaults to
the DP size), each with a plugin for engine 0 and engine 1: four senders, two pids per rank. The
engine takes about 270 s to start with two engine cores on the 2-core test machine, too long for the
suite's real-engine budget, so the run is captured and the agent's real decode and state replay it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvwatch.requests.vllm_plugin import decode
from kvwatch.state import PluginStats

FIXTURES = Path(__file__).parent / "fixtures"


def engine_counters() -> dict[str, Counter[str]]:
    """vLLM's own counters per ``engine`` label."""
    text = (FIXTURES / "vllm-0.32-dp2-metrics.prom").read_text().replace("vllm:", "vllm_")
    out: dict[str, Counter[str]] = {
        "finished": Counter(),
        "generated": Counter(),
        "computed": Counter(),
        "preemptions": Counter(),
    }
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            engine = s.labels["engine"]
            if s.name == "vllm_request_success_total":
                out["finished"][engine] += s.value
            elif s.name == "vllm_generation_tokens_total":
                out["generated"][engine] += s.value
            elif s.name == "vllm_prompt_tokens_by_source_total" and s.labels["source"] == "local_compute":
                out["computed"][engine] += s.value
            elif s.name == "vllm_num_preemptions_total":
                out["preemptions"][engine] += s.value
    return out


def test_both_dp_ranks_arrive_as_dp_rank_0_and_1_and_agree_with_the_engines_counters() -> None:
    stats = PluginStats()
    mine: dict[str, Counter[str]] = {
        k: Counter() for k in ("finished", "generated", "computed", "preemptions")
    }
    senders: dict[str, set[int | None]] = {}
    lengths = []
    for line in (FIXTURES / "vllm-0.32-dp2-datagrams.jsonl").read_bytes().splitlines():
        decoded = decode(line, "r0", "tiny")  # the agent's decoder: engine index -> dp_rank
        rank = decoded.link.dp_rank
        assert rank == str(json.loads(line)["e"])
        senders.setdefault(rank, set()).add(decoded.link.pid)
        for step in decoded.steps:
            stats.observe(decoded.link, step)
            assert step.dp_rank == rank
        for raw in json.loads(line).get("s", []):  # counts the agent does not keep per step
            mine["generated"][rank] += raw.get("gen") or 0
            mine["computed"][rank] += raw.get("pt_comp") or 0
        mine["finished"][rank] += len(decoded.records)
        lengths += [r.output_tokens for r in decoded.records if r.max_tokens == r.output_tokens]
    units = stats.snapshot()
    for rank in ("0", "1"):
        mine["preemptions"][rank] = units[("r0", rank)].preemptions

    assert set(senders) == {"0", "1"} and set(units) == {("r0", "0"), ("r0", "1")}
    assert all(len(pids) == 2 for pids in senders.values()), senders  # two API servers per rank
    assert sorted(lengths) == list(range(11, 19))  # every request once, max_tokens as sent
    engine = engine_counters()
    for key, per_rank in mine.items():
        assert {r: float(v) for r, v in per_rank.items()} == {r: engine[key][r] for r in ("0", "1")}, key
    assert mine["finished"] == Counter({"0": 4, "1": 4})  # vLLM balanced the 8 requests
    assert all(unit.dropped == 0 for unit in units.values())
