"""Engine behaviours: scheduling, KV blocks, preemption, finish reasons, timing (kvwatch/sim/engine.py)."""

from __future__ import annotations

import math

import pytest

from kvwatch.sim.engine import EngineConfig, SimEngine

from .helpers import LLAMA_8B, small_config


def drain(e: SimEngine) -> None:
    e.run_until_idle()
    e.check_invariants()


def test_request_stops_at_its_target_output_length(make_engine):
    e = make_engine()
    e.submit("a", 10, 100, 5, trace=True)
    drain(e)
    v = e.request("a")
    assert (v.state, v.finish_reason, v.generated_tokens) == ("finished", "stop", 5)
    assert len(v.token_times) == 5
    assert v.token_times[0] == v.first_token and v.token_times[-1] == v.last_token == v.finished
    assert all(b > a for a, b in zip(v.token_times, v.token_times[1:], strict=False))
    assert e.used_blocks == 0 and e.live_tokens == 0
    assert e.stats.success["stop"] == 1 and e.stats.generation_tokens == 5


def test_max_tokens_cuts_the_output_with_finish_reason_length(make_engine):
    e = make_engine()
    e.submit("a", 10, 7, 50)
    drain(e)
    v = e.request("a")
    assert (v.finish_reason, v.generated_tokens) == ("length", 7)
    assert e.truncated == 1 and e.stats.success["length"] == 1


def test_ignore_eos_generates_the_whole_budget(make_engine):
    e = make_engine()
    e.submit("a", 10, 30, 3, ignore_eos=True)
    drain(e)
    assert e.request("a").generated_tokens == 30
    assert e.request("a").finish_reason == "length"


def test_missing_max_tokens_means_up_to_the_context_length(make_engine):
    e = make_engine(max_model_len=100)
    e.submit("a", 40, None, 500)
    drain(e)
    assert e.request("a").generated_tokens == 60


def test_decoding_takes_a_new_block_every_block_size_tokens(make_engine):
    e = make_engine(block_size=4)
    e.submit("a", 4, 40, 40)
    e.step()  # prefill: 4 prompt tokens + the first sampled token -> 5 tokens, 2 blocks
    blocks = []
    while e.has_work():
        v = e.request("a")
        blocks.append((v.kv_tokens, e.used_blocks))
        e.step()
    assert blocks[0] == (5, 2)
    assert all(used == math.ceil(tokens / 4) for tokens, used in blocks)
    assert e.used_blocks == 0


def test_preemption_takes_the_newest_request_and_requeues_it_at_the_front():
    # 12 blocks of 4 = 48 tokens; two requests of 8 prompt tokens each that want 30 more tokens
    e = SimEngine(small_config(num_gpu_blocks_override=12, max_model_len=40, max_num_seqs=2))
    e.submit("old", 8, 30, 30)
    e.submit("new", 8, 30, 30)
    e.submit("late", 8, 5, 5)  # waits: max_num_seqs=2
    while not e.preemptions_total:
        e.step()
    assert e.running_ids() == ["old"]
    # the victim goes back to the FRONT of the queue, ahead of the request that was already waiting
    assert e.preempted_ids() == ["new"] and e.waiting_ids() == ["new", "late"]
    victim = e.request("new")
    assert victim.kv_tokens == 0 and victim.generated_tokens > 0
    drain(e)
    assert e.request("new").first_scheduled < e.request("late").first_scheduled
    new = e.request("new")
    assert new.generated_tokens == 30 and new.preemptions >= 1
    # its prompt and the tokens generated before preemption were prefilled again
    assert new.recomputed_tokens >= 8 + victim.generated_tokens
    assert e.recomputed_tokens_total == sum(e.request(r).recomputed_tokens for r in ("old", "new", "late"))
    assert e.stats.h_num_preemptions.count == 3


def test_no_request_is_admitted_in_a_step_that_preempted():
    e = SimEngine(small_config(num_gpu_blocks_override=12, max_model_len=40))
    e.submit("old", 8, 30, 30)
    e.submit("new", 8, 30, 30)
    while not e.last_step.preempted:
        e.step()
    assert e.last_step.admitted == 0


def test_abort_frees_the_requests_blocks_at_once(make_engine):
    e = make_engine()
    e.submit("a", 20, 50, 50)
    e.submit("b", 20, 50, 50)
    for _ in range(5):
        e.step()
    held = e.request("a").kv_blocks
    before = e.used_blocks
    assert e.abort("a")
    assert e.used_blocks == before - held
    assert e.request("a").state == "aborted" and e.request("a").finish_reason == "abort"
    assert not e.abort("a") and not e.abort("nobody")
    e.check_invariants()
    # vLLM does not count client aborts in request_success_total
    assert e.stats.success["abort"] == 0 and e.aborted == 1


def test_abort_of_a_waiting_request_leaves_the_queue(make_engine):
    e = make_engine(max_num_seqs=1)
    e.submit("a", 10, 20, 20)
    e.submit("b", 10, 20, 20)
    e.step()
    assert e.num_waiting == 1
    e.abort("b")
    assert e.num_waiting == 0 and e.waiting_ids() == []
    drain(e)
    assert e.completed == 1


