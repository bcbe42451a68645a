"""Stranded capacity: free KV on idle units of a model while another unit of it queues or preempts."""

import pytest

from kvwatch.derive.recompute import is_preempting
from kvwatch.derive.stranded import stranded_capacity

from .factories import vllm


def unit(
    rank: str,
    used: int,
    waiting: float = 0.0,
    preemptions: float = 0.0,
    model: str = "m",
    replica: str = "r0",
):
    """A rank of 1000 usable blocks x 16 tokens with ``used`` blocks held."""
    return vllm(
        replica=replica,
        dp_rank=rank,
        model_name=model,
        kv_used_blocks=used,
        requests_waiting=waiting,
        preemptions_total=preemptions,
    )


def test_balanced_ranks_strand_nothing():
    result = stranded_capacity([unit("0", 500), unit("1", 500)], {})
    assert result["m"].stranded_tokens == 0.0
    assert (result["m"].idle_units, result["m"].pressured_units) == (2, 0)


def test_queueing_rank_strands_the_free_blocks_of_idle_ranks():
    current = [unit("0", 1000, waiting=4), unit("1", 400), unit("2", 900)]
    result = stranded_capacity(current, {})
    assert result["m"].stranded_tokens == (600 + 100) * 16
    assert (result["m"].idle_units, result["m"].pressured_units) == (2, 1)


def test_a_single_replica_cannot_strand_memory():
    assert stranded_capacity([unit("0", 1000, waiting=9)], {})["m"].stranded_tokens == 0.0


def test_models_do_not_pool_with_each_other():
    current = [unit("0", 1000, waiting=3, model="a"), unit("0", 100, model="b", replica="r1")]
    result = stranded_capacity(current, {})
    assert (result["a"].stranded_tokens, result["b"].stranded_tokens) == (0.0, 0.0)


def test_preempting_rank_counts_as_pressure_without_a_queue():
    before = {u.key: u for u in [unit("0", 1000, preemptions=5), unit("1", 200, preemptions=0)]}
    now = [unit("0", 1000, preemptions=7), unit("1", 200, preemptions=0)]
    result = stranded_capacity(now, before)
    assert result["m"].stranded_tokens == 800 * 16
    assert result["m"].pressured_units == 1


def test_preempting_rank_is_not_idle_itself():
    before = {u.key: u for u in [unit("0", 100, preemptions=1), unit("1", 1000, waiting=2)]}
    now = [unit("0", 100, preemptions=2), unit("1", 1000, waiting=2)]
    assert stranded_capacity(now, before)["m"].stranded_tokens == 0.0


@pytest.mark.parametrize(
    ("before", "now", "expected"),
    [
        (5.0, 7.0, True),
        (5.0, 5.0, False),
        (50.0, 2.0, True),  # restart: 2 counted since
        (50.0, 0.0, False),
        (None, 3.0, False),
    ],
)
def test_preempting_means_the_counter_rose(before, now, expected):
    assert is_preempting(unit("0", 1, preemptions=now), unit("0", 1, preemptions=before)) is expected


def test_without_a_previous_sample_a_unit_is_not_preempting():
    assert is_preempting(unit("0", 1, preemptions=3), None) is False


def test_units_with_unknown_queue_or_free_tokens_add_nothing():
    current = [
        unit("0", 1000, waiting=2),
        vllm(dp_rank="1", kv_used_blocks=10, requests_waiting=None),
        vllm(dp_rank="2", requests_waiting=0.0),
    ]  # no occupancy at all
    result = stranded_capacity(current, {})
    assert result["m"].stranded_tokens == 0.0
    assert (result["m"].idle_units, result["m"].pressured_units) == (1, 1)


def test_samples_without_a_model_name_are_skipped_and_replicas_are_listed():
    result = stranded_capacity([unit("0", 5), vllm(model_name=None), unit("0", 5, replica="r9")], {})
    assert list(result) == ["m"]
    assert result["m"].replicas == ("r0", "r9")


def test_a_queue_must_last_from_the_previous_sample_to_count():
    idle = unit("1", 200)
    caught_arriving = stranded_capacity(
        [unit("0", 300, waiting=1), idle], {unit("0", 300).key: unit("0", 300, waiting=0), idle.key: idle}
    )
    lasting = stranded_capacity(
        [unit("0", 300, waiting=1), idle], {unit("0", 300).key: unit("0", 300, waiting=3), idle.key: idle}
    )
    assert caught_arriving["m"].stranded_tokens == 0.0
    assert lasting["m"].stranded_tokens == 800 * 16


def test_a_unit_with_a_new_queue_is_neither_idle_nor_pressured():
    # its free blocks are about to take the requests it queues: they are not stranded
    lasting, arriving, idle = unit("0", 1000, waiting=2), unit("1", 100, waiting=3), unit("2", 600)
    before = {lasting.key: lasting, arriving.key: unit("1", 100), idle.key: idle}
    result = stranded_capacity([lasting, arriving, idle], before)["m"]
    assert result.stranded_tokens == 400 * 16
    assert (result.idle_units, result.pressured_units) == (1, 1)
