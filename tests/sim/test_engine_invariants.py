"""Invariants that must hold at every step of every workload (property tests with hypothesis)."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwatch.sim.engine import SimEngine

from .helpers import small_config

request = st.tuples(
    st.sampled_from([0.0, 0.0, 0.001, 0.01, 0.05, 0.5]),  # gap to the previous arrival (sim s)
    st.integers(1, 60),  # prompt tokens
    st.integers(1, 100),  # output tokens the model would produce
    st.one_of(st.none(), st.integers(1, 100)),  # max_tokens
)
engine_setup = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4, 16]),
        "spare_blocks": st.integers(0, 24),  # cache beyond the minimum that fits one request
        "max_num_seqs": st.integers(1, 12),
        "chunk": st.sampled_from([None, 16, 48]),  # None: budget larger than any prompt
    }
)


def build(setup: dict, prefix_caching: bool = False, offload: bool = False) -> SimEngine:
    bs = setup["block_size"]
    max_len = 160
    blocks = math.ceil((max_len + 1) / bs) + setup["spare_blocks"]
    budget = setup["chunk"] or 1024
    return SimEngine(
        small_config(
            block_size=bs,
            num_gpu_blocks_override=blocks,
            max_model_len=max_len,
            max_num_seqs=min(setup["max_num_seqs"], budget),
            max_num_batched_tokens=max(budget, setup["max_num_seqs"]),
            enable_prefix_caching=prefix_caching,
            kv_offload_bytes=4e9 if offload else 0.0,
        )
    )


def drive(e: SimEngine, reqs, aborts, on_step) -> None:
    """Submit at arrival times, step one at a time, abort some requests between steps."""
    t = 0.0
    pending = []
    for i, (gap, prompt, output, max_tokens) in enumerate(reqs):
        t += gap
        pending.append((t, str(i), prompt, output, max_tokens))
    k = 0
    step_no = 0
    while k < len(pending) or e.has_work():
        while k < len(pending) and pending[k][0] <= e.now:
            at, rid, prompt, output, max_tokens = pending[k]
            e.submit(
                rid,
                prompt,
                max_tokens if prompt + (max_tokens or 0) <= 160 else None,
                output,
                arrival=at,
                prefix_id="sys" if prompt >= 20 else None,
                prefix_tokens=min(prompt, 20),
            )
            k += 1
        if not e.has_work():
            e.advance_to(pending[k][0])
            continue
        before = {v.request_id: v for v in e.requests()}
        free_before = e.free_blocks
        assert e.step(), "an engine with admissible work must make progress"
        on_step(e, before, free_before)
        step_no += 1
        if step_no in aborts and e.running_ids():
            e.abort(e.running_ids()[aborts[step_no] % len(e.running_ids())])
        assert step_no < 100_000


def check_usage(e: SimEngine) -> None:
    e.check_invariants()
    running = [v for v in e.requests() if v.running]
    assert e.used_blocks == sum(math.ceil(v.kv_tokens / e.config.block_size) for v in running)
    assert e.kv_usage == e.used_blocks / e.capacity_blocks
    assert e.live_tokens == sum(v.kv_tokens for v in running)
    assert e.free_blocks == e.capacity_blocks - e.used_blocks >= 0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(request, min_size=1, max_size=25),
    engine_setup,
    st.dictionaries(st.integers(1, 300), st.integers(0, 50), max_size=4),
)
def test_kv_usage_equals_sum_of_ceil_blocks_at_every_step(reqs, setup, aborts):
    e = build(setup)
    drive(e, reqs, aborts, lambda e, before, free: check_usage(e))
    assert e.used_blocks == 0 and e.live_tokens == 0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request, min_size=1, max_size=25), engine_setup)
def test_preemption_happens_only_when_no_block_is_free(reqs, setup):
    bs = setup["block_size"]
    setup = {**setup, "chunk": None}  # whole prompts: the running set is all decoding sequences

    def check(e, before, free_before):
        decoding = [v for v in before.values() if v.state == "decode"]
        demand = sum(1 for v in decoding if v.kv_tokens % bs == 0)  # sequences crossing a block edge
        if e.last_step.preempted:
            assert demand > free_before, "preempted although the decode batch fit"
        else:
            assert demand <= free_before, "the batch did not fit, yet nothing was preempted"

    drive(build(setup), reqs, {}, check)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(request, min_size=1, max_size=25),
    engine_setup,
    st.dictionaries(st.integers(1, 300), st.integers(0, 50), max_size=4),
    st.booleans(),
    st.booleans(),
)
def test_every_request_ends_in_exactly_one_outcome(reqs, setup, aborts, prefix_caching, offload):
    e = build(setup, prefix_caching, offload)
    seen: dict[str, str] = {}

    def record(view):
        assert view.request_id not in seen, "a request ended twice"
        seen[view.request_id] = view.finish_reason

    e.on_finish = record

    def check(e, before, free):
        e.check_invariants()
        assert e.arrived == e.completed + e.truncated + e.aborted + e.in_system

    drive(e, reqs, aborts, check)
    assert e.in_system == 0 and len(seen) == e.arrived == len(reqs)
    assert e.completed == sum(1 for r in seen.values() if r == "stop")
    assert e.truncated == sum(1 for r in seen.values() if r == "length")
    assert e.aborted == sum(1 for r in seen.values() if r == "abort")
    assert e.used_blocks == 0 and e.host_blocks_used == 0
    # every generated token of a finished request was counted once
    finished = [e.request(rid) for rid, r in seen.items() if r != "abort"]
    assert all(v.generated_tokens >= 1 for v in finished)