def test_chunked_prefill_splits_a_prompt_over_the_token_budget(make_engine):
    e = make_engine(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=300, num_gpu_blocks_override=128)
    e.submit("a", 200, 5, 5)
    chunks = []
    while e.request("a").first_token is None:
        e.step()
        chunks.append(e.last_step.prefill_tokens)
    assert chunks == [64, 64, 64, 8]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    cfg = small_config(enable_chunked_prefill=False, max_num_batched_tokens=200, max_num_seqs=8)
    e = SimEngine(cfg)
    e.submit("a", 150, 20, 20)
    e.submit("b", 150, 20, 20)
    e.step()
    assert e.running_ids() == ["a"] and e.last_step.prefill_tokens == 150


def test_prefix_caching_shares_prompt_prefix_blocks(make_engine):
    e = make_engine(enable_prefix_caching=True, block_size=4)
    e.submit("a", 30, 10, 10, prefix_id="sys", prefix_tokens=16)
    e.step()
    e.submit("b", 30, 10, 10, prefix_id="sys", prefix_tokens=16)
    e.step()
    assert e.request("b").cached_tokens == 16
    assert e.stats.prefix_queries == 60 and e.stats.prefix_hits == 16
    # both hold 31 tokens (8 blocks each) but the 4 prefix blocks are stored once
    assert e.used_blocks == 8 + 8 - 4
    e.check_invariants()
    drain(e)
    assert e.used_blocks == 0 and e.evictable_blocks == 4  # cached, free to evict
    e.submit("c", 30, 10, 10, prefix_id="sys", prefix_tokens=16)
    e.step()
    assert e.request("c").cached_tokens == 16 and e.evictable_blocks == 0


def test_cpu_offload_keeps_the_victims_kv_and_loads_it_back():
    cfg = small_config(num_gpu_blocks_override=12, max_model_len=40, kv_offload_bytes=1e9)
    e = SimEngine(cfg)
    e.submit("old", 8, 30, 30)
    e.submit("new", 8, 30, 30)
    while not e.preemptions_total:
        e.step()
    v = e.request("new")
    assert v.offloaded_tokens == 8 + v.generated_tokens
    stored = math.ceil(v.offloaded_tokens / 4) * e.block_bytes
    assert e.stats.offload_store_bytes == stored
    drain(e)
    assert e.stats.offload_load_bytes == stored
    assert e.request("new").recomputed_tokens == 0  # loaded, not recomputed
    assert e.stats.external_hits == v.offloaded_tokens
    assert e.host_blocks_used == 0


def test_decode_step_time_is_memory_bound():
    cfg = EngineConfig(model=LLAMA_8B, max_model_len=4096)
    e = SimEngine(cfg)
    e.submit("a", 1000, 10, 10)
    e.step()
    e.step()  # one decoding sequence holding 1001 tokens
    mem = cfg.memory()
    bandwidth = cfg.gpu.hbm_bandwidth * cfg.mem_efficiency
    expected = (
        cfg.step_overhead_s + (mem.weight_bytes_per_gpu + 1001 * mem.kv_bytes_per_token_per_gpu) / bandwidth
    )
    assert e.last_step.duration == pytest.approx(expected)


def test_long_prefill_step_time_is_compute_bound():
    cfg = EngineConfig(model=LLAMA_8B, max_model_len=16384)
    e = SimEngine(cfg)
    e.submit("a", 8000, 10, 10)
    e.step()
    flops = 2 * LLAMA_8B.active_params * 8000 / (cfg.gpu.bf16_flops * cfg.compute_efficiency)
    assert e.last_step.duration == pytest.approx(cfg.step_overhead_s + flops)


def test_every_token_after_the_first_is_one_inter_token_latency_sample():
    e = SimEngine(small_config(num_gpu_blocks_override=12, max_model_len=40))
    for i in range(4):
        e.submit(str(i), 8, 25, 25)
    drain(e)
    assert e.preemptions_total > 0
    assert e.stats.h_itl.count == e.stats.generation_tokens - 4
    assert e.stats.h_ttft.count == e.stats.h_e2e.count == 4


def test_subscriber_sees_token_totals_and_the_finish_reason(make_engine):
    e = make_engine()
    seen = []
    e.submit("a", 10, 6, 20)
    e.subscribe("a", seen.append)
    e.advance_to(e.now + 0.0001)
    e.advance_to(e.now + 10)
    assert sum(ev.new_tokens for ev in seen) == 6
    assert seen[-1].generated_tokens == 6 and seen[-1].finish_reason == "length"
    assert all(ev.finish_reason is None for ev in seen[:-1])


def test_idle_engine_jumps_to_the_next_arrival(make_engine):
    e = make_engine()
    e.submit("a", 10, 5, 5, arrival=100.0)
    e.advance_to(50.0)
    assert e.now == 50.0 and e.steps == 0
    e.advance_to(200.0)
    assert e.request("a").first_scheduled == 100.0


def test_submit_rejects_what_vllm_would_reject(make_engine):
    e = make_engine(max_model_len=100)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        e.submit("a", 90, 20, 5)
    e.submit("a", 10, 20, 5)
    with pytest.raises(ValueError, match="already in this engine"):
        e.submit("a", 10, 20, 5)


def test_config_errors_name_the_knob():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SimEngine(small_config(max_num_batched_tokens=8, max_num_seqs=16))
    with pytest.raises(ValueError, match="could never fit"):
        SimEngine(small_config(num_gpu_blocks_override=10, max_model_len=200))
