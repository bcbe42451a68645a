"""The plugin inside the real vLLM's Python, with vLLM's own stats classes (no engine started).

One subprocess in the cached CPU vLLM venv (``vllm_harness.py``): it builds ``SchedulerStats``,
``IterationStats``, ``FinishedRequestStats``, ... exactly as vLLM 0.32 defines them, calls the plugin's
``record`` and sends to a socket the test bound with kvwatch's receiver code. Pins the plugin to the
field names of the installed vLLM, and shows that foreign objects and exploding attributes never
raise into vLLM.
"""

from __future__ import annotations

import pytest

from kvwatch.model import Outcome
from kvwatch.requests.vllm_plugin import decode
from tests.plugin.in_vllm import run_harness

pytestmark = pytest.mark.real_vllm


def test_plugin_reads_the_installed_vllm_stats_classes(tmp_path):
    result, datagrams = run_harness(
        "vllm_harness.py", str(tmp_path / "p.sock"), str(tmp_path / "absent.sock")
    )
    stalled = {k: result.pop(k) for k in list(result) if k.startswith("stalled_")}
    assert (result.pop("older_sent"), result.pop("older_failures")) == (2, 0)
    assert result == {
        "sent": 2,
        "dropped": 0,
        "failures": 1,
        "absent_sent": 0,
        "absent_dropped": 5,
        "absent_dropped_steps": 5,
    }  # each of the 5 datagrams carried its one step
    # a stalled agent: the kernel queue filled, the rest waited in the plugin and came in order
    assert stalled["stalled_waiting"] > 0 and stalled["stalled_dropped"] == 0
    assert stalled["stalled_seq"] == list(range(1, 101)) and stalled["stalled_finished"] == 200
    assert stalled["stalled_ds"] == [0]
    assert all(b"SECRET" not in d for d in datagrams)  # request ids never leave the engine
    decoded = [decode(d, "r0", "tiny") for d in datagrams]
    v012, v026 = (d for d in decoded if d.link.dp_rank == "2")
    full, foreign = (d for d in decoded if d.link.dp_rank == "1")
    assert full.link.dp_rank == "1" and full.link.seq == 1 and foreign.link.seq == 2
    assert (full.link.dropped, full.link.dropped_steps) == (0, 0)
    [s] = full.steps
    assert (s.running, s.waiting, s.kv_usage_ratio, s.preempted) == (3, 2, 0.75, 1)
    assert (s.ctx_requests, s.ctx_tokens, s.gen_requests, s.gen_tokens, s.elapsed_ms) == (1, 444, 2, 2, 12.5)
    assert (s.resumed_requests, s.resumed_queried_tokens, s.resumed_hit_tokens, s.recomputed_tokens) == (
        1,
        700,
        256,
        444,
    )
    assert [(e.lifetime_seconds, e.idle_seconds, e.reuse_gaps_seconds) for e in s.evictions] == [
        (3.0, 1.0, (0.5, 0.25)),
        (9.0, 4.0, ()),
    ]
    long, short = full.records
    assert (long.outcome, long.finish_reason, long.output_tokens, long.max_tokens, long.preemptions) == (
        Outcome.TRUNCATED,
        "length",
        64,
        64,
        2,
    )
    assert (long.queue_seconds, long.prefill_seconds, long.decode_seconds, long.e2e_seconds) == (
        0.5,
        0.25,
        1.75,
        2.5,
    )
    assert (long.prompt_tokens, long.cached_prompt_tokens) == (300, 128)
    assert (short.outcome, short.max_tokens) == (Outcome.COMPLETED, None)  # no limit: unknown, not 0
    # objects without vLLM's fields: every value unknown, nothing invented
    [f] = foreign.steps  # it finished no request: buffered until vLLM's periodic log() flushed it
    assert (f.running, f.kv_usage_ratio, f.preempted, f.recomputed_tokens, f.elapsed_ms) == (None,) * 5
    assert foreign.records == ()
    # vLLM 0.12.0's fields: what it has arrives, what it lacks is unknown (None), never 0
    [s012], [r012] = v012.steps, v012.records
    assert (s012.running, s012.kv_usage_ratio, s012.recomputed_tokens, s012.elapsed_ms) == (1, 0.5, 200, None)
    assert (r012.output_tokens, r012.max_tokens, r012.prompt_tokens, r012.queue_seconds) == (8, 8, 40, 0.25)
    assert (r012.preemptions, r012.cached_prompt_tokens) == (None, None)
    # 0.26.0: the batch shape and cached tokens arrive; per-request preemptions are still unknown
    [s026], [r026] = v026.steps, v026.records
    assert (s026.gen_tokens, s026.elapsed_ms) == (1, 3.0)
    assert (r026.cached_prompt_tokens, r026.preemptions) == (16, None)
