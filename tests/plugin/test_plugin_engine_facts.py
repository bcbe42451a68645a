"""Where vLLM could not count, or counted something other than it seems, the plugin says so.

One subprocess in the cached CPU vLLM venv (``vllm_harness_engine_facts.py``) feeds the plugin vLLM 0.32's
own stats objects: ``SchedulerStats`` with its default (zeroed) ``prefix_cache_stats`` as vLLM sends it
with ``--no-enable-prefix-caching``; a KV connector's ``connector_prefix_cache_stats``; finished requests
whose durations vLLM's ``IterationStats.update_from_finished_request`` computes from timestamps that
never got set; limits as vLLM's OpenAI server resolves them; a fork while the drain lock is held. The
datagrams go through kvwatch's decoder and state.
"""

from __future__ import annotations

import json

import pytest

from kvwatch.model import Outcome
from kvwatch.requests.vllm_plugin import decode
from tests.plugin.in_vllm import run_harness

pytestmark = pytest.mark.real_vllm


@pytest.fixture(scope="module")
def sent(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("facts") / "p.sock")
    result, datagrams = run_harness("vllm_harness_engine_facts.py", path)
    by_engine: dict[int, list[dict]] = {}
    for d in map(json.loads, datagrams):
        by_engine.setdefault(d["e"], []).append(d)
    return result, by_engine


def decoded(body: dict):
    return decode(json.dumps(body).encode(), "r0", "tiny")


def test_no_recompute_is_reported_where_vllm_did_not_count(sent):
    """--no-enable-prefix-caching: vLLM still sends a zeroed PrefixCacheStats; that is not 0 recompute."""
    _, by_engine = sent
    [body] = by_engine[0]
    [step] = decoded(body).steps
    assert step.preempted == 1
    assert (step.resumed_queried_tokens, step.recomputed_tokens) == (None, None)


def test_tokens_a_kv_connector_loads_are_not_recomputed(sent):
    _, by_engine = sent
    [[with_local], [connector_only]] = (decoded(by_engine[e][0]).steps for e in (1, 2))
    # 1000 tokens: 400 in the local cache, 500 of the other 600 loaded by the connector, 100 computed
    assert (with_local.resumed_queried_tokens, with_local.resumed_hit_tokens) == (1000, 400)
    assert with_local.recomputed_tokens == 100
    # caching off: the connector was asked for all 1000 and had 500
    assert connector_only.resumed_queried_tokens is None and connector_only.recomputed_tokens == 500


def test_the_installed_vllm_records_lookups_once_per_admission(sent):
    result, by_engine = sent
    assert result["installed_has_recorder"] and result["per_admission"] is True
    assert result["per_admission_before_027"] is False  # the older shape: an upper bound
    assert all(d.get("pa") == 1 for ds in by_engine.values() for d in ds)


def test_requests_that_never_got_a_token_keep_their_datagram_and_their_outcome(sent):
    result, by_engine = sent
    error, abort, _ = result["negative"]
    # what vLLM itself computes: a prefill from scheduling to the failure for the one without a
    # token (its first token stamped at the failure), a negative queue for the one never scheduled
    assert error[1] == pytest.approx(0.5, abs=0.05) and abort[0] < 0
    [body] = by_engine[3]
    got = decoded(body)
    assert got.refused == ()
    error, abort, ok = got.records
    # no token: no prefill, no decode (vLLM's 0.5 s and 0.0 are the failure's timing, not a token's)
    assert (error.outcome, error.prefill_seconds, error.decode_seconds) == (Outcome.ERROR, None, None)
    assert error.queue_seconds == pytest.approx(0.4, abs=0.05)
    assert (abort.outcome, abort.queue_seconds, abort.prefill_seconds, abort.decode_seconds) == (
        Outcome.ABORTED,
        None,
        None,
        None,
    )
    assert abort.e2e_seconds == pytest.approx(2.0, abs=0.5)
    assert ok.prefill_seconds == pytest.approx(0.3, abs=0.05)


def test_only_a_limit_the_client_set_is_sent_as_max_tokens(sent):
    _, by_engine = sent
    [body] = by_engine[4]
    remaining_context, generation_config_default, client = decoded(body).records
    assert (remaining_context.max_tokens, generation_config_default.max_tokens, client.max_tokens) == (
        None,
        None,
        64,
    )


def test_a_forked_child_sends_under_its_own_pid_though_the_parent_held_the_lock(sent):
    result, by_engine = sent
    assert result["child_status"] == 0
    [body] = by_engine[5]
    assert body["p"] == result["child"] and body["n"] == 1 and body["d"] == 0
    assert result["failures"] == 0
